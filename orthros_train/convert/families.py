"""The Hugging Face model families ``orthros-convert from-hf`` converts, as data.

One :class:`FamilyRules` per ``model_type`` says what the converter needs to know about that
family: its architecture class, where its weights live, which attention biases and q/k norms
it has, how its config states sliding-window attention (and so when that is refused), its
mixture-of-experts fields and the config defaults transformers fills in that change what is
converted. ``from_hf`` reads the rule for a config's ``model_type`` and applies it; the checks
every family shares (RoPE, activation, MLP bias, quantization, hybrid layers) live there.

Adding a family whose layers Orthros already expresses is an entry in :data:`FAMILIES` and its
test in ``tests/test_convert_families.py`` (``docs/architecture.md``, "How to add a model family").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Where every supported family (and the to-hf export) keeps its weights: ``model.`` + the
# Orthros name, and the LM head at the top level.
HF_WEIGHT_PREFIX = "model."
LM_HEAD = "lm_head.weight"
SKIPPED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved

# How a family's config states sliding-window attention (FamilyRules.sliding_window).
NO_SLIDING_WINDOW = "none"  # the family has none: any sliding_window value is refused
WINDOW_ON_EVERY_LAYER = "every_layer"  # sliding_window applies to every layer unless null
WINDOW_IF_USE_SLIDING_WINDOW = "use_sliding_window"  # only with use_sliding_window=true
# What each of them means, as docs/convert.md's table of families says it.
SLIDING_WINDOW_RULES = {
    NO_SLIDING_WINDOW: "the family has none: any `sliding_window` is refused",
    WINDOW_ON_EVERY_LAYER: "on every layer: refused unless null or >= `max_position_embeddings`",
    WINDOW_IF_USE_SLIDING_WINDOW: "only with `use_sliding_window: true` (refused); unused when false",
}
# Why a dense model trained with a window cannot become an Orthros model by swapping attention.
SLIDING_WINDOW_REASON = (
    "the pretrained model never attended further back than its window, so Orthros' output stream, which "
    "attends every earlier key, would see keys it was never trained on"
)
O_PROJ_BIAS = "it adds an o_proj bias, which Orthros does not have"

# MoE fields with transformers' defaults for a file that omits them (used only without
# transformers; otherwise its config class fills them in).
_QWEN3_MOE = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}
_QWEN2_MOE = {
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}


def _frozen(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class FamilyRules:
    """What the converter knows about one Hugging Face ``model_type``."""

    model_type: str
    architecture: str  # the one ``architectures`` entry accepted
    examples: str  # published models of the family (docs)
    # q/k/v biases: True always, False never, or the config key that says so (default true).
    qkv_bias: bool | str = False
    # Why ``attention_bias: true`` is refused (None: the family's config has no such switch).
    attention_bias_refusal: str | None = O_PROJ_BIAS
    qk_norm: bool = False  # RMSNorm on each head's queries and keys
    sliding_window: str = NO_SLIDING_WINDOW  # one of SLIDING_WINDOW_RULES
    # transformers' config-class defaults for keys a file may omit, where they change the model.
    defaults: Mapping[str, Any] = field(default_factory=_frozen)
    moe: Mapping[str, Any] | None = None  # the MoE fields and their defaults; None: dense
    shared_expert: bool = False  # every MoE layer runs a gated shared expert
    weight_prefix: str = HF_WEIGHT_PREFIX

    def value(self, hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
        """``hf[key]``, else this family's default for it, else ``default``."""
        return hf[key] if key in hf else self.defaults.get(key, default)

    def qkv_biases(self, hf: Mapping[str, Any]) -> bool:
        if isinstance(self.qkv_bias, str):
            return bool(hf.get(self.qkv_bias, True))
        return self.qkv_bias

    def orthros_name(self, hf_name: str) -> str | None:
        """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``;
        ``None`` for tensors that carry no weights (old rotary buffers)."""
        if hf_name.endswith(SKIPPED_TENSOR_SUFFIXES):
            return None
        return orthros_name(hf_name, self.weight_prefix)


def orthros_name(hf_name: str, prefix: str = HF_WEIGHT_PREFIX) -> str:
    """The Orthros name of an HF tensor (the head, or an unexpected name, unchanged)."""
    return hf_name[len(prefix) :] if hf_name.startswith(prefix) else hf_name


def hf_name(name: str, prefix: str = HF_WEIGHT_PREFIX) -> str:
    """The HF name of an Orthros tensor: the inverse of :func:`orthros_name`."""
    return name if name == LM_HEAD else prefix + name


FAMILIES: dict[str, FamilyRules] = {
    rules.model_type: rules
    for rules in (
        FamilyRules("llama", "LlamaForCausalLM", "Llama 2/3/3.1/3.2, SmolLM"),
        FamilyRules(
            "mistral",
            "MistralForCausalLM",
            "Mistral 7B v0.2/v0.3 (v0.1's 4096-token window is refused)",
            sliding_window=WINDOW_ON_EVERY_LAYER,
            defaults=_frozen({"sliding_window": 4096}),  # MistralConfig's default
        ),
        FamilyRules(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2, Qwen2.5",
            qkv_bias=True,
            attention_bias_refusal=None,
            sliding_window=WINDOW_IF_USE_SLIDING_WINDOW,
        ),
        FamilyRules(
            "qwen3", "Qwen3ForCausalLM", "Qwen3 dense", qk_norm=True, sliding_window=WINDOW_IF_USE_SLIDING_WINDOW
        ),
        FamilyRules(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3-30B-A3B, Qwen3-235B-A22B",
            qk_norm=True,
            sliding_window=WINDOW_IF_USE_SLIDING_WINDOW,
            moe=_frozen(_QWEN3_MOE),
        ),
        FamilyRules(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "Qwen1.5-MoE, Qwen2-57B-A14B",
            qkv_bias="qkv_bias",
            attention_bias_refusal=None,
            sliding_window=WINDOW_IF_USE_SLIDING_WINDOW,
            moe=_frozen(_QWEN2_MOE),
            shared_expert=True,
        ),
    )
}


def supported_families() -> str:
    """``llama (LlamaForCausalLM), ...``: for messages naming what is supported."""
    return ", ".join(f"{r.model_type} ({r.architecture})" for r in FAMILIES.values())


def family_table() -> str:
    """The markdown table of :data:`FAMILIES` that ``docs/convert.md`` carries ("Supported families")."""
    rows = [
        "| `model_type` | architecture | e.g. | q/k/v biases | q/k norm | sliding window | MoE |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in FAMILIES.values():
        bias = f"`{r.qkv_bias}` (default true)" if isinstance(r.qkv_bias, str) else ("yes" if r.qkv_bias else "no")
        moe = "no" if r.moe is None else ("yes, shared expert" if r.shared_expert else "yes")
        rows.append(
            f"| `{r.model_type}` | `{r.architecture}` | {r.examples} | {bias} | {'yes' if r.qk_norm else 'no'} "
            f"| {SLIDING_WINDOW_RULES[r.sliding_window]} | {moe} |"
        )
    return "\n".join(rows)
