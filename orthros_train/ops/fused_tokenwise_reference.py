"""Plain-torch statements of the fused token-wise ops (``ops/fused_tokenwise.py``): the ground
truth their Triton kernels are tested against, and what runs where no kernel does (CPU without
the interpreter).

Each one computes exactly what the eager model does in ``model/layers.py`` / ``model/orthros.py``
(the fp32 statistics of RMSNorm cast back before the weight, RoPE's cos/sin cast to the stream's
dtype, SiLU rounded to the stream's dtype before the product), so a fused step equals an eager
one up to the order of fp32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # phase.layout.IGNORE_INDEX (ops imports no other layer)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with fp32 statistics, cast back before the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add and the next norm."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``[rows, heads, head_dim]`` by per-row ``cos``/``sin`` ``[rows, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, q_angles: tuple[torch.Tensor, torch.Tensor],
    k_angles: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of the queries and the keys, each by its own rows' angles."""
    return rope_reference(q, *q_angles), rope_reference(k, *k_angles)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of a merged ``[rows, 2 * inter]`` gate/up buffer: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    normalizer: float | torch.Tensor,
) -> torch.Tensor:
    """``sum(w * CE(hidden @ weight.T, labels)) / normalizer`` in fp32 over the full logits
    (``IGNORE_INDEX`` labels count 0): the model's ``weighted_cross_entropy`` of its LM head."""
    logits = hidden @ weight.t()
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    valid = labels != IGNORE_INDEX
    return (ce * weights * valid).sum() / normalizer


__all__ = [
    "IGNORE_INDEX",
    "add_rms_norm_reference",
    "linear_cross_entropy_reference",
    "rms_norm_reference",
    "rope_qk_reference",
    "rope_reference",
    "silu_mul_reference",
]
