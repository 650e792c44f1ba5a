"""The one attention entry point the model calls; picks a backend for the tensors it gets.

Backends: ``reference`` (plain torch, any device, the ground truth); ``triton`` (the fused
kernels of ``ops/triton_attention.py``, deterministic backward) and ``triton_atomic`` (same
forward, dq accumulated with atomics in the backward). The Triton backends are registered as
lazy wrappers: ``triton`` is imported on first use only, so a missing or broken triton never
breaks the reference path. Naming ``triton`` explicitly forces the kernels, also on CPU
tensors (they then need ``TRITON_INTERPRET=1``, as the tests set it).

``sdpa`` (``ops/sdpa_attention.py``) runs every layout through torch's fused
``scaled_dot_product_attention``; it is what ``auto`` picks on CPU for every attention type. On
GPU ``auto`` follows ``ops/route.py``'s table: whole streams (pretraining, the baselines) to
FlashAttention varlen (or SDPA's ``is_causal`` for the causal stream and Triton for the windowed
one where no varlen takes a window), single queries and causal-from-start segments to SDPA, the
rest (answer spans, prefill, sinks, fp32) to Triton (SDPA for everything when triton is not
installed). Callers
that need the log-sum-exp (merging partial attentions) get an op that returns it; the model asks
for the output only (``need_lse=False``), which lets the SDPA path skip it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orthros_train.ops.keys import UNBOUNDED, sink_queries
from orthros_train.ops.reference import attention_reference, attention_with_sinks
from orthros_train.ops.route import (
    RouteFacts,
    VarlenPlan,
    choose_route,
    installed_varlen,
    varlen_streams,
    whole_streams,
)
from orthros_train.ops.sdpa_attention import (
    attention_sdpa,
    attention_sdpa_output,
    needs_mask,
    prepare_segments,
    query_segments,
)

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_BACKENDS: dict[str, AttentionFn] = {"reference": attention_reference, "sdpa": attention_sdpa}
# Variants that skip the log-sum-exp, for callers that only use the output.
_OUTPUT_ONLY: dict[str, AttentionFn] = {"sdpa": attention_sdpa_output}
# Output-only variants that take ``sink_tokens`` themselves; every other backend runs sinks as a
# second partial attention merged by its log-sum-exp (``reference.attention_with_sinks``).
_NATIVE_SINKS: set[AttentionFn] = {attention_sdpa_output}


def _triton_backend(deterministic: bool) -> AttentionFn:
    def run(q, k, v, q_index, q_window, cu_seqlens, scale=None, prepared=None):
        from orthros_train.ops.triton_attention import attention_triton  # lazy: imports triton

        return attention_triton(
            q, k, v, q_index, q_window, cu_seqlens, scale=scale, deterministic=deterministic, prepared=prepared
        )

    run.__name__ = "attention_triton" if deterministic else "attention_triton_atomic"
    return run


def _prepare_triton(q_index, q_window, cu_seqlens, n_k, **hints):
    from orthros_train.ops.triton_attention import plan_forward  # lazy: imports triton

    return plan_forward(q_index, q_window, cu_seqlens, n_k, **hints)


# Backends that precompute per-forward metadata (``prepare_attention``), by backend function.
_PREPARERS: dict[AttentionFn, Callable[..., object]] = {}

if importlib.util.find_spec("triton") is not None:
    _BACKENDS["triton"] = _triton_backend(deterministic=True)
    _BACKENDS["triton_atomic"] = _triton_backend(deterministic=False)
    _PREPARERS[_BACKENDS["triton"]] = _prepare_triton
    _PREPARERS[_BACKENDS["triton_atomic"]] = _prepare_triton
_PREPARERS[attention_sdpa_output] = prepare_segments


def register_backend(name: str, fn: AttentionFn, output_only: AttentionFn | None = None) -> None:
    """Make ``fn`` selectable as ``backend=name`` (used by the kernel modules); ``output_only``
    is an optional faster variant for callers that discard the log-sum-exp."""
    _BACKENDS[name] = fn
    if output_only is not None:
        _OUTPUT_ONLY[name] = output_only


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _choose_cuda(q_index, q_window, cu_seqlens, n_k=None, sink_tokens: int = 0, dtype=None, head_dim=None, **hints):
    """GPU ``auto``'s choice for these queries (``ops/route.py``'s table): ``("varlen",
    VarlenPlan)`` for whole streams FlashAttention serves (``dtype``/``head_dim`` of the queries
    known), ``("sdpa", segments)`` when flash attention needs no mask for any of them, else
    ``("triton", its prepared plan or None)``. With sink tokens the Triton side is the window
    partial plus the sink partial merged by LSE, and its payload is ``(sink_queries result,
    (window plan, sink plan))``; the SDPA side serves sinks itself (a single windowed query gets
    the sinks it lacks; a causal segment has them)."""
    segments = query_segments(q_index, q_window, cu_seqlens)
    streams = None if n_k is None else whole_streams(segments, n_k, q_index.numel())
    route = choose_route(RouteFacts(
        "cuda", sink_tokens=sink_tokens, dtype=dtype, head_dim=head_dim, stream_windows=streams,
        needs_mask=any(needs_mask(seg) for seg in segments), varlen=installed_varlen(), triton="triton" in _BACKENDS,
        deterministic=torch.are_deterministic_algorithms_enabled(),  # trainer.deterministic
    ))
    if route.name == "varlen":  # every segment is a whole document: the longest is max_seqlen
        return "varlen", VarlenPlan(installed_varlen(), streams, max(seg.length for seg in segments))
    if route.name == "split":
        return "split", _plan_split(q_index, q_window, cu_seqlens, n_k, streams)
    if route.name == "sdpa":
        return "sdpa", segments
    if not sink_tokens:
        return "triton", None if n_k is None else _prepare_triton(q_index, q_window, cu_seqlens, n_k, **hints)
    sinks = sink_queries(q_index, q_window, cu_seqlens, sink_tokens)
    if n_k is None:
        return "triton", (sinks, (None, None))
    return "triton", (sinks, _prepare_sink_partials(_prepare_triton, q_index, q_window, cu_seqlens, n_k, sinks,
                                                    sink_tokens, **hints))


def _plan_split(q_index, q_window, cu_seqlens, n_k: int, streams: tuple[int, ...]) -> list[tuple]:
    """Per whole stream ``(rows, kind, payload)``: a causal stream's SDPA segments, a windowed
    stream's Triton plan (every one of its queries is windowed: ``n_band`` is its size)."""
    plans = []
    for s, window in enumerate(streams):
        rows = slice(s * n_k, (s + 1) * n_k)
        index, windows = q_index[rows], q_window[rows]
        if window >= UNBOUNDED:
            plans.append((rows, "sdpa", query_segments(index, windows, cu_seqlens)))
        else:
            plans.append((rows, "triton", _prepare_triton(index, windows, cu_seqlens, n_k, n_band=n_k)))
    return plans


def _split_streams(q, k, v, q_index, q_window, cu_seqlens, plans: list[tuple], scale=None) -> torch.Tensor:
    """The ``split`` route: each whole stream on its own backend, outputs in the queries' order."""
    outs = []
    for rows, kind, payload in plans:
        fn = attention_sdpa_output if kind == "sdpa" else _BACKENDS["triton"]
        outs.append(fn(q[rows], k, v, q_index[rows], q_window[rows], cu_seqlens, scale=scale, prepared=payload)[0])
    return torch.cat(outs)


def _auto_cuda_output(q, k, v, q_index, q_window, cu_seqlens, scale=None, prepared=None, sink_tokens=0, **extra):
    """GPU ``auto`` for output-only callers, the route ``_choose_cuda`` picked: FlashAttention
    varlen for whole streams, the split route, SDPA where it needs no mask, the Triton kernel
    elsewhere (answer spans, prefill, sinks). ``prepared``
    (``_choose_cuda``, once per forward) saves the choice's host sync in every layer. Sink
    tokens: never a path that ignores them (the Triton side merges a sink partial)."""
    if prepared is None:
        prepared = _choose_cuda(q_index, q_window, cu_seqlens, sink_tokens=sink_tokens)
    kind, payload = prepared
    if kind == "varlen":
        return varlen_streams(q, k, v, cu_seqlens, payload, scale=scale), None
    if kind == "split":
        return _split_streams(q, k, v, q_index, q_window, cu_seqlens, payload, scale=scale), None
    if kind == "sdpa":
        return attention_sdpa_output(
            q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=payload, sink_tokens=sink_tokens
        )
    triton = _BACKENDS["triton"]
    if not sink_tokens:
        return triton(q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=payload)
    sinks, payloads = payload
    return attention_with_sinks(
        triton, q, k, v, q_index, q_window, cu_seqlens, sink_tokens, scale=scale, sinks=sinks, prepared=payloads
    )


_NATIVE_SINKS.add(_auto_cuda_output)
_PREPARERS[_auto_cuda_output] = _choose_cuda


def resolve_backend(backend: str, device: torch.device, need_lse: bool = True) -> AttentionFn:
    """The op for ``backend`` on ``device``; ``need_lse=False`` allows a variant returning no LSE."""
    if backend == "auto":
        if device.type == "cuda" and "triton" in _BACKENDS:
            return _auto_cuda_output if not need_lse else _BACKENDS["triton"]
        backend = "sdpa"
    if backend not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; available: {['auto', *available_backends()]}"
        )
    if not need_lse and backend in _OUTPUT_ONLY:
        return _OUTPUT_ONLY[backend]
    return _BACKENDS[backend]


def _prepare_sink_partials(prepare, q_index, q_window, cu_seqlens, n_k: int, sinks, sink_tokens: int, **hints):
    """``(window payload, sink payload)`` of ``prepare`` for a backend that merges a sink partial.
    The sink partial's queries each see at most ``sink_tokens`` keys: all of them are band
    queries, and ``sink_tokens`` bounds their key range (a decode step's grid, no device sync)."""
    rows, s_index, s_window = sinks
    main = prepare(q_index, q_window, cu_seqlens, n_k, **hints)
    if not rows.numel():
        return main, None
    return main, prepare(s_index, s_window, cu_seqlens, n_k, n_band=rows.numel(), max_range=sink_tokens)


@dataclass(frozen=True)
class PreparedAttention:
    """Per-forward metadata of one backend (``prepare_attention``), reused by every layer.

    With sink tokens on a backend that merges a sink partial, ``payload`` is
    ``(sink_queries result, (window payload, sink payload))``."""

    fn: AttentionFn
    payload: object
    sink_tokens: int = 0


def _prepare(fn: AttentionFn, q_index, q_window, cu_seqlens, n_k: int, query=None, **hints) -> object:
    preparer = _PREPARERS.get(fn)
    if preparer is None:
        return None
    if fn is _auto_cuda_output and query is not None:  # the route reads the queries' dtype and head dim
        hints = {**hints, "dtype": query[0], "head_dim": query[1]}
    return preparer(q_index, q_window, cu_seqlens, n_k, **hints)


def prepare_attention(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    backend: str = "auto",
    need_lse: bool = False,
    sink_tokens: int = 0,
    query: tuple[torch.dtype, int] | None = None,
    **hints: int | None,
) -> PreparedAttention | None:
    """What ``backend`` can compute once per forward pass for these queries and keys (the
    Triton kernels: the query sort and tile plan; with sink tokens, the sink partial's queries),
    or ``None`` when it has nothing to prepare.

    Pass the result to every ``orthros_attention`` call of that forward (all layers, and their
    backward through autograd). The layout must already be validated (the phase builders do it
    once per batch): prepared calls skip the per-call value checks, which each cost a device
    sync. ``hints`` are host-known counts (``n_band``: queries with a window of at most ``n_k``
    keys; ``max_range``: the longest key range, for decode steps) that save further syncs.
    ``query``: the queries' ``(dtype, head_dim)``, which GPU ``auto``'s FlashAttention route needs
    (without it that route is not taken).
    """
    if sink_tokens:
        fn = resolve_backend(backend, q_index.device, need_lse=need_lse)
        if fn in _NATIVE_SINKS:
            payload = _prepare(fn, q_index, q_window, cu_seqlens, n_k, query, sink_tokens=sink_tokens, **hints)
            return PreparedAttention(fn, payload, sink_tokens)
        fn = resolve_backend(backend, q_index.device, need_lse=True)
        sinks = sink_queries(q_index, q_window, cu_seqlens, sink_tokens)
        payloads = _prepare_sink_partials(
            lambda *a, **kw: _prepare(fn, *a, **kw), q_index, q_window, cu_seqlens, n_k, sinks, sink_tokens, **hints
        )
        return PreparedAttention(fn, (sinks, payloads), sink_tokens)
    fn = resolve_backend(backend, q_index.device, need_lse=need_lse)
    payload = _prepare(fn, q_index, q_window, cu_seqlens, n_k, query, **hints)
    return None if payload is None else PreparedAttention(fn, payload)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    prepared: PreparedAttention | None = None,
    sink_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the op on ``backend`` (the backend's LSE-returning variant), sink tokens
    included; for callers that merge partial attentions (context parallelism)."""
    fn = resolve_backend(backend, q.device, need_lse=True)
    if sink_tokens:
        if prepared is not None and prepared.fn is fn and prepared.sink_tokens == sink_tokens:
            sinks, payloads = prepared.payload
            return attention_with_sinks(
                fn, q, k, v, q_index, q_window, cu_seqlens, sink_tokens, scale=scale, sinks=sinks, prepared=payloads
            )
        return attention_with_sinks(fn, q, k, v, q_index, q_window, cu_seqlens, sink_tokens, scale=scale)
    if prepared is not None and prepared.fn is fn and not prepared.sink_tokens:
        return fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=prepared.payload)
    return fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale)


def orthros_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    prepared: PreparedAttention | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Attention of both streams over the base keys (see ``ops/reference.py`` for the contract,
    sink tokens included).

    ``prepared``: this forward's ``prepare_attention`` result (used when it belongs to the
    backend that runs).
    """
    fn = resolve_backend(backend, q.device, need_lse=False)
    if sink_tokens and fn not in _NATIVE_SINKS:
        out, _ = attention_with_lse(
            q, k, v, q_index, q_window, cu_seqlens, scale=scale, backend=backend, prepared=prepared,
            sink_tokens=sink_tokens,
        )
        return out
    kw = {"sink_tokens": sink_tokens} if sink_tokens else {}
    if prepared is not None and prepared.fn is fn and prepared.sink_tokens == sink_tokens:
        out, _ = fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=prepared.payload, **kw)
    else:
        out, _ = fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale, **kw)
    return out


__all__ = [
    "UNBOUNDED", "PreparedAttention", "attention_with_lse", "orthros_attention", "prepare_attention",
    "register_backend", "available_backends",
]
