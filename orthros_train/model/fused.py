"""The fused token-wise path of the Orthros layer (``model.fused_tokenwise``), beside the eager one
in ``model/orthros.py``: the same math on both streams in fewer passes over the activations.

* ``[x; y]`` stays one buffer between layers (``join_streams``) instead of a concatenation per layer;
* each residual add is done by the RMSNorm kernel that follows it (``ops.fused_tokenwise.add_rms_norm``);
* the base rows' q, k and v come from one GEMM over the concatenated weights, the output rows' q
  from one more (the output stream writes no K/V, so it is not projected onto k and v); the
  output queries' ``gamma``/``beta`` is one ``addcmul``; q and k are rotated by one kernel;
* the MLP's gate and up come from one GEMM into one buffer that the SiLU-mul kernel reads;
* the LM head and the weighted cross entropy run over chunks of rows (``linear_cross_entropy``).

The weights are concatenated at run time: the modules, their parameters and the checkpoints keep
the eager names and shapes. Under tensor parallelism every concatenated weight is this rank's shard
of its heads or features, but the norms and the vocabulary-split head need the TP communication
the eager modules carry, so ``parallel/model.py`` turns the path off there (``auto``) or refuses
it (``on``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from orthros_train.ops.fused_tokenwise import kernel_problem, rms_norm, rope_qk
from orthros_train.options import FusedTokenwise

log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def fusion_active(mode: FusedTokenwise, t: torch.Tensor) -> bool:
    """Whether a module whose ``model.fused_tokenwise`` is ``mode`` runs fused on ``t``'s device.

    ``auto`` fuses on CUDA once the kernels passed their first-call check on this device and dtype
    (``kernel_problem``): a kernel that fails to build or disagrees with its reference leaves the
    run on the eager path with one warning instead of failing its first step."""
    if mode == FusedTokenwise.off:
        return False
    if mode == FusedTokenwise.on:
        return True
    if t.device.type != "cuda":
        return False
    problem = kernel_problem(t.device, t.dtype)
    if problem is not None and (str(t.device), str(t.dtype)) not in _warned:
        _warned.add((str(t.device), str(t.dtype)))
        log.warning("model.fused_tokenwise=auto: the eager path on %s (%s)", t.device, problem)
    return problem is None


def join_streams(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[x; y]`` as one tensor: the buffer the previous layer split into these two halves when
    they are exactly its halves (no copy, and autograd sees that buffer), else a concatenation."""
    base = x._base
    if (
        base is not None
        and y._base is base
        and base.is_contiguous()
        and x.is_contiguous()
        and y.is_contiguous()
        and base.dim() == 2
        and base.shape[0] == x.shape[0] + y.shape[0]
        and base.shape[1:] == x.shape[1:] == y.shape[1:]
        and x.data_ptr() == base.data_ptr()
        and y.data_ptr() == base.data_ptr() + x.numel() * x.element_size()
    ):
        return base
    return torch.cat([x, y])


def _merged(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the linears stacked along their outputs (this rank's shards under TP)."""
    weight = torch.cat([m.weight for m in linears])
    biases = [getattr(m, "bias", None) for m in linears]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0])
                              for m, b in zip(linears, biases)])


def _norm(module: nn.Module | None, t: torch.Tensor) -> torch.Tensor:
    return t if module is None else rms_norm(t, module.weight, module.eps)


def attention_inputs(
    attn: nn.Module, h: torch.Tensor, n_base: int, with_base_queries: bool,
    q_angles: tuple[torch.Tensor, torch.Tensor], k_angles: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of ``OrthrosAttention.head_outputs`` from the normed ``[x; y]``, fused: one
    GEMM for the base rows' q/k/v (k/v alone when the base queries are skipped), one for the
    output rows' q, the q/k norms and the output affine, then RoPE of q and k in one kernel."""
    hd, heads = attn.head_dim, attn.gamma.shape[0]
    q_width = attn.q_proj.weight.shape[0]
    kv_width = attn.k_proj.weight.shape[0]
    base, out = h[:n_base], h[n_base:]
    if with_base_queries:
        qkv = F.linear(base, *_merged(attn.q_proj, attn.k_proj, attn.v_proj))
        q_base, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q_base = _norm(attn.q_norm, q_base.view(n_base, heads, hd))
    else:
        kv = F.linear(base, *_merged(attn.k_proj, attn.v_proj))
        k, v = kv.split([kv_width, kv_width], dim=-1)
        q_base = None
    k = _norm(attn.k_norm, k.view(n_base, -1, hd))
    v = v.view(n_base, -1, hd)
    q_out = None
    if out.shape[0]:
        q_out = _norm(attn.q_norm, F.linear(out, attn.q_proj.weight, attn.q_proj.bias).view(-1, heads, hd))
        q_out = torch.addcmul(attn.beta, q_out, attn.gamma)  # q_out * gamma + beta in one pass
    parts = [t for t in (q_base, q_out) if t is not None]
    q = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else h.new_empty((0, heads, hd))
    q, k = rope_qk(q, k, q_angles, k_angles)
    return q, k, v


__all__ = ["attention_inputs", "fusion_active", "join_streams"]
