"""Orthros model configuration for Hugging Face transformers (the export's ``config.json``).

Shipped by ``orthros-convert to-hf`` next to the weights (``shipping.py``: with its imports made
relative). Field names follow Llama/Qwen; the Orthros-specific ones are ``base_window`` (the base
stream's sliding-window size ``W``: base token ``i`` attends base keys ``i-W < j <= i``),
``sink_tokens`` (``S``: a base token also attends the first ``S`` keys of its sequence, beyond its
window), ``base_global_tail`` (``R``: the base queries of a prompt's last ``R`` tokens, and of every
generated token, see the whole sequence), ``qk_norm`` (Qwen3-style per-head RMSNorm on q and k) and
``attention_bias`` (biases on q/k/v only, as in Qwen2). ``rope_parameters`` is ``{"rope_type":
"default" | "linear" | "llama3" | "yarn", "rope_theta": ..., <that type's keys>}``.

``base_window``, ``sink_tokens`` and ``base_global_tail`` decide which keys every query sees, and
an export states all three (to-hf writes them, 0 included). A ``config.json`` that lost one is
refused when the model is built (``OrthrosConfig.model_config``), naming the key: a default there
would compute another model's logits without a word.

Mixture-of-experts models (Qwen3-MoE / Qwen2-MoE) carry those models' fields: ``num_experts``
(0: dense), ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers``, ``shared_expert_intermediate_size`` (Qwen2-MoE's
shared expert; 0: none), ``router_aux_loss_coef``, plus ``moe_routing`` (``independent``,
``tied`` or ``joint``: how a position's base and output tokens pick their experts).

The window is deliberately not called ``sliding_window``: transformers would then build
sliding-window KV caches, but the output stream attends every cached key.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from orthros_train.model.config import OrthrosConfig as ModelConfig

# The keys that decide which keys a query sees: stated by every export, never defaulted.
KEY_RULE_FIELDS = ("base_window", "sink_tokens", "base_global_tail")
# What the export runs: the torch attention op (any device, no Triton: the kernels are not shipped)
# and the unfused token-wise path, whatever the checkpoint was trained with.
# The mixture-of-experts fields an export's config.json carries under the package's names (to-hf
# writes them, the model reads them back): one list for both directions.
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "shared_expert_intermediate_size", "router_aux_loss_coef", "moe_routing")
EXPORT_ATTENTION_BACKEND = "sdpa"
EXPORT_FUSED_TOKENWISE = "off"


class OrthrosConfig(PretrainedConfig):
    model_type = "orthros"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        rms_norm_eps=1e-6,
        rope_parameters=None,
        qk_norm=False,
        attention_bias=False,
        base_window=None,
        sink_tokens=None,
        base_global_tail=None,
        max_position_embeddings=131072,
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        num_experts=0,
        num_experts_per_tok=2,
        moe_intermediate_size=None,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=None,
        shared_expert_intermediate_size=0,
        router_aux_loss_coef=0.001,
        moe_routing="tied",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.qk_norm = qk_norm
        self.attention_bias = attention_bias
        # None: not stated. Kept as None (not a default) so the model refuses to be built from it,
        # and a bad value is left to its readers to name (the serving hook names config.json).
        self.base_window = base_window
        self.sink_tokens = sink_tokens
        self.base_global_tail = base_global_tail
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.router_aux_loss_coef = router_aux_loss_coef
        if moe_routing not in ("independent", "tied", "joint"):
            raise ValueError(f"moe_routing must be 'independent', 'tied' or 'joint', got {moe_routing!r}")
        self.moe_routing = moe_routing
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def model_config(self) -> ModelConfig:
        """The package's model config of this export: what ``modeling_orthros`` builds its modules
        from. A key-rule field the export does not state is refused, naming it and the fix; the
        package config validates the rest (``ops/keys.py``'s ``KeyRule`` checks W, S and R)."""
        missing = [key for key in KEY_RULE_FIELDS if getattr(self, key, None) is None]
        if missing:
            raise ValueError(
                f"config.json of this Orthros export has no {missing[0]} (which keys each query sees depends on "
                f"{', '.join(KEY_RULE_FIELDS)}): re-export the checkpoint with `orthros-convert to-hf`, which writes "
                "all three"
            )
        rope = dict(self.rope_parameters)
        theta = float(rope.pop("rope_theta"))
        kind = rope.get("rope_type", rope.get("type", "default"))
        moe: dict[str, Any] = {}
        if self.num_experts:
            moe = {name: getattr(self, name) for name in MOE_FIELDS}
            moe["mlp_only_layers"] = list(self.mlp_only_layers)
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rope_theta=theta,
            rope_scaling=None if kind == "default" else rope,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=self.qk_norm,
            attention_bias=self.attention_bias,
            tie_word_embeddings=self.tie_word_embeddings,
            sliding_window=self.base_window,
            sink_tokens=self.sink_tokens,
            base_global_tail=self.base_global_tail,
            attention_type="orthros",
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            attention_backend=EXPORT_ATTENTION_BACKEND,
            fused_tokenwise=EXPORT_FUSED_TOKENWISE,
            **moe,
        )
