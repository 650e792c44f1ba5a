"""The one attention entry point the model calls; picks a backend for the tensors it gets.

Backends: ``reference`` (plain torch, any device, the ground truth); ``triton`` (the fused
kernels of ``ops/triton_attention.py``, deterministic backward) and ``triton_atomic`` (same
forward, dq accumulated with atomics in the backward). The Triton backends are registered as
lazy wrappers: ``triton`` is imported on first use only, so a missing or broken triton never
breaks the reference path. ``auto`` uses Triton for CUDA tensors (when triton is installed) and
the reference op otherwise; naming ``triton`` explicitly forces the kernels, also on CPU
tensors (they then need ``TRITON_INTERPRET=1``, as the tests set it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from orthros_train.ops.reference import UNBOUNDED, attention_reference

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_BACKENDS: dict[str, AttentionFn] = {"reference": attention_reference}


def _triton_backend(deterministic: bool) -> AttentionFn:
    def run(q, k, v, q_index, q_window, cu_seqlens, scale=None):
        from orthros_train.ops.triton_attention import attention_triton  # lazy: imports triton

        return attention_triton(q, k, v, q_index, q_window, cu_seqlens, scale=scale, deterministic=deterministic)

    run.__name__ = "attention_triton" if deterministic else "attention_triton_atomic"
    return run


if importlib.util.find_spec("triton") is not None:
    _BACKENDS["triton"] = _triton_backend(deterministic=True)
    _BACKENDS["triton_atomic"] = _triton_backend(deterministic=False)


def register_backend(name: str, fn: AttentionFn) -> None:
    """Make ``fn`` selectable as ``backend=name`` (used by the kernel modules)."""
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend(backend: str, device: torch.device) -> AttentionFn:
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "reference"
    if backend not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; available: {['auto', *available_backends()]}"
        )
    return _BACKENDS[backend]


def orthros_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of both streams over the base keys (see ``ops/reference.py`` for the contract)."""
    out, _ = resolve_backend(backend, q.device)(q, k, v, q_index, q_window, cu_seqlens, scale=scale)
    return out


__all__ = ["UNBOUNDED", "orthros_attention", "register_backend", "available_backends"]
