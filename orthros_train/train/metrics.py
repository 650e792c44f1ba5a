"""Model FLOPs per token (the unit of MFU) and the per-step metrics log."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from orthros_train.common.files import write_atomic
from orthros_train.model.config import OrthrosConfig
from orthros_train.phase.layout import OrthrosLayout

log = logging.getLogger(__name__)

TERA = 1e12  # FLOP/s per TFLOP/s


def model_flops_per_token(cfg: OrthrosConfig, seq_len: int) -> float:
    """Training FLOPs per token of one pretraining sequence of ``seq_len`` (an output token on
    every position): ``layout_flops`` of that layout, so planning and live MFU share one formula."""
    from orthros_train.phase.builders import pretrain_layout

    return layout_flops(cfg, pretrain_layout(torch.zeros((1, seq_len), dtype=torch.long))) / seq_len


def layout_flops(cfg: OrthrosConfig, layout: OrthrosLayout, training: bool = True) -> float:
    """Model FLOPs of one batch from its actual layout (any phase).

    Counts what the model really computes: token-wise weights on the base tokens of layers
    0..L-2 (+ the last layer's K/V projections) and on every output token in all layers, the LM
    head on output tokens, and attention over the exact number of visible (query, key) pairs of
    each stream (window-clipped for base queries, document-clipped for both). A sparse (MoE) layer
    counts its active weights: the router, the top-k experts and the shared expert. For an sft layout
    with few answer tokens this is close to a sliding-window model; for pretrain it is the
    Orthros cost of a pretraining layout (T*W + T^2/2 pairs per layer).
    """
    from orthros_train.model.orthros import global_queries
    from orthros_train.ops.keys import UNBOUNDED, visible_keys

    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Weights a token multiplies by in each layer: q/k/v/o and its MLP (a sparse layer's router, its
    # top-k experts and the shared expert: the active parameters).
    attention = 2 * d * h * hd + 2 * d * kv * hd
    layers = [attention + cfg.mlp_parameters(i, active=True) for i in range(cfg.num_hidden_layers)]
    k_v = 2 * d * kv * hd
    n_layers = cfg.num_hidden_layers
    t, n = layout.num_tokens, layout.num_outputs
    layout = layout.to("cpu")
    base_index = torch.arange(t)
    # the key rule's windows: W, or the whole document for the global tail's queries
    base_window = cfg.key_rule.base_windows(global_queries(cfg, layout).get("base_global"), base_index)
    base_pairs = float(visible_keys(base_index, base_window, layout.cu_seqlens, cfg.base_sink_tokens).sum())
    per_pair = 4 * h * hd
    if cfg.attention_type == "orthros":
        out_pairs = float(visible_keys(layout.output_index, torch.full((n,), UNBOUNDED), layout.cu_seqlens).sum())
        matmul = t * (sum(layers[:-1]) + k_v) + n * (sum(layers) + d * cfg.vocab_size)
        attn = per_pair * ((n_layers - 1) * base_pairs + n_layers * out_pairs)
    else:
        matmul = t * sum(layers) + n * d * cfg.vocab_size
        attn = per_pair * n_layers * base_pairs
    forward = 2 * matmul + attn
    return 3 * forward if training else forward


# Dense bf16 tensor-core peaks (TFLOP/s per device) used for MFU, as Megatron/torchtitan do.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The device's peak for MFU: ``override`` (``trainer.peak_tflops``) or a known GPU's."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def set_aside_rows_after(path: Path, step: int) -> Path | None:
    """A run resumed at ``step`` trains the steps after it again: their rows from the first attempt
    (written after the checkpoint it resumes, before it died) move to a file of their own, named in
    the log, so ``metrics.jsonl`` holds each step once. A row cut short by the crash goes with them.
    Returns the file the rows went to (None when nothing was past ``step``)."""
    if not path.is_file() or _ends_at_or_before(path, step):
        return None
    kept, moved = [], []
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            moved.append(line if line.endswith("\n") else line + "\n")  # a partial last row
            continue
        (moved if isinstance(row_step, int) and row_step > step else kept).append(line)
    if not moved:
        return None
    n = 1
    while (aside := path.with_name(f"metrics.after-step-{step}.attempt-{n}.jsonl")).exists():
        n += 1
    aside.write_text("".join(moved))
    write_atomic(path, "".join(kept))  # a crash now leaves the old file (rows also in aside)
    log.warning(
        "resumed at step %d: %d metrics row(s) past it from the interrupted attempt moved to %s; "
        "metrics.jsonl holds each step once", step, len(moved), aside,
    )
    return aside


def _ends_at_or_before(path: Path, step: int) -> bool:
    """Whether the log's last row is whole and at most ``step`` (the usual resume: nothing to move),
    read from the file's end only, so a long run's log is not read whole at every resume."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return True
        f.seek(max(0, size - 65536))
        tail = f.read()
    if not tail.endswith(b"\n"):
        return False  # a row cut short by the crash
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        row_step = json.loads(last).get("step")
    except (ValueError, AttributeError):
        return False
    # Rows are appended in step order, so the last one bounds them all.
    return isinstance(row_step, int) and row_step <= step


class MetricsLog:
    """One JSON object per line in ``<run_dir>/metrics.jsonl``, mirrored to wandb when enabled."""

    def __init__(self, run_dir: Path, wandb_run: Any | None = None, initial_step: int = 0) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb_run
        self.set_aside = set_aside_rows_after(self.path, initial_step)


    def log(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
