"""``orthros-eval bench-prefill``: time to first token and decode speed, Orthros vs dense.

Both models have the same shape and the same weights (the baseline is the checkpoint with
``attention_type="dense"``), run on the same random prompt on the current device through the same
prefill/decode code, so the ratio isolates the attention pattern: Orthros prefill is
``T*W + T`` attention work per layer against dense's ``T^2/2``; a decode step costs ``W + T``
against ``T``.

TTFT = prefill of the prompt + choosing the first token (best of ``repeats``). Decode tokens/s =
``decode_tokens`` greedy steps continuing the prompt's cache, both models taking turns for
``decode_rounds`` rounds (median), so background load hits both alike. Both decode from a copy of
the cache Orthros' prefill built: a step costs the same whatever the cached values, and the
baseline's quadratic prefill is then only paid for the TTFT column (``max_baseline_length``
skips it on long prompts while the decode ratio is still measured).
"""

from __future__ import annotations

import math
import statistics
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


def measure_prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    repeats: int = 1,
    chunk_size: int | None = None,
    reserve: int = 0,
) -> tuple[dict[str, float], KVCache, torch.Tensor]:
    """Best-of-``repeats`` time to first token on prompts ``ids [B, T]`` (wall and process CPU
    seconds); also the cache and the first tokens."""
    device = next(model.parameters()).device
    b, t = ids.shape
    rows = list(ids.unbind(0))
    best, best_cpu, cache, nxt = math.inf, math.inf, None, None
    for _ in range(max(1, repeats)):
        cache = KVCache(model.config.num_hidden_layers, b)
        cache.reserve(t + reserve)
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        logits, cache = prefill(model, rows, cache, chunk_size)
        nxt = logits.argmax(-1)
        nxt.cpu()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return {"wall": best, "cpu": best_cpu}, cache, nxt


def measure_decode(
    models: dict[str, torch.nn.Module],
    cache: KVCache,
    first: torch.Tensor,
    steps: int,
    rounds: int = 3,
) -> dict[str, dict[str, float]]:
    """Decode tokens/s (wall and process CPU time) of each model continuing a copy of one cache.

    The models take turns, ``steps`` greedy steps per turn, and each reports its median over
    ``rounds`` turns: background load hits both alike. All models share the cache's shapes
    (same config up to the attention pattern), and a step costs the same whatever the cached
    values, so one prefill serves all of them.
    """
    device = next(next(iter(models.values())).parameters()).device
    b = cache.num_rows
    caches = {name: cache.clone(capacity=int(cache.lengths.max()) + rounds * steps + 1) for name in models}
    nxt = {name: first.clone() for name in models}
    wall: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(max(1, rounds)):
        for name, model in models.items():
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            tok = nxt[name]
            for _ in range(steps):
                tok = decode(model, tok, caches[name]).argmax(-1)
            tok.cpu()
            _sync(device)
            wall[name].append(b * steps / (time.perf_counter() - t0))
            cpu[name].append(b * steps / max(time.process_time() - c0, 1e-9))
            nxt[name] = tok
    return {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in models}


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
    decode_rounds: int = 3,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"config", "environment", "rows": [...]}`` (one row per length).

    Per length: TTFT of Orthros and of the baseline (the baseline skipped above
    ``max_baseline_length``), then decode tokens/s of both from the Orthros prompt's cache.
    """
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
        _, c, f = measure_prefill(m, warm, chunk_size=chunk_size, reserve=4)
        measure_decode({"m": m}, c, f, steps=2, rounds=1)
    rows = []
    for t in lengths:
        ids = torch.randint(0, cfg.vocab_size, (batch_size, t), generator=gen)
        row: dict[str, Any] = {"length": t}
        o, cache, first = measure_prefill(orthros, ids, repeats, chunk_size)
        row["orthros_ttft_s"], row["orthros_ttft_cpu_s"] = o["wall"], o["cpu"]
        row["cache_bytes_per_token"] = cache.bytes_per_token()
        if max_baseline_length is None or t <= max_baseline_length:
            d, _, _ = measure_prefill(other, ids, repeats, chunk_size)
            row["dense_ttft_s"], row["dense_ttft_cpu_s"] = d["wall"], d["cpu"]
            row["prefill_speedup"] = d["wall"] / o["wall"]
            row["prefill_speedup_cpu"] = d["cpu"] / max(o["cpu"], 1e-9)
        if decode_tokens > 0:
            tps = measure_decode({"orthros": orthros, "dense": other}, cache, first, decode_tokens, decode_rounds)
            row["orthros_decode_tokens_per_s"] = tps["orthros"]["wall"]
            row["dense_decode_tokens_per_s"] = tps["dense"]["wall"]
            row["decode_ratio"] = tps["orthros"]["wall"] / tps["dense"]["wall"]
            row["decode_ratio_cpu"] = tps["orthros"]["cpu"] / tps["dense"]["cpu"]
        del cache
        if dev.type != "cpu":  # process CPU time says nothing about GPU work
            for key in [k for k in row if "_cpu" in k]:
                del row[key]
        rows.append(row)
        if log is not None:
            log(format_row(row))
        if dev.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
    return {
        "model": str(model_spec),
        "baseline": baseline,
        "config": cfg.to_dict(),
        "num_parameters": cfg.num_parameters(),
        "batch_size": batch_size,
        "decode_tokens": decode_tokens,
        "decode_rounds": decode_rounds,
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
        f"| {_fmt(r.get('dense_decode_tokens_per_s'), '9.1f')} | {_fmt(r.get('decode_ratio'), '5.2f')}x "
        f"| {_fmt(r.get('prefill_speedup_cpu'), '6.2f')}x | {_fmt(r.get('decode_ratio_cpu'), '5.2f')}x |"
    )


TABLE_HEADER = (
    "|  length | Orthros TTFT s | dense TTFT s | prefill dense/Orthros | Orthros decode tok/s "
    "| dense decode tok/s | decode Orthros/dense | prefill ratio (CPU time) | decode ratio (CPU time) |\n"
    "| ------: | -------------: | -----------: | --------------------: | -------------------: "
    "| -----------------: | -------------------: | ---: | ---: |"
)


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    head = (
        f"{result['model']}: {result['num_parameters'] / 1e6:.1f}M parameters, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, window {cfg['sliding_window']}, batch {result['batch_size']}, "
        f"{result['environment']['device']} ({result['environment']['torch_threads']} threads), "
        f"attention backend {cfg['attention_backend']}. Times are wall clock; the CPU-time ratios use "
        "process CPU seconds, which a busy shared machine distorts less (exact with 1 thread)."
    )
    return "\n".join([head, TABLE_HEADER, *(format_row(r) for r in result["rows"])])
