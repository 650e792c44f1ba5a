"""Model configuration with HF-style field names (so Llama/Qwen configs map one to one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orthros_train.model.layers import check_rope_scaling
from orthros_train.ops.reference import UNBOUNDED
from orthros_train.options import AttentionType


@dataclass
class OrthrosConfig:
    vocab_size: int = 32000
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    intermediate_size: int = 1376
    rope_theta: float = 10000.0
    # None or {"rope_type": "linear" | "llama3" | "yarn", "factor": ..., ...} (transformers keys)
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    attention_bias: bool = False  # Qwen2 carries biases on q/k/v
    tie_word_embeddings: bool = False
    sliding_window: int = 128
    attention_type: AttentionType = AttentionType.orthros
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    attention_backend: str = "auto"  # "auto" | "reference" | "triton"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attention_type = AttentionType.parse(self.attention_type, "attention_type")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.num_attention_heads and self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        self.validate()

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"rope_scaling must be a mapping or null, got {self.rope_scaling!r}")
            check_rope_scaling(self.rope_scaling)

    @property
    def base_window(self) -> int:
        """Keys a base (or baseline) query sees, itself included: ``sliding_window``, or unbounded
        for the dense baseline."""
        return UNBOUNDED if self.attention_type == AttentionType.dense else self.sliding_window

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self, include_embeddings: bool = True) -> int:
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * h * hd  # q, k, v, o, gamma, beta
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        total = self.num_hidden_layers * per_layer + d
        if include_embeddings:
            total += self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OrthrosConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown OrthrosConfig fields: {unknown}")
        return cls(**data)
