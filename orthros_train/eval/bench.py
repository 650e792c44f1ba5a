"""``orthros-eval bench-prefill``: time to first token and decode speed, Orthros vs dense.

Both models have the same shape and the same weights (the baseline is the checkpoint with
``attention_type="dense"``), run on the same random prompt on the current device through the same
prefill/decode code, so the ratio isolates the attention pattern: Orthros prefill is
``T*W + T`` attention work per layer against dense's ``T^2/2``; a decode step costs ``W + T``
against ``T``.

TTFT = prefill of the prompt + choosing the first token (best of ``repeats``). Decode tokens/s =
``decode_tokens`` greedy steps continuing that prompt's cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orthros_train.eval.common import environment
from orthros_train.infer.generate import decode, prefill
from orthros_train.infer.loading import dense_twin, load_model
from orthros_train.model.cache import KVCache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    model: torch.nn.Module,
    ids: torch.Tensor,
    decode_tokens: int,
    repeats: int = 1,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """TTFT (best of ``repeats``) and decode tokens/s of one model on prompts ``ids [B, T]``."""
    device = next(model.parameters()).device
    b, t = ids.shape
    rows = list(ids.unbind(0))
    best, cache = math.inf, None
    for _ in range(max(1, repeats)):
        cache = KVCache(model.config.num_hidden_layers, b)
        cache.reserve(t + decode_tokens + 1)
        _sync(device)
        t0 = time.perf_counter()
        logits, cache = prefill(model, rows, cache, chunk_size)
        nxt = logits.argmax(-1)
        nxt.cpu()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    result: dict[str, Any] = {"ttft_s": best, "cache_bytes_per_token": cache.bytes_per_token()}
    if decode_tokens > 0:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            nxt = decode(model, nxt, cache).argmax(-1)
        nxt.cpu()
        _sync(device)
        elapsed = time.perf_counter() - t0
        result["decode_tokens_per_s"] = b * decode_tokens / elapsed
        result["decode_step_ms"] = 1000 * elapsed / decode_tokens
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return result


def bench_prefill(
    model_spec: str | Path,
    lengths: list[int],
    device: str | None = None,
    dtype: str | None = None,
    baseline: str = "dense",
    decode_tokens: int = 16,
    repeats: int = 1,
    chunk_size: int | None = None,
    batch_size: int = 1,
    max_baseline_length: int | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"config", "environment", "rows": [...]}`` (one row per length)."""
    overrides = dict(overrides or {})
    overrides.setdefault("attention_type", "orthros")
    orthros = load_model(model_spec, device=device, dtype=dtype, seed=seed, **overrides)
    other = dense_twin(orthros, baseline)
    dev = next(orthros.parameters()).device
    cfg = orthros.config
    gen = torch.Generator().manual_seed(seed)
    # Warm-up: first calls pay allocator/kernel-selection costs that a long run amortises.
    warm = torch.randint(0, cfg.vocab_size, (batch_size, min(2 * cfg.sliding_window, 256)), generator=gen)
    for m in (orthros, other):
        measure(m, warm, decode_tokens=2, chunk_size=chunk_size)
    rows = []
    for t in lengths:
        ids = torch.randint(0, cfg.vocab_size, (batch_size, t), generator=gen)
        row: dict[str, Any] = {"length": t}
        o = measure(orthros, ids, decode_tokens, repeats, chunk_size)
        row.update({f"orthros_{k}": v for k, v in o.items()})
        if max_baseline_length is None or t <= max_baseline_length:
            d = measure(other, ids, decode_tokens, repeats, chunk_size)
            row.update({f"dense_{k}": v for k, v in d.items()})
            row["prefill_speedup"] = d["ttft_s"] / o["ttft_s"]
            if decode_tokens > 0:
                row["decode_ratio"] = o["decode_tokens_per_s"] / d["decode_tokens_per_s"]
        rows.append(row)
        if log is not None:
            log(format_row(row))
    return {
        "model": str(model_spec),
        "baseline": baseline,
        "config": cfg.to_dict(),
        "num_parameters": cfg.num_parameters(),
        "batch_size": batch_size,
        "decode_tokens": decode_tokens,
        "repeats": repeats,
        "prefill_chunk_size": chunk_size,
        "environment": environment(dev),
        "rows": rows,
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['length']:>7} | {_fmt(r.get('orthros_ttft_s'), '9.3f')} | {_fmt(r.get('dense_ttft_s'), '9.3f')} "
        f"| {_fmt(r.get('prefill_speedup'), '6.2f')}x | {_fmt(r.get('orthros_decode_tokens_per_s'), '9.1f')} "
        f"| {_fmt(r.get('dense_decode_tokens_per_s'), '9.1f')} | {_fmt(r.get('decode_ratio'), '5.2f')}x |"
    )


TABLE_HEADER = (
    "|  length | Orthros TTFT s | dense TTFT s | prefill dense/Orthros | Orthros decode tok/s "
    "| dense decode tok/s | decode Orthros/dense |\n"
    "| ------: | -------------: | -----------: | --------------------: | -------------------: "
    "| -----------------: | -------------------: |"
)


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    head = (
        f"{result['model']}: {result['num_parameters'] / 1e6:.1f}M parameters, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, window {cfg['sliding_window']}, batch {result['batch_size']}, "
        f"{result['environment']['device']} ({result['environment']['torch_threads']} threads), "
        f"attention backend {cfg['attention_backend']}"
    )
    return "\n".join([head, TABLE_HEADER, *(format_row(r) for r in result["rows"])])
