"""Orthros model configuration (Hugging Face remote code; needs only transformers).

Written by ``orthros-convert to-hf`` next to the weights. Field names follow Llama/Qwen; the
Orthros-specific ones are ``base_window`` (the base stream's sliding-window size ``W``: base token
``i`` attends base keys ``i-W < j <= i``), ``qk_norm`` (Qwen3-style per-head RMSNorm on q and k)
``attention_bias`` (biases on q/k/v only, as in Qwen2) and ``sink_tokens`` (``S``: a base token also
attends the first ``S`` keys of its sequence, beyond its window; 0, the default and the value of an
export that does not name it, is the paper's layer). ``rope_parameters`` is
``{"rope_type": "default" | "linear" | "llama3" | "yarn", "rope_theta": ..., <that type's keys>}``.

Mixture-of-experts models (Qwen3-MoE / Qwen2-MoE) carry those models' fields: ``num_experts``
(0: dense), ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers``, ``shared_expert_intermediate_size`` (Qwen2-MoE's
shared expert; 0: none), ``router_aux_loss_coef``, plus ``moe_routing`` (``independent``,
``tied`` or ``joint``: how a position's base and output tokens pick their experts).

The window is deliberately not called ``sliding_window``: transformers would then build
sliding-window KV caches, but the output stream attends every cached key.
"""

from transformers import PretrainedConfig


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
        base_window=128,
        sink_tokens=0,
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
        self.base_window = base_window
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")
        # Compared only with a usable window: a bad base_window is its readers' to name (the
        # serving hook refuses it naming config.json), not hidden behind a message about sinks.
        window_ok = isinstance(base_window, int) and not isinstance(base_window, bool) and base_window >= 1
        if window_ok and sink_tokens >= base_window:
            raise ValueError(f"sink_tokens ({sink_tokens}) must be smaller than base_window ({base_window})")
        self.sink_tokens = sink_tokens
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
