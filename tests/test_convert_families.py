"""The model families from-hf converts (orthros_train/convert/families.py): one test per family
rule and per refusal, on configs built by transformers' own config classes (docs/convert.md,
"Supported families"). The logits-equality checks of the older families are in test_convert.py
and test_moe.py; Mistral's is here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import TINY_HF_SHAPE, spread_hf_norms

from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.families import FAMILIES, family_table, hf_name, orthros_name
from orthros_train.convert.from_hf import convert_from_hf, orthros_config_from_hf
from orthros_train.errors import UserError
from orthros_train.model import OrthrosForCausalLM

transformers = pytest.importorskip("transformers")

VOCAB = 128
W = 16
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}

# What each family converts into: (q/k norm, q/k/v biases, experts, shared expert). A family added
# to FAMILIES without a line here fails test_every_family_has_its_test.
EXPECTED = {
    "llama": (False, False, 0, 0),
    "mistral": (False, False, 0, 0),
    "qwen2": (False, True, 0, 0),
    "qwen3": (True, False, 0, 0),
    "qwen3_moe": (True, False, 8, 0),
    "qwen2_moe": (False, True, 8, 40),
}
# Keys a tiny config of the family needs beyond TINY_HF_SHAPE to be convertible.
EXTRA = {
    "mistral": {"sliding_window": None},
    "qwen3_moe": MOE,
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 40},
}


def hf_config(model_type: str, **changes) -> dict:
    """config.json of a tiny model of the family, as transformers writes it, with ``changes``."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    cfg = config_class(vocab_size=VOCAB, **TINY_HF_SHAPE, **EXTRA.get(model_type, {})).to_dict()
    cfg["architectures"] = [FAMILIES[model_type].architecture]
    cfg.update(changes)
    return cfg


def test_every_family_has_its_test():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_rules_map_the_config(model_type):
    qk_norm, biases, experts, shared = EXPECTED[model_type]
    cfg = orthros_config_from_hf(hf_config(model_type), sliding_window=W)
    assert (cfg.qk_norm, cfg.attention_bias) == (qk_norm, biases)
    assert (cfg.num_experts or 0, cfg.shared_expert_intermediate_size or 0) == (experts, shared)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.sliding_window) == (64, 2, W)
    assert cfg.extra["hf"]["model_type"] == model_type


def test_unknown_family_is_a_user_error_naming_every_supported_one():
    with pytest.raises(UserError, match="model_type 'gemma' is not supported") as err:
        orthros_config_from_hf({**hf_config("llama"), "model_type": "gemma"})
    for rules in FAMILIES.values():
        assert f"{rules.model_type} ({rules.architecture})" in str(err.value)
    with pytest.raises(ConversionError, match="model_type None"):
        orthros_config_from_hf({k: v for k, v in hf_config("llama").items() if k != "model_type"})


def test_architecture_other_than_the_familys_is_refused():
    with pytest.raises(ConversionError, match=r"architectures \['LlamaForSequenceClassification'\]"):
        orthros_config_from_hf(hf_config("llama", architectures=["LlamaForSequenceClassification"]))


# -- sliding windows --------------------------------------------------------------------------------


def test_mistral_v01_sliding_window_is_refused_with_the_reason():
    v01 = hf_config("mistral", sliding_window=4096, max_position_embeddings=32768)
    with pytest.raises(ConversionError, match="sliding_window=4096 is not supported") as err:
        orthros_config_from_hf(v01)
    assert "never attended further back than its window" in str(err.value)
    assert "keys it was never trained on" in str(err.value)


def test_mistral_without_sliding_window_takes_transformers_default_and_is_refused():
    cfg = hf_config("mistral")
    del cfg["sliding_window"]  # MistralConfig fills in 4096
    with pytest.raises(ConversionError, match="sliding_window=4096"):
        orthros_config_from_hf(cfg)


@pytest.mark.parametrize("window", [None, 32768, 65536])
def test_mistral_dense_window_is_accepted(window):
    """null (Mistral v0.2/v0.3) or a window no position ever leaves: the model is dense."""
    cfg = orthros_config_from_hf(hf_config("mistral", sliding_window=window, max_position_embeddings=32768))
    assert cfg.sliding_window == 128 and not cfg.attention_bias


@pytest.mark.parametrize("window", [32767, True, "4096"])
def test_mistral_window_below_max_positions_or_not_a_count_is_refused(window):
    with pytest.raises(ConversionError, match="sliding_window="):
        orthros_config_from_hf(hf_config("mistral", sliding_window=window, max_position_embeddings=32768))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_qwen_sliding_window_unused_without_use_sliding_window_is_accepted(model_type):
    """Qwen2.5 ships sliding_window=131072 beside use_sliding_window=false: transformers ignores it."""
    cfg = orthros_config_from_hf(hf_config(model_type, use_sliding_window=False, sliding_window=131072))
    assert cfg.sliding_window == 128


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_qwen_use_sliding_window_is_refused_with_the_reason(model_type):
    hf = hf_config(model_type, use_sliding_window=True, sliding_window=4096, max_window_layers=1)
    with pytest.raises(ConversionError, match="use_sliding_window=true") as err:
        orthros_config_from_hf(hf)
    assert "max_window_layers=1" in str(err.value) and "never trained on" in str(err.value)


def test_llama_has_no_sliding_window_so_any_is_refused():
    with pytest.raises(ConversionError, match="LlamaForCausalLM has no sliding-window attention"):
        orthros_config_from_hf(hf_config("llama", sliding_window=1 << 20))
    assert orthros_config_from_hf(hf_config("llama", sliding_window=None)).sliding_window == 128


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_hybrid_layer_types_are_refused_in_every_family(model_type):
    layers = ["full_attention", "sliding_attention"]
    with pytest.raises(ConversionError, match="sliding_attention"):
        orthros_config_from_hf(hf_config(model_type, layer_types=layers))


# -- biases, MoE ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "qwen3_moe"])
def test_attention_bias_is_refused_where_it_adds_an_o_proj_bias(model_type):
    with pytest.raises(ConversionError, match=f"attention_bias=true is not supported for {model_type}.*o_proj"):
        orthros_config_from_hf(hf_config(model_type, attention_bias=True))


def test_qwen2_always_has_qkv_biases_and_qwen2_moe_reads_qkv_bias():
    assert orthros_config_from_hf(hf_config("qwen2", attention_bias=False)).attention_bias
    assert orthros_config_from_hf(hf_config("qwen2_moe")).attention_bias
    assert not orthros_config_from_hf(hf_config("qwen2_moe", qkv_bias=False)).attention_bias


@pytest.mark.parametrize(
    "size, message",
    [(0, "always run their shared expert"), (None, "transformers cannot load this config")],
)
def test_qwen2_moe_needs_its_shared_expert(size, message):
    with pytest.raises(ConversionError, match=f"shared_expert_intermediate_size.*{message}|{message}.*shared_expert"):
        orthros_config_from_hf(hf_config("qwen2_moe", shared_expert_intermediate_size=size))


def test_qwen3_moe_has_no_shared_expert():
    cfg = orthros_config_from_hf(hf_config("qwen3_moe", shared_expert_intermediate_size=40))
    assert not cfg.shared_expert_intermediate_size


# -- weights ----------------------------------------------------------------------------------------


def test_weight_names_map_both_ways():
    rules = FAMILIES["llama"]
    assert rules.orthros_name("model.layers.0.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert rules.orthros_name("lm_head.weight") == "lm_head.weight"
    assert rules.orthros_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    for name in ("layers.1.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "layers.0.self_attn.gamma"):
        assert orthros_name(hf_name(name)) == name


def test_mistral_converts_and_reproduces_its_logits_within_the_window(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, **TINY_HF_SHAPE, sliding_window=None, bos_token_id=1)
    hf = spread_hf_norms(transformers.MistralForCausalLM(cfg))
    hf.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "o", sliding_window=W)
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    ids = torch.randint(0, VOCAB, (2, 3 * W))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    scale = ref.abs().max()
    assert scale > 1.0
    assert (ref[:, :W] - got[:, :W]).abs().max() <= 1e-5 * scale
    assert (ref[:, 2 * W :] - got[:, 2 * W :]).abs().max() > 1e-3


def test_docs_list_the_families_table():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "convert.md").read_text()
    assert family_table() in docs
