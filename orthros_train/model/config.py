"""Model configuration with HF-style field names (so Llama/Qwen configs map one to one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orthros_train.errors import UserError
from orthros_train.model.layers import check_rope_scaling
from orthros_train.ops.keys import UNBOUNDED, KeyRule
from orthros_train.options import AttentionType, FusedTokenwise, MoERouting


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
    # Base-stream attention sinks (an extension of the paper's layer, for converted models): a base
    # query also attends the first ``sink_tokens`` keys of its document. 0: the paper's layer.
    sink_tokens: int = 0
    # The global tail (an extension of the paper's layer, for converted models): the base queries of
    # a prompt's last ``base_global_tail`` tokens, and of every generated token, see their whole
    # document instead of the window (``ops/keys.py``). 0: the paper's layer.
    base_global_tail: int = 0
    attention_type: AttentionType = AttentionType.orthros
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    attention_backend: str = "auto"  # "auto" | "reference" | "triton"
    # Fused token-wise work of both streams (``ops/fused_tokenwise.py``: add+RMSNorm, RoPE of q and k
    # in one kernel, merged q/k/v and gate/up GEMMs, SiLU-mul, chunked LM head + cross entropy):
    # auto | on | off. ``auto``: fused on CUDA after its kernels pass a first-call check, eager on CPU.
    # The weights and their names are the same either way. Off by default until gpu_check's
    # ``fused_tokenwise`` item has timed the kernels faster on a GPU (docs/benchmarks.md).
    fused_tokenwise: FusedTokenwise = FusedTokenwise.off
    # Mixture of experts, with Qwen3-MoE / Qwen2-MoE's names and layer rule (``is_sparse_layer``).
    # num_experts = 0: every layer has the dense SwiGLU MLP of width intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int | None = None  # each expert's width (None: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k gate probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight (transformers' definition)
    router_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE); 0: off
    moe_routing: MoERouting = MoERouting.tied  # how a position's base and output tokens pick experts
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attention_type = AttentionType.parse(self.attention_type, "attention_type")
        self.moe_routing = MoERouting.parse(self.moe_routing, "moe_routing")
        if isinstance(self.fused_tokenwise, bool):  # YAML 1.1 reads a bare on/off as a boolean
            self.fused_tokenwise = "on" if self.fused_tokenwise else "off"
        self.fused_tokenwise = FusedTokenwise.parse(self.fused_tokenwise, "fused_tokenwise")
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.num_attention_heads and self.hidden_size % self.num_attention_heads != 0:
                raise UserError(
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
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        KeyRule(self.sliding_window, self.sink_tokens, self.base_global_tail)  # the one validation of W, S, R
        # A dense model's queries see their whole document already: the tail (like the sinks) is
        # ignored there, so its twins (distillation teachers, baselines) keep one config; where a user
        # asks for it (a recipe, an eval override) it is refused up front (``tail_on_dense``).
        if self.base_global_tail and self.attention_type != AttentionType.dense \
                and self.sliding_window >= self.max_position_embeddings:
            raise UserError(
                f"base_global_tail={self.base_global_tail} with sliding_window={self.sliding_window} >= "
                f"max_position_embeddings={self.max_position_embeddings}: the window already covers every position, "
                "so the tail changes nothing; set model.base_global_tail=0 or a smaller model.sliding_window"
            )
        # The mirror case: a query whose window cuts its prompt sits at position >= W and before the
        # prompt's last R tokens, so with R + W >= max_position_embeddings no prompt has one and the
        # base stream is dense attention at a dense prefill's cost (R = 10**9: a typo, not a choice).
        if self.base_global_tail and self.attention_type != AttentionType.dense \
                and self.sliding_window + self.base_global_tail >= self.max_position_embeddings:
            raise UserError(
                f"base_global_tail={self.base_global_tail} with sliding_window={self.sliding_window} and "
                f"max_position_embeddings={self.max_position_embeddings}: no prompt the model reads has a base query "
                "its window cuts, so the base stream would be dense attention at a dense prefill's cost; set "
                f"model.base_global_tail below {self.max_position_embeddings - self.sliding_window} (32 restores a "
                "converted model's retrieval) or 0"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise UserError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise UserError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise UserError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise UserError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._validate_experts()
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise UserError(f"rope_scaling must be a mapping or null, got {self.rope_scaling!r}")
            check_rope_scaling(self.rope_scaling)

    def _validate_experts(self) -> None:
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not integer(self.num_experts) or self.num_experts < 0:
            raise UserError(f"num_experts must be an integer >= 0 (0: dense MLPs), got {self.num_experts!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise UserError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.num_experts:
            return
        k = self.num_experts_per_tok
        if not integer(k) or not 1 <= k <= self.num_experts:
            raise UserError(
                f"num_experts_per_tok must be an integer in 1..num_experts={self.num_experts}, got {k!r}"
            )
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not integer(value) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        shared = self.shared_expert_intermediate_size
        if not integer(shared) or shared < 0:
            raise UserError(f"shared_expert_intermediate_size must be an integer >= 0 (0: none), got {shared!r}")
        layers = self.mlp_only_layers
        if not isinstance(layers, (list, tuple)) or not all(integer(i) for i in layers):
            raise UserError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")
        outside = sorted(i for i in layers if not 0 <= i < self.num_hidden_layers)
        if outside:
            raise UserError(
                f"mlp_only_layers {outside} are not layers of this model (0..{self.num_hidden_layers - 1})"
            )
        self.mlp_only_layers = sorted(set(layers))
        if not any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers)):
            raise UserError(
                f"num_experts={self.num_experts} but no layer is sparse (decoder_sparse_step="
                f"{self.decoder_sparse_step}, mlp_only_layers={self.mlp_only_layers}); set num_experts=0 for a "
                "dense model"
            )

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the mixture of experts (Qwen2/3-MoE's rule), else the dense MLP."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i)]

    def mlp_parameters(self, layer_idx: int, active: bool = False) -> int:
        """Weights of layer ``layer_idx``'s MLP (router, experts, shared expert); ``active``: those one
        token multiplies by (its top-k experts only), the unit of FLOPs."""
        d = self.hidden_size
        if not self.is_sparse_layer(layer_idx):
            return 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        total = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        if self.shared_expert_intermediate_size:
            total += 3 * d * self.shared_expert_intermediate_size + d  # the expert and its gate
        return total

    @property
    def base_window(self) -> int:
        """Keys a base (or baseline) query sees, itself included: ``sliding_window``, or unbounded
        for the dense baseline."""
        return UNBOUNDED if self.attention_type == AttentionType.dense else self.sliding_window

    @property
    def base_sink_tokens(self) -> int:
        """Sink tokens of the base stream (0 for the dense baseline, whose window already holds them)."""
        return self.key_rule.sink_tokens_of_pass()

    def tail_on_dense(self, where: str = "model.") -> str | None:
        """Why a global tail asked of a dense model is refused (``None``: it is not)."""
        if not (self.base_global_tail and self.attention_type == AttentionType.dense):
            return None
        return (f"{where}base_global_tail={self.base_global_tail} on a dense model: every query of a dense model "
                f"already sees its whole document, so the tail would do nothing; set {where}base_global_tail=0, or "
                f"{where}attention_type=orthros for the windowed layer")

    @property
    def key_rule(self) -> KeyRule:
        """Which keys the base stream's queries see (``ops/keys.py``): window, sinks, global tail."""
        return KeyRule(self.base_window, self.sink_tokens, self.base_global_tail)

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
        per_layer = attn + 2 * d
        total = self.num_hidden_layers * per_layer + sum(self.mlp_parameters(i) for i in range(self.num_hidden_layers))
        total += d
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
            raise UserError(f"unknown OrthrosConfig fields: {unknown}")
        return cls(**data)
