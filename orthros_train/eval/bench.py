"""``orthros-eval bench-prefill``: time to first token and decode speed against the strongest peers.

Per prompt length, three models of the same shape on the same random prompt and device:

* **Orthros** (the model under test);
* the **dense baseline** of this repository: the same weights with ``attention_type="dense"``
  (or ``sliding``), run through the same prefill/decode code and the same attention op, which on
  CPU is torch SDPA (``is_causal`` flash attention);
* the **peer a user would pick**: transformers' ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` for a
  q/k-norm model) of the same shape with ``attn_implementation="sdpa"``, prefilled with
  ``use_cache=True, logits_to_keep=1`` and decoded from its own ``DynamicCache``.

Beside each prefill ratio stands its physical limit, the FLOP ratio: forward FLOPs per token of
dense (linear + ``2*T*d`` causal attention per layer) over Orthros (linear + ``4*W*d`` per layer),
counting every layer of Orthros in full (its last layer skips the base stream's attention output
and MLP; that saving is *not* credited). ``% of limit`` is the measured ratio over that limit. A
ratio above the FLOP ratio *with* the skip credited (``limit_with_skip``) cannot come from doing
fewer FLOPs and is flagged ``weak baseline``: the baseline runs its FLOPs slower than Orthros
runs its own (on CPU, SDPA's causal attention kernel runs below the GEMM rate).

TTFT = prefill of the prompt + choosing the first token (best of ``repeats``). Decode tokens/s =
``decode_tokens`` greedy steps continuing each model's cache, the models taking turns for
``decode_rounds`` rounds (median), so background load hits all alike. Orthros and the dense
baseline decode from copies of the cache Orthros' prefill built (a step costs the same whatever
the cached values); the peer decodes from its own prefill's cache. On CPU the ratios use process
CPU time (``time.process_time``), which a busy shared machine distorts less than wall time.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orthros_train.eval.common import environment
from orthros_train.infer.generate import ChunkSize, decode, prefill
from orthros_train.infer.loading import dense_twin, load_model
from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig

Stepper = Callable[[torch.Tensor], torch.Tensor]  # next token ids [B] -> following ones [B]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_flop_limits(cfg: OrthrosConfig, length: int) -> tuple[float, float]:
    """FLOP ratio dense / Orthros of a prefill of ``length`` tokens: ``(limit, limit_with_skip)``.

    Per token and layer: linear ``2 * (q, k, v, o and MLP weights)``; causal dense attention
    ``4 * d_attn`` per (query, key) pair over ``length / 2`` keys on average, Orthros' base stream
    over ``min(W, length)``. ``limit`` counts all Orthros layers in full; ``limit_with_skip``
    credits its last layer doing only the K/V projections.
    """
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_hidden_layers
    mlp = sum(cfg.mlp_parameters(i, active=True) for i in range(n)) / n  # a sparse layer's active weights
    linear = 2 * (2 * d * h * hd + 2 * d * kv * hd + mlp)
    per_pair = 4 * h * hd
    dense = n * (linear + per_pair * length / 2)
    window = cfg.sliding_window if cfg.attention_type == "orthros" else length
    orthros_layer = linear + per_pair * min(window, length)
    orthros = n * orthros_layer
    orthros_skip = (n - 1) * orthros_layer + 2 * 2 * d * kv * hd
    return dense / orthros, dense / orthros_skip


def tail_flop_ratios(cfg: OrthrosConfig, length: int, tail: int) -> tuple[float, float]:
    """FLOP ratio of a prefill with the global tail ``tail`` over the same prefill without it:
    ``(model, base_attention)``. The tail's ``R`` base queries see every earlier key instead of the
    ``W + S`` of a windowed one (``ops/keys.py``); the base stream's attention grows by
    ``R (T - W - S) / (T (W + S))``, about ``R / (W + S)`` at any length, the model by that share of
    its per-token FLOPs."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = cfg.num_hidden_layers
    mlp = sum(cfg.mlp_parameters(i, active=True) for i in range(n)) / n
    linear = 2 * (2 * d * h * hd + 2 * d * kv * hd + mlp)
    per_pair = 4 * h * hd
    seen = min(cfg.sliding_window + cfg.sink_tokens, length)
    base = length * seen
    extra = min(tail, length) * max(length - seen, 0)
    return (1 + per_pair * extra / (length * (linear + per_pair * seen)), 1 + extra / base)


@dataclasses.dataclass
class _Tail:
    """The model read with ``base_global_tail = R`` for one timing (a config field every pass reads)."""

    model: torch.nn.Module
    tail: int

    def __enter__(self) -> torch.nn.Module:
        self.old = self.model.config.base_global_tail
        self.model.config.base_global_tail = self.tail
        return self.model

    def __exit__(self, *exc: object) -> None:
        self.model.config.base_global_tail = self.old


def _tail_prefill(row: dict[str, Any], model: torch.nn.Module, ids: torch.Tensor, o: dict[str, float],
                  tails: list[int], repeats: int, chunk_size: ChunkSize, time_key: str) -> None:
    """TTFT of each global tail ``R`` (``model.base_global_tail``) beside Orthros without it and the dense
    twin, with ``tail_flop_ratios`` (``row['tails']``; none when ``tails`` is empty)."""
    if tails:
        row["tails"] = []
    for tail in tails:
        with _Tail(model, tail):
            m, _, _ = measure_prefill(model, ids, repeats, chunk_size)
        model_ratio, attention_ratio = tail_flop_ratios(model.config, ids.shape[1], tail)
        dense = row.get(f"dense_ttft{'_cpu' if time_key == 'cpu' else ''}_s")
        row["tails"].append({"tail": tail, "ttft_s": m["wall"], "ttft_cpu_s": m["cpu"],
                             "over_orthros": m[time_key] / max(o[time_key], 1e-9),
                             "dense_over_tail": None if dense is None else dense / max(m[time_key], 1e-9),
                             "flop_ratio": model_ratio, "base_attention_flop_ratio": attention_ratio})


# -- the transformers peer ---------------------------------------------------------------------


def _cache_field() -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache`` (argument and output field)."""
    try:
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "past_key_values"
    return "cache" if any(f.name == "cache" for f in dataclasses.fields(CausalLMOutputWithPast)) else "past_key_values"


_CACHE = _cache_field()


def transformers_peer(cfg: OrthrosConfig, max_length: int, seed: int = 0) -> tuple[torch.nn.Module | None, str]:
    """transformers' dense model of ``cfg``'s shape with SDPA attention, random weights.

    Llama for plain models, Qwen3 for q/k-norm models; ``(None, reason)`` for shapes neither
    covers (attention biases: Qwen2 has them only on q/k/v, Orthros configs may differ).
    """
    try:
        import transformers
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None, "transformers is not installed"
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=max(max_length, 2048),
        tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="sdpa",
    )  # fmt: skip
    if cfg.attention_bias:
        return None, "no transformers peer for attention biases"
    if cfg.qk_norm:
        config, cls, name = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM, "Qwen3"
    else:
        config, cls, name = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM, "Llama"
    torch.manual_seed(seed)
    return cls(config).eval(), f"transformers {name}ForCausalLM (sdpa)"


@torch.no_grad()
def measure_peer_prefill(peer: torch.nn.Module, ids: torch.Tensor, repeats: int = 1):
    """Best-of-``repeats`` TTFT of the transformers peer; also its cache and first tokens."""
    device = next(peer.parameters()).device
    best, best_cpu, cache, nxt = math.inf, math.inf, None, None
    ids = ids.to(device)
    for _ in range(max(1, repeats)):
        cache = None
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = peer(ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        nxt.cpu()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        cache = getattr(out, _CACHE)
    return {"wall": best, "cpu": best_cpu}, cache, nxt


def peer_stepper(peer: torch.nn.Module, cache) -> Stepper:
    @torch.no_grad()
    def step(tok: torch.Tensor) -> torch.Tensor:
        out = peer(tok.reshape(-1, 1), use_cache=True, **{_CACHE: cache})
        return out.logits[:, -1].argmax(-1)

    return step


# -- this repository's models -------------------------------------------------------------------


def measure_prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    repeats: int = 1,
    chunk_size: ChunkSize = "auto",
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


def model_stepper(model: torch.nn.Module, cache: KVCache, cuda_graph: bool = False) -> Stepper:
    """Greedy steps continuing ``cache``; ``cuda_graph``: the static step (``infer/static_decode.py``),
    captured before the first timed step on CUDA, run without a graph elsewhere."""
    if not cuda_graph:
        return lambda tok: decode(model, tok, cache).argmax(-1)
    from orthros_train.infer.static_decode import StaticDecoder

    decoder = StaticDecoder(model, cache, graph=next(model.parameters()).device.type == "cuda")
    decoder.capture()
    rows = list(range(cache.num_rows))
    return lambda tok: decoder.step(rows, tok).argmax(-1)


def measure_decode(
    steppers: dict[str, Stepper], first: dict[str, torch.Tensor], steps: int, rounds: int = 3, device=None
) -> dict[str, dict[str, float]]:
    """Decode tokens/s (wall and process CPU time) of each stepper, continuing its own cache.

    The models take turns, ``steps`` greedy steps per turn, and each reports its median over
    ``rounds`` turns: background load hits all alike.
    """
    device = torch.device("cpu") if device is None else device
    nxt = {name: tok.clone() for name, tok in first.items()}
    b = next(iter(first.values())).numel()
    wall: dict[str, list[float]] = {name: [] for name in steppers}
    cpu: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(max(1, rounds)):
        for name, step in steppers.items():
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            tok = nxt[name]
            for _ in range(steps):
                tok = step(tok)
            tok.cpu()
            _sync(device)
            wall[name].append(b * steps / (time.perf_counter() - t0))
            cpu[name].append(b * steps / max(time.process_time() - c0, 1e-9))
            nxt[name] = tok
    return {name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])} for name in steppers}


def _warm_up(orthros, other, peer_model, batch_size: int, chunk_size: ChunkSize, gen, dev) -> None:
    """First calls pay allocator/kernel-selection costs that a long run amortises; pay them on a
    short prompt before timing anything (drawn from ``gen`` first, so the timed prompts that
    follow stay the same for a given seed)."""
    cfg = orthros.config
    warm = torch.randint(0, cfg.vocab_size, (batch_size, min(2 * cfg.sliding_window, 256)), generator=gen)
    for m in (orthros, other):
        _, c, f = measure_prefill(m, warm, chunk_size=chunk_size, reserve=4)
        measure_decode({"m": model_stepper(m, c)}, {"m": f}, steps=2, rounds=1, device=dev)
    if peer_model is not None:
        _, c, f = measure_peer_prefill(peer_model, warm)
        measure_decode({"m": peer_stepper(peer_model, c)}, {"m": f}, steps=2, rounds=1, device=dev)


def _baseline_prefill(row, o, other, peer_model, ids, repeats: int, chunk_size: ChunkSize, time_key: str):
    """Time the dense twin and the transformers peer on ``ids`` into ``row`` next to Orthros's
    times ``o``; returns the peer's cache and first tokens (None, None without a peer) so its
    decode can continue from them."""
    peer_cache = peer_first = None
    d, _, _ = measure_prefill(other, ids, repeats, chunk_size)
    row["dense_ttft_s"], row["dense_ttft_cpu_s"] = d["wall"], d["cpu"]
    row["prefill_speedup"] = d["wall"] / o["wall"]
    row["prefill_speedup_cpu"] = d["cpu"] / max(o["cpu"], 1e-9)
    if peer_model is not None:
        pr, peer_cache, peer_first = measure_peer_prefill(peer_model, ids, repeats)
        row["peer_ttft_s"], row["peer_ttft_cpu_s"] = pr["wall"], pr["cpu"]
        row["peer_speedup"] = pr["wall"] / o["wall"]
        row["peer_speedup_cpu"] = pr["cpu"] / max(o["cpu"], 1e-9)
    # The headline ratio is against the peer when there is one: it is the stronger baseline.
    ratios = [row.get(f"{k}_speedup{'_cpu' if time_key == 'cpu' else ''}") for k in ("peer", "prefill")]
    main = ratios[0] if ratios[0] is not None else ratios[1]
    row["pct_of_limit"] = 100.0 * main / row["flop_limit"]
    # A baseline beaten by more than the FLOP limit allows is slower than it should be.
    weak = [n for n, r in zip(("peer", "dense"), ratios) if r is not None and r > row["flop_limit_with_skip"]]
    row["weak_baselines"], row["weak_baseline"] = weak, bool(weak)
    return peer_cache, peer_first


def _load_peer(orthros: torch.nn.Module, max_length: int, seed: int):
    """The transformers peer of ``orthros`` on its device and dtype; (None, why) when there is none."""
    peer_model, peer_name = transformers_peer(orthros.config, max_length, seed)
    if peer_model is not None:
        p = next(orthros.parameters())
        peer_model = peer_model.to(device=p.device, dtype=p.dtype)
    return peer_model, peer_name


def _decode_steppers(orthros, other, cache: KVCache, first: torch.Tensor, steps: int, cuda_graph: bool = False):
    """Steppers for Orthros and the dense twin continuing from the same prefill: each gets its own
    copy of ``cache``, with room for ``steps`` more tokens, so neither sees the other's decode."""
    capacity = int(cache.lengths.max()) + steps + 1
    steppers: dict[str, Stepper] = {}
    firsts: dict[str, torch.Tensor] = {}
    for name, m in (("orthros", orthros), ("dense", other)):
        steppers[name], firsts[name] = model_stepper(m, cache.clone(capacity=capacity), cuda_graph), first
    return steppers, firsts


def _record_decode(row: dict[str, Any], tps: dict[str, dict[str, float]]) -> None:
    """Decode tokens/s of each model and Orthros's ratios to the dense twin and the peer."""
    for name in tps:
        row[f"{name}_decode_tokens_per_s"] = tps[name]["wall"]
        row[f"{name}_decode_tokens_per_s_cpu"] = tps[name]["cpu"]
    row["decode_ratio"] = tps["orthros"]["wall"] / tps["dense"]["wall"]
    row["decode_ratio_cpu"] = tps["orthros"]["cpu"] / tps["dense"]["cpu"]
    if "peer" in tps:
        row["peer_decode_ratio"] = tps["orthros"]["wall"] / tps["peer"]["wall"]
        row["peer_decode_ratio_cpu"] = tps["orthros"]["cpu"] / tps["peer"]["cpu"]


def bench_prefill(
    model_spec: str | Path,
    lengths: list[int],
    device: str | None = None,
    dtype: str | None = None,
    baseline: str = "dense",
    decode_tokens: int = 16,
    repeats: int = 1,
    chunk_size: ChunkSize = "auto",
    batch_size: int = 1,
    max_baseline_length: int | None = None,
    decode_rounds: int = 3,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = print,
    peer: bool = True,
    cuda_graph: bool = False,
    global_tails: list[int] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"config", "environment", "rows": [...]}`` (one row per length).

    Per length: TTFT of Orthros, of the dense baseline and of the transformers peer (both
    baselines skipped above ``max_baseline_length``), then decode tokens/s of all three.
    ``chunk_size`` is the prefill chunking of this repository's models (``"auto"``: each model's
    default, see ``infer.generate``; None: one forward). ``cuda_graph``: Orthros and the dense twin
    decode through the static step, captured in a CUDA graph on a GPU (the peer decodes eagerly).
    ``global_tails``: also the prefill with each global tail R (``_tail_prefill``).
    """
    overrides = dict(overrides or {})
    overrides.setdefault("attention_type", "orthros")
    orthros = load_model(model_spec, device=device, dtype=dtype, seed=seed, **overrides)
    other = dense_twin(orthros, baseline)
    dev = next(orthros.parameters()).device
    cfg = orthros.config
    peer_model, peer_name = None, "not run"
    if peer:
        peer_model, peer_name = _load_peer(orthros, max(lengths) + 4 * decode_tokens, seed)
    time_key = "cpu" if dev.type == "cpu" else "wall"
    gen = torch.Generator().manual_seed(seed)
    _warm_up(orthros, other, peer_model, batch_size, chunk_size, gen, dev)
    rows = []
    for t in lengths:
        ids = torch.randint(0, cfg.vocab_size, (batch_size, t), generator=gen)
        row: dict[str, Any] = {"length": t}
        row["flop_limit"], row["flop_limit_with_skip"] = prefill_flop_limits(cfg, t)
        o, cache, first = measure_prefill(orthros, ids, repeats, chunk_size)
        row["orthros_ttft_s"], row["orthros_ttft_cpu_s"] = o["wall"], o["cpu"]
        row["cache_bytes_per_token"] = cache.bytes_per_token()
        peer_cache = peer_first = None
        if max_baseline_length is None or t <= max_baseline_length:
            peer_cache, peer_first = _baseline_prefill(row, o, other, peer_model, ids, repeats, chunk_size, time_key)
        _tail_prefill(row, orthros, ids, o, list(global_tails or ()), repeats, chunk_size, time_key)
        if decode_tokens > 0:
            steppers, firsts = _decode_steppers(orthros, other, cache, first, decode_tokens * decode_rounds, cuda_graph)
            if peer_cache is not None:
                steppers["peer"], firsts["peer"] = peer_stepper(peer_model, peer_cache), peer_first
            _record_decode(row, measure_decode(steppers, firsts, decode_tokens, decode_rounds, device=dev))
        del cache, peer_cache
        if dev.type != "cpu":  # process CPU time says nothing about GPU work
            row = {k: v for k, v in row.items() if "_cpu" not in k}
        rows.append(row)
        if log is not None:
            log(format_row(row, time_key))
        if dev.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
    return {
        "model": str(model_spec), "baseline": baseline, "peer": peer_name,
        "time_basis": "process CPU time" if time_key == "cpu" else "wall clock",
        "config": cfg.to_dict(),
        "num_parameters": cfg.num_parameters(),
        "batch_size": batch_size,
        "decode_tokens": decode_tokens, "decode_rounds": decode_rounds,
        "decode_step": ("static, CUDA graph" if dev.type == "cuda" else "static") if cuda_graph else "eager",
        "repeats": repeats, "prefill_chunk_size": chunk_size,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "environment": environment(dev),
        "rows": rows,
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(r: dict[str, Any], time_key: str = "cpu") -> str:
    c = "_cpu" if time_key == "cpu" else ""
    t = "_cpu_s" if time_key == "cpu" else "_s"
    flag = f"weak baseline: {', '.join(r['weak_baselines'])}" if r.get("weak_baselines") else ""
    return (
        f"| {r['length']:>7} | {_fmt(r.get(f'orthros_ttft{t}'), '8.3f')} | {_fmt(r.get(f'peer_ttft{t}'), '8.3f')} "
        f"| {_fmt(r.get(f'dense_ttft{t}'), '8.3f')} | {_fmt(r.get(f'peer_speedup{c}'), '6.2f')}x "
        f"| {_fmt(r.get('flop_limit'), '5.2f')}x | {_fmt(r.get('pct_of_limit'), '4.0f')}% "
        f"| {_fmt(r.get(f'prefill_speedup{c}'), '6.2f')}x "
        f"| {_fmt(r.get(f'orthros_decode_tokens_per_s{c}'), '7.1f')} "
        f"| {_fmt(r.get(f'peer_decode_tokens_per_s{c}'), '7.1f')} "
        f"| {_fmt(r.get(f'peer_decode_ratio{c}'), '5.2f')}x | {_fmt(r.get(f'decode_ratio{c}'), '5.2f')}x | {flag} |"
    )


TABLE_HEADER = (
    "|  prompt | Orthros TTFT s | peer TTFT s | dense TTFT s | prefill peer/Orthros | FLOP limit "
    "| % of limit | prefill dense/Orthros | Orthros decode tok/s | peer decode tok/s "
    "| decode Orthros/peer | decode Orthros/dense | |\n"
    "| ------: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
)


TAIL_HEADER = (
    "|  prompt | R | Orthros TTFT s | tail TTFT s | tail/Orthros | FLOP ratio (model) "
    "| FLOP ratio (base attention, ~1 + R/(W+S)) | dense/tail |\n"
    "| ------: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def format_tail_table(result: dict[str, Any]) -> str:
    """The global-tail rows (``global_tails``), '' when none was measured."""
    t = "_cpu_s" if result.get("time_basis", "").startswith("process") else "_s"
    lines = [f"| {r['length']:>7} | {x['tail']} | {_fmt(r.get(f'orthros_ttft{t}'), '8.3f')} "
             f"| {_fmt(x[f'ttft{t}'], '8.3f')} | {x['over_orthros']:5.3f}x | {x['flop_ratio']:5.3f}x "
             f"| {x['base_attention_flop_ratio']:5.3f}x | {_fmt(x['dense_over_tail'], '6.2f')}x |"
             for r in result["rows"] for x in r.get("tails", ())]
    return "\n".join([TAIL_HEADER, *lines]) if lines else ""


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    env = result["environment"]
    time_key = "cpu" if result.get("time_basis", "").startswith("process") else "wall"
    head = (
        f"{result['model']}: {result['num_parameters'] / 1e6:.1f}M parameters, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, window {cfg['sliding_window']}, batch {result['batch_size']}; "
        f"{env['device']} {env.get('gpu') or env.get('cpu', '')}, {env['torch_threads']} threads, "
        f"torch {env['torch']}, "
        f"{result.get('date', '')}. Decode step: {result.get('decode_step', 'eager')}. "
        f"Peer: {result.get('peer', '-')}; dense: this repository's {result['baseline']} "
        f"baseline (same weights, attention backend {cfg['attention_backend']}). Times and ratios: "
        f"{result.get('time_basis', 'wall clock')}, best of {result['repeats']}. FLOP limit: dense/Orthros forward "
        "FLOPs per token (Orthros' last-layer skip not credited); 'weak baseline': a ratio above the FLOP ratio "
        "with that skip credited."
    )
    table = "\n".join([head, TABLE_HEADER, *(format_row(r, time_key) for r in result["rows"])])
    tails = format_tail_table(result)
    return f"{table}\n\nThe global tail (prefill with base_global_tail = R):\n{tails}" if tails else table
