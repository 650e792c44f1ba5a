"""Model FLOPs per token (the unit of MFU) and the per-step metrics log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orthros_train.model.config import OrthrosConfig


def model_flops_per_token(
    cfg: OrthrosConfig, seq_len: int, output_fraction: float = 1.0, training: bool = True
) -> float:
    """Matmul FLOPs per input token of one step (forward, or forward+backward when training).

    Orthros runs the token-wise weights on both streams: every base token in layers 0..L-2 plus
    the K/V projections of the last layer, and every output token (``output_fraction`` of the
    tokens) in all layers plus the LM head. Attention counts 4 * heads * head_dim FLOPs per
    (query, visible key) pair: a base query sees min(W, position + 1) keys, an output query
    (pretrain) sees position + 1 keys. Dense/sliding baselines have one stream.
    """
    d, h, kv, hd, f = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    q_o = 2 * d * h * hd
    k_v = 2 * d * kv * hd
    mlp = 3 * d * f
    layer = q_o + k_v + mlp
    t, w, n_layers = seq_len, cfg.sliding_window, cfg.num_hidden_layers
    causal_keys = (t + 1) / 2  # mean visible keys of a full causal query over positions 0..T-1
    window_keys = (w * (w + 1) / 2 + max(t - w, 0) * w) / t if t > w else causal_keys
    per_pair = 4 * h * hd
    if cfg.attention_type == "orthros":
        matmul = (n_layers - 1) * layer + k_v + output_fraction * (n_layers * layer + d * cfg.vocab_size)
        attn = (n_layers - 1) * window_keys * per_pair + output_fraction * n_layers * causal_keys * per_pair
    else:
        keys = causal_keys if cfg.attention_type == "dense" else window_keys
        matmul = n_layers * layer + d * cfg.vocab_size
        attn = n_layers * keys * per_pair
    forward = 2 * matmul + attn
    return 3 * forward if training else forward


class MetricsLog:
    """One JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to wandb when enabled."""

    def __init__(self, run_dir: Path, wandb_run: Any | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb_run

    def log(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
