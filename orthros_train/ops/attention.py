"""The one attention entry point the model calls; picks a backend for the tensors it gets.

Backends: ``reference`` (plain torch, any device, the ground truth). The Triton kernels register
themselves here as ``triton`` when they are importable; ``auto`` uses Triton for CUDA tensors and
the reference op otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from orthros_train.ops.reference import UNBOUNDED, attention_reference

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_BACKENDS: dict[str, AttentionFn] = {"reference": attention_reference}


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
