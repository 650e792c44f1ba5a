"""Token-wise building blocks shared by both streams: RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from orthros_train.errors import UserError
from orthros_train.ops.fused_tokenwise import silu_mul


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, cast back before the weight: the Llama/Qwen convention, so converted
        # checkpoints reproduce HF logits.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys each rope_type needs (besides rope_type itself); optional ones are read with defaults.
ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope_type of a rope_scaling dict (``type`` is the pre-v4.45 HF spelling)."""
    if scaling is None:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """Raise ValueError naming the offending field when ``scaling`` cannot be applied."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise UserError(
            f"rope_scaling.rope_type {kind!r} is not supported; use one of {ROPE_TYPES} "
            "(or rope_scaling: null for plain RoPE)"
        )
    if scaling is None or kind == "default":
        return
    missing = [k for k in ROPE_REQUIRED_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise UserError(
            f"rope_scaling ({kind}) is missing {missing}; add them to model.rope_scaling "
            f"(required for {kind}: {list(ROPE_REQUIRED_KEYS[kind])})"
        )
    if float(scaling["factor"]) <= 0:
        raise UserError(f"rope_scaling.factor must be > 0, got {scaling['factor']!r}")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (paper eq. 22); 1 when not extending.
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN "NTK-by-parts": dimensions that rotate more than ``beta_fast`` times over the original
    context keep their frequency, those rotating fewer than ``beta_slow`` times are interpolated
    by ``factor``, a linear ramp blends the band between (the transformers definition)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    # `or`: transformers treats an explicit null/0 like an absent key.
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate
    # Same expression order as transformers (1/(factor*pos) rather than inv_freq/factor) so the
    # frequencies agree bit for bit.
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse RoPE frequencies [head_dim/2] in fp32, attention factor applied to cos/sin).

    Supports the transformers rope types default, linear, llama3 and yarn with the same
    arithmetic as ``transformers.modeling_rope_utils``, so a converted model uses exactly the
    frequencies of its HF original at every position, including beyond the original length.
    """
    check_rope_scaling(scaling)
    kind = rope_type(scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if kind == "yarn":
        assert scaling is not None
        pos_freqs = theta**exponents
        inv_freq = _yarn_inv_freq(pos_freqs, head_dim, theta, scaling)
        factor = float(scaling["factor"])
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:  # DeepSeek-style: ratio of two temperatures
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return inv_freq, float(attention_factor)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "linear":
        assert scaling is not None
        # Position interpolation: dividing the frequencies equals dividing the positions.
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq, 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] (see :func:`rope_parameters`)."""
    return rope_parameters(head_dim, theta, scaling)[0]


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout used by Llama/Qwen checkpoints.

    ``attention_scaling`` (YaRN's temperature, 1 otherwise) multiplies cos and sin as transformers
    does; since both q and k are rotated, attention logits grow by its square.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - nn.Module's signature
        """``inv_freq`` follows the module's device but stays fp32 under any dtype cast.

        ``model.to(torch.bfloat16)`` casts every floating buffer: a bf16 ``inv_freq`` has 8
        mantissa bits, so at position 131071 the phase of a frequency is off by up to ~2**-9 of
        131071 radians. The frequencies are taken out of the cast and only moved.
        """
        inv_freq = self._buffers.pop("inv_freq")
        try:
            out = super()._apply(fn, *args, **kwargs)
        finally:
            moved = fn(inv_freq)
            self._buffers["inv_freq"] = inv_freq.to(moved.device) if moved.dtype != inv_freq.dtype else moved
        return out

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, 1, head_dim] in fp32 for integer positions [N]."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos[:, None, :], sin[:, None, :]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rope`` as this module's call, so a regional ``torch.compile`` fuses it."""
        return apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [N, heads, head_dim] by the angles of its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


LinearFactory = Callable[[str, int, int, bool], nn.Module]  # (name, in, out, bias) -> module


def _plain_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class SiluAndMul(nn.Module):
    """SwiGLU's activation, ``silu(gate) * up``: a module of its own so a regional
    ``torch.compile`` fuses its elementwise passes (no parameters; names unchanged)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, linear: LinearFactory = _plain_linear) -> None:
        super().__init__()
        self.gate_proj = linear("gate_proj", hidden_size, intermediate_size, False)
        self.up_proj = linear("up_proj", hidden_size, intermediate_size, False)
        self.down_proj = linear("down_proj", intermediate_size, hidden_size, False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with gate and up from one GEMM into one buffer, read by the SiLU-mul kernel
        (``model.fused_tokenwise``; the weights are concatenated at run time, names unchanged)."""
        gate_up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        return self.down_proj(silu_mul(gate_up))
