"""The one attention entry point the model calls; picks a backend for the tensors it gets.

Backends: ``reference`` (plain torch, any device, the ground truth); ``triton`` (the fused
kernels of ``ops/triton_attention.py``, deterministic backward) and ``triton_atomic`` (same
forward, dq accumulated with atomics in the backward). The Triton backends are registered as
lazy wrappers: ``triton`` is imported on first use only, so a missing or broken triton never
breaks the reference path. Naming ``triton`` explicitly forces the kernels, also on CPU
tensors (they then need ``TRITON_INTERPRET=1``, as the tests set it).

``sdpa`` (``ops/sdpa_attention.py``) runs every layout through torch's fused
``scaled_dot_product_attention``; it is what ``auto`` picks on CPU for every attention type, and on
GPU for layouts flash attention covers without a mask (causal attention from each document's
start: the dense baseline, single-query prefill/decode steps), with Triton for the rest (SDPA for
everything when triton is not installed). Callers
that need the log-sum-exp (merging partial attentions) get an op that returns it; the model asks
for the output only (``need_lse=False``), which lets the SDPA path skip it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orthros_train.ops.reference import UNBOUNDED, attention_reference
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


def _choose_cuda(q_index, q_window, cu_seqlens, n_k=None, **hints):
    """GPU ``auto``'s choice for these queries: ``("sdpa", segments)`` when flash attention
    needs no mask for any of them, else ``("triton", its prepared plan or None)``."""
    segments = query_segments(q_index, q_window, cu_seqlens)
    if not any(needs_mask(seg) for seg in segments):
        return "sdpa", segments
    return "triton", None if n_k is None else _prepare_triton(q_index, q_window, cu_seqlens, n_k, **hints)


def _auto_cuda_output(q, k, v, q_index, q_window, cu_seqlens, scale=None, prepared=None, **extra):
    """GPU ``auto`` for output-only callers: flash attention through SDPA where it needs no
    mask, the Triton kernel elsewhere (sliding windows, packed output streams). ``prepared``
    (``_choose_cuda``, once per forward) saves the choice's host sync in every layer."""
    kind, payload = _choose_cuda(q_index, q_window, cu_seqlens) if prepared is None else prepared
    if kind == "sdpa":
        return attention_sdpa_output(q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=payload)
    return _BACKENDS["triton"](q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=payload)


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


@dataclass(frozen=True)
class PreparedAttention:
    """Per-forward metadata of one backend (``prepare_attention``), reused by every layer."""

    fn: AttentionFn
    payload: object


def prepare_attention(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    backend: str = "auto",
    need_lse: bool = False,
    **hints: int | None,
) -> PreparedAttention | None:
    """What ``backend`` can compute once per forward pass for these queries and keys (the
    Triton kernels: the query sort and tile plan), or ``None`` when it has nothing to prepare.

    Pass the result to every ``orthros_attention`` call of that forward (all layers, and their
    backward through autograd). The layout must already be validated (the phase builders do it
    once per batch): prepared calls skip the per-call value checks, which each cost a device
    sync. ``hints`` are host-known counts (``n_band``: queries with a window of at most ``n_k``
    keys; ``max_range``: the longest key range, for decode steps) that save further syncs.
    """
    fn = resolve_backend(backend, q_index.device, need_lse=need_lse)
    preparer = _PREPARERS.get(fn)
    if preparer is None:
        return None
    return PreparedAttention(fn, preparer(q_index, q_window, cu_seqlens, n_k, **hints))


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
) -> torch.Tensor:
    """Attention of both streams over the base keys (see ``ops/reference.py`` for the contract).

    ``prepared``: this forward's ``prepare_attention`` result (used when it belongs to the
    backend that runs).
    """
    fn = resolve_backend(backend, q.device, need_lse=False)
    if prepared is not None and prepared.fn is fn:
        out, _ = fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale, prepared=prepared.payload)
    else:
        out, _ = fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale)
    return out


__all__ = [
    "UNBOUNDED", "PreparedAttention", "orthros_attention", "prepare_attention", "register_backend",
    "available_backends",
]
