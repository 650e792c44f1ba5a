"""RoPE scaling for context extension (default, linear, llama3, YaRN) against transformers.

Frequencies, the YaRN attention factor and cos/sin must equal what transformers computes for the
same config, at positions far beyond ``original_max_position_embeddings``; a converted HF model
must reproduce its logits, and the exported remote-code model must reproduce ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import TINY_HF_SHAPE, spread_hf_norms, tiny_model

from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.from_hf import convert_from_hf
from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.model.layers import RotaryEmbedding, rope_parameters

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

OLD_LEN = 64  # original_max_position_embeddings of the configs below
POSITIONS = torch.arange(0, 16 * OLD_LEN, 7)  # up to 16x beyond the original length

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": OLD_LEN}
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": OLD_LEN,
    },
    "yarn": YARN,
    "yarn_betas_no_truncate": {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_attention_factor": {**YARN, "factor": 4, "attention_factor": 1.25},
    "yarn_mscale": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek style
    "yarn_qwen3": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}


def _hf_config(scaling, theta: float = 500000.0, head_dim: int = 64, max_pos: int = 16 * OLD_LEN):
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters=params,
        max_position_embeddings=max_pos,
    )


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 1e6), (32, 10000.0)])
def test_inv_freq_and_attention_factor_equal_transformers(name, head_dim, theta):
    scaling = SCALINGS[name]
    hf_cfg = _hf_config(scaling, theta, head_dim)
    if scaling is None:  # the default rope lives on the model class in transformers 5
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_inv_freq, hf_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    inv_freq, factor = rope_parameters(head_dim, theta, scaling)
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, hf_inv_freq.float()), (inv_freq - hf_inv_freq).abs().max()
    assert factor == pytest.approx(hf_factor, abs=0, rel=1e-12)
    if name.startswith("yarn") and "attention_factor" not in scaling:
        assert factor > 1.0  # the temperature is actually applied


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_cos_sin_beyond_original_length_equal_transformers_rotary(name):
    """Our cos/sin (attention factor included) against LlamaRotaryEmbedding.forward."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = SCALINGS[name]
    hf_cfg = _hf_config(scaling)
    hf_rot = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, 1, len(POSITIONS), 64)
    hf_cos, hf_sin = hf_rot(x, POSITIONS[None])
    ours = RotaryEmbedding(64, 500000.0, scaling)
    assert ours.attention_scaling == pytest.approx(hf_rot.attention_scaling, rel=1e-12)
    cos, sin = ours.cos_sin(POSITIONS)
    assert (cos[:, 0] - hf_cos[0]).abs().max() <= 1e-6
    assert (sin[:, 0] - hf_sin[0]).abs().max() <= 1e-6
    if name != "default":  # scaling changes the angles beyond the original length
        plain_cos, _ = RotaryEmbedding(64, 500000.0, None).cos_sin(POSITIONS)
        assert (plain_cos - cos).abs().max() > 1e-2


def test_bad_rope_scaling_errors_name_the_field_and_fix():
    with pytest.raises(UserError, match=r"rope_type 'ntk'.*one of"):
        OrthrosConfig(rope_scaling={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(UserError, match=r"rope_scaling \(yarn\) is missing \['original_max_position_embeddings'\]"):
        OrthrosConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UserError, match=r"missing \['factor'\]"):
        OrthrosConfig(rope_scaling={"rope_type": "linear"})
    with pytest.raises(UserError, match="factor must be > 0"):
        OrthrosConfig(rope_scaling={"rope_type": "linear", "factor": 0})
    # The HF spelling `type` is accepted, as transformers accepts it.
    assert OrthrosConfig(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling["type"] == "linear"


# --- checkpoints: HF -> Orthros -> HF with YaRN --------------------------------------------------

W = 32
VOCAB = 96
HF_OLD_LEN = 8  # tiny original length: positions 8..W-1 inside the window are already extended
HF_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": HF_OLD_LEN, "beta_fast": 8}


def _tiny_hf(kind: str):
    common = dict(vocab_size=VOCAB, **TINY_HF_SHAPE, max_position_embeddings=4 * HF_OLD_LEN)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_parameters={**HF_YARN, "rope_theta": 10000.0})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(
            **common, head_dim=32, rope_parameters={**HF_YARN, "rope_theta": 1e6, "attention_factor": 1.3}
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    return spread_hf_norms(model)


@pytest.fixture(scope="module")
def yarn_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("yarn")
    torch.manual_seed(0)
    for kind in ("llama", "qwen3"):
        _tiny_hf(kind).save_pretrained(root / kind)
    return root


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_from_hf_with_yarn_reproduces_hf_logits_within_window(yarn_dirs, tmp_path, kind):
    convert_from_hf(yarn_dirs / kind, tmp_path / "o", sliding_window=W)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    scaling = cfg["rope_scaling"]
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0 and scaling["beta_fast"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(yarn_dirs / kind, dtype=torch.float32).eval()
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    assert model.layers[0].self_attn.rotary.attention_scaling == pytest.approx(
        1.3 if kind == "qwen3" else 0.1 * torch.log(torch.tensor(4.0)).item() + 1, rel=1e-6
    )
    ids = torch.randint(0, VOCAB, (2, 2 * W))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    scale = ref.abs().max()
    assert scale > 1.0
    err = (ref[:, :W] - got[:, :W]).abs().max() / scale
    print(f"{kind} yarn: max |HF - Orthros| / max|logit| within the window = {err:.2e}")
    assert err <= 1e-5
    # Without YaRN the same weights give other logits past the original length: the test bites.
    plain = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    for layer in plain.layers:
        layer.self_attn.rotary = RotaryEmbedding(layer.self_attn.head_dim, model.config.rope_theta, None)
    with torch.no_grad():
        assert (plain(ids).logits[:, HF_OLD_LEN:W] - ref[:, HF_OLD_LEN:W]).abs().max() > 1e-3 * scale


def test_to_hf_export_with_yarn_reproduces_orthros_logits(yarn_dirs, tmp_path):
    convert_from_hf(yarn_dirs / "qwen3", tmp_path / "o", sliding_window=W)
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o")
    torch.manual_seed(1)
    with torch.no_grad():  # a trained output stream, so Orthros differs from the dense original
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)
            layer.self_attn.beta.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "trained")
    convert_to_hf(tmp_path / "trained", tmp_path / "export")
    exported = json.loads((tmp_path / "export" / "config.json").read_text())["rope_parameters"]
    assert exported["rope_type"] == "yarn" and exported["attention_factor"] == 1.3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float32, trust_remote_code=True
    ).eval()
    model = model.eval()
    ids = torch.randint(0, VOCAB, (2, 3 * W))  # well past both the window and the original length
    with torch.no_grad():
        ref, got = prompt_logits(model, ids), hf(ids).logits  # the export reads ids as a prompt (global tail)
    err = (ref - got).abs().max() / ref.abs().max()
    print(f"to_hf yarn: max |export - Orthros| / max|logit| = {err:.2e}")
    assert err <= 1e-5


def test_prefill_decode_use_the_scaled_rope():
    """Generation (prefill + decode with the KV cache) equals step-by-step forward under YaRN."""
    yarn = {**HF_YARN, "original_max_position_embeddings": 4}
    model = tiny_model(VOCAB, sliding_window=4, initializer_range=0.2, rope_scaling=yarn).eval()
    prompt = torch.randint(0, VOCAB, (1, 10))
    new = model.generate_greedy(prompt, max_new_tokens=8)
    seq = prompt
    with torch.no_grad():
        for step in range(8):
            tok = model(seq).logits[:, -1].argmax(-1)
            assert int(tok) == int(new[0, step])
            seq = torch.cat([seq, tok[:, None]], dim=1)


def test_from_hf_refuses_rope_types_orthros_lacks(yarn_dirs, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(yarn_dirs / "llama", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"'longrope'.*'yarn'"):
        convert_from_hf(src, tmp_path / "dst", sliding_window=W)
    assert not Path(tmp_path / "dst" / "config.json").exists()
