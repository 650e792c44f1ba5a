"""orthros-convert: HF Llama/Qwen <-> Orthros checkpoints (docs/convert.md).

A converted Llama/Qwen reproduces the HF logits on sequences of at most W tokens; the to-hf
export reproduces the Orthros model everywhere and generates through prefill + decode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures import TINY_HF_SHAPE, cli_env, spread_hf_norms, tiny_config

from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.from_hf import DEFAULT_GLOBAL_TAIL, convert_from_hf, orthros_config_from_hf
from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

transformers = pytest.importorskip("transformers")

W = 16
VOCAB = 128
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _tiny_hf_model(kind: str):
    common = dict(vocab_size=VOCAB, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    if kind == "llama":  # Llama-3.1 style: GQA, llama3 RoPE scaling, untied head
        cfg = transformers.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":  # Qwen3 style: q/k norm, explicit head_dim, tied head
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:  # Qwen2 style: q/k/v biases
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    return spread_hf_norms(model, biases=True)  # non-trivial norms and biases: a dropped tensor shows


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for kind in ("llama", "qwen3", "qwen2"):
        _tiny_hf_model(kind).save_pretrained(root / kind)
        dirs[kind] = root / kind
    return dirs


def _load_hf(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_from_hf_reproduces_hf_logits_within_window(hf_dirs, tmp_path, kind):
    report = convert_from_hf(hf_dirs[kind], tmp_path / "orthros", sliding_window=W)
    assert report.files == [tmp_path / "orthros" / "model.safetensors"]
    hf = _load_hf(hf_dirs[kind])
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "orthros").eval()
    assert model.config.qk_norm == (kind == "qwen3")
    assert model.config.attention_bias == (kind == "qwen2")
    ids = torch.randint(0, VOCAB, (2, 3 * W))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids).logits
    scale = ref.abs().max()
    assert scale > 1.0  # the comparison is not between near-zero logits
    assert (ref[:, :W] - got[:, :W]).abs().max() <= 1e-5 * scale
    # Beyond the window the base stream sees fewer keys: the models must differ there.
    assert (ref[:, 2 * W :] - got[:, 2 * W :]).abs().max() > 1e-3


# config.json of meta-llama/Llama-3.1-8B and Qwen/Qwen3-8B as published (transformers 4 names).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_config_mapping_reads_hub_style_configs():
    cfg = orthros_config_from_hf(LLAMA31_8B)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window) == (128, 8, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8192
    assert cfg.extra["hf"] == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
    # Llama-3.1-8B's 8,030,261,248 parameters plus gamma and beta in each of 32 layers.
    assert cfg.num_parameters() == 8_030_261_248 + 32 * 2 * 32 * 128
    cfg = orthros_config_from_hf(QWEN3_8B, sliding_window=256)
    assert cfg.qk_norm and cfg.rope_scaling is None and cfg.rope_theta == 1e6 and cfg.sliding_window == 256
    # transformers 5 writes the same RoPE as rope_parameters: same Orthros config.
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert orthros_config_from_hf(v5) == orthros_config_from_hf(LLAMA31_8B)


@pytest.mark.parametrize("recipe, hub", [("convert_llama31_8b", LLAMA31_8B), ("convert_qwen3_8b", QWEN3_8B)])
def test_convert_recipes_describe_the_converted_checkpoints(recipe, hub):
    """The recipe's model section must be what `orthros-convert from-hf --sink-tokens 4` (the command
    its header comment gives, with from-hf's default global tail) writes for that model."""
    omegaconf = pytest.importorskip("omegaconf")
    path = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml"
    model = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path).model)
    assert model.pop("init_from")
    converted = orthros_config_from_hf(hub, sink_tokens=4, global_tail=DEFAULT_GLOBAL_TAIL)
    converted.extra = {}
    assert OrthrosConfig(**model) == converted
    assert "--sink-tokens 4" in path.read_text().split("defaults:")[0]


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_DROP = object()


@pytest.mark.parametrize(
    "kind, changes, message",
    [
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ("llama", {"sliding_window": 4096}, "sliding_window"),
        ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}, "'longrope'"),
        ("llama", {"rope_parameters": _DROP, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"attention_bias": True}, "o_proj bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"model_type": "gemma"}, "model_type 'gemma' is not supported; supported: llama"),
        ("llama", {"quantization_config": {"quant_method": "gguf"}}, "quantized"),
        ("llama", {"tie_word_embeddings": True, "vocab_size": 99}, "shape"),
    ],
)
def test_from_hf_refuses_unsupported_configs_by_name(hf_dirs, tmp_path, kind, changes, message):
    src = _edit_config(hf_dirs[kind], tmp_path / "src", **changes)
    with pytest.raises(ConversionError, match=message.replace("(", r"\(")):
        convert_from_hf(src, tmp_path / "dst", sliding_window=W)
    assert not (tmp_path / "dst" / "config.json").exists()


def test_from_hf_bad_input_errors_name_file_and_fix(hf_dirs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match=r"config\.json not found.*huggingface-cli download"):
        convert_from_hf(empty, tmp_path / "out")

    # Sharded source with one shard gone: the error names the missing file.
    sharded = tmp_path / "sharded"
    _load_hf(hf_dirs["llama"]).save_pretrained(sharded, max_shard_size="60KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    shards[1].unlink()
    with pytest.raises(ConversionError, match=rf"missing.*{shards[1].name}.*again"):
        convert_from_hf(sharded, tmp_path / "out")

    pickles = _edit_config(hf_dirs["llama"], tmp_path / "pickles")
    (pickles / "model.safetensors").rename(pickles / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="safe_serialization=True"):
        convert_from_hf(pickles, tmp_path / "out")

    headless = _edit_config(hf_dirs["llama"], tmp_path / "headless")
    state = safetensors.torch.load_file(headless / "model.safetensors")
    del state["lm_head.weight"]
    safetensors.torch.save_file(state, headless / "model.safetensors")
    with pytest.raises(ConversionError, match="no lm_head.weight"):
        convert_from_hf(headless, tmp_path / "out")

    convert_from_hf(hf_dirs["llama"], tmp_path / "out", sliding_window=W)
    with pytest.raises(ConversionError, match="not empty.*--overwrite"):
        convert_from_hf(hf_dirs["llama"], tmp_path / "out", sliding_window=W)
    convert_from_hf(hf_dirs["llama"], tmp_path / "out", sliding_window=W, overwrite=True)


def test_conversion_streams_tensor_by_tensor_into_bounded_shards(hf_dirs, tmp_path, monkeypatch):
    """Sharded in, sharded out, never a whole-file load, each written file within the bound."""
    src = tmp_path / "sharded"
    _load_hf(hf_dirs["qwen3"]).save_pretrained(src, max_shard_size="60KB")
    saved_sizes = []
    real_save = safetensors.torch.save_file

    def recording_save(tensors, filename, metadata=None):
        saved_sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return real_save(tensors, filename, metadata=metadata)

    def no_whole_file_loads(*args, **kwargs):
        raise AssertionError("conversion must not load a whole checkpoint file")

    monkeypatch.setattr(safetensors.torch, "save_file", recording_save)
    monkeypatch.setattr(safetensors.torch, "load_file", no_whole_file_loads)
    report = convert_from_hf(src, tmp_path / "orthros", sliding_window=W, max_shard_size=50_000, dtype="bfloat16")
    monkeypatch.undo()
    largest = max(t.numel() * 2 for t in _load_hf(hf_dirs["qwen3"]).state_dict().values())
    assert len(report.files) == len(saved_sizes) > 2
    assert max(saved_sizes) <= max(50_000, largest)
    assert (tmp_path / "orthros" / "model.safetensors.index.json").is_file()
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "orthros")
    assert model.config.extra["hf"]["torch_dtype"] == "bfloat16"
    hf = _load_hf(hf_dirs["qwen3"])
    with torch.no_grad():  # the same rounding as the cast (parameters only: RoPE buffers stay fp32)
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.randint(0, VOCAB, (1, W))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def orthros_dir(hf_dirs, tmp_path_factory):
    """A converted Llama whose output stream has been 'trained' (gamma != 1, beta != 0)."""
    root = tmp_path_factory.mktemp("orthros")
    convert_from_hf(hf_dirs["llama"], root / "converted", sliding_window=W)
    model = OrthrosForCausalLM.from_pretrained(root / "converted")
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)
            layer.self_attn.beta.normal_(0.0, 0.3)
    model.config.extra = json.loads((root / "converted" / "config.json").read_text())["extra"]
    model.save_pretrained(root / "trained")
    return root / "trained"


@pytest.fixture(scope="module")
def exported(orthros_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("export") / "orthros_hf"
    convert_to_hf(orthros_dir, dst)
    return dst


def model_tail(orthros_dir: Path) -> int:
    return json.loads((orthros_dir / "config.json").read_text())["base_global_tail"]


def test_to_hf_export_is_self_contained_and_matches_orthros_logits(orthros_dir, exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_orthros.py", "modeling_orthros.py"} <= names
    # Loads and runs where neither orthros_train nor triton can be imported at all.
    script = (
        "import sys, torch; sys.modules['orthros_train'] = None; sys.modules['triton'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)\n"
        "print(m(torch.arange(5)[None]).logits.shape)"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=exported.parent)
    assert run.returncode == 0 and f"[1, 5, {VOCAB}]" in run.stdout, run.stderr[-2000:]
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["model_type"] == "orthros" and cfg["base_window"] == W and cfg["eos_token_id"] == 2
    assert cfg["sink_tokens"] == 0 and cfg["base_global_tail"] == model_tail(orthros_dir) > 0
    hf = _load_hf(exported, trust_remote_code=True)
    model = OrthrosForCausalLM.from_pretrained(orthros_dir).eval()
    ids = torch.randint(0, VOCAB, (2, 3 * W))
    labels = ids.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        out = hf(ids, labels=labels)
        # the export reads ids as a prompt: its last base_global_tail tokens are global
        ref_logits = prompt_logits(model, ids)
        ref_loss = torch.nn.functional.cross_entropy(
            ref_logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        assert (out.logits - ref_logits).abs().max() <= 1e-5 * ref_logits.abs().max()
        assert abs(float(out.loss) - float(ref_loss)) <= 1e-5
        # logits_to_keep=k: output tokens at the last k positions only, same values.
        tail = hf(ids, logits_to_keep=3).logits
        assert tail.shape[1] == 3 and (tail - ref_logits[:, -3:]).abs().max() <= 1e-5 * ref_logits.abs().max()


def test_to_hf_generate_is_prefill_plus_decode_and_equals_generate_greedy(orthros_dir, exported):
    hf = _load_hf(exported, trust_remote_code=True)
    model = OrthrosForCausalLM.from_pretrained(orthros_dir).eval()
    calls = []

    def record(module, args, kwargs):
        calls.append((tuple(kwargs["input_ids"].shape), int(kwargs["output_index"].numel())))

    hf.model.register_forward_pre_hook(record, with_kwargs=True)
    prompt = torch.randint(3, VOCAB, (2, W + 5))  # longer than the window, and so is the output
    new = 2 * W
    hf.generation_config.eos_token_id = None  # run the full length, like generate_greedy without eos
    out = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert torch.equal(out[:, prompt.shape[1] :], model.generate_greedy(prompt, new))
    # Prefill: the whole prompt as base tokens, one output token; then one base+output pair per step.
    assert calls[0] == ((2, W + 5), 1)
    assert calls[1:] == [((2, 1), 1)] * (new - 1)


def test_to_hf_generate_left_padded_batch_equals_each_prompt_alone(orthros_dir, exported):
    hf = _load_hf(exported, trust_remote_code=True)
    model = OrthrosForCausalLM.from_pretrained(orthros_dir).eval()
    long, short = torch.randint(3, VOCAB, (W + 4,)), torch.randint(3, VOCAB, (7,))
    pad = len(long) - len(short)
    batch = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    hf.generation_config.eos_token_id = None
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=W, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, len(long) :], model.generate_greedy(long[None], W)[0])
    assert torch.equal(out[1, len(long) :], model.generate_greedy(short[None], W)[0])


def test_to_hf_beam_search_reorders_the_cache_consistently(exported):
    """Beam search reorders the cache rows between steps: the score it reports for each best beam
    must equal that sequence's log-probability under one forward of the whole sequence (the global
    tail, 32, covers all of its 28 tokens, so one read marks the same tokens global as prefill +
    decode: every one)."""
    hf = _load_hf(exported, trust_remote_code=True)
    hf.generation_config.eos_token_id = None
    prompt = torch.randint(3, VOCAB, (2, W + 4))
    new = 8
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, pad_token_id=0)
    beam = hf.generate(prompt, num_beams=3, do_sample=False, return_dict_in_generate=True, output_scores=True, **kwargs)
    with torch.no_grad():
        logp = torch.log_softmax(hf(beam.sequences).logits[:, W + 3 : -1].float(), -1)
    full = logp.gather(-1, beam.sequences[:, W + 4 :, None]).sum((1, 2)) / new  # length_penalty 1
    assert torch.allclose(beam.sequences_scores, full, atol=1e-4)
    sampled = hf.generate(prompt, do_sample=True, top_k=5, **kwargs)
    assert sampled.shape == (2, W + 4 + new)


def test_round_trip_keeps_every_hf_tensor(hf_dirs, tmp_path):
    convert_from_hf(hf_dirs["qwen3"], tmp_path / "orthros", sliding_window=W)
    convert_to_hf(tmp_path / "orthros", tmp_path / "back")
    original = safetensors.torch.load_file(hf_dirs["qwen3"] / "model.safetensors")
    back = safetensors.torch.load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) - set(original) == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("gamma", "beta")}
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_to_hf_refuses_non_orthros_and_mismatched_checkpoints(tmp_path):
    cfg = tiny_config(
        VOCAB, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=None, attention_type="dense"
    )
    OrthrosForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(ConversionError, match="attention_type='dense'"):
        convert_to_hf(tmp_path / "dense", tmp_path / "out")
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "dense", bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "attention_type": "orthros", "num_hidden_layers": 2}))
    with pytest.raises(ConversionError, match=r"missing \['layers\.1\."):
        convert_to_hf(bad, tmp_path / "out")


def test_cli_from_hf_to_hf_verify(hf_dirs, tmp_path, capsys):
    src = hf_dirs["llama"]
    assert convert_main(["from-hf", str(src), str(tmp_path / "o"), "--window", str(W)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert convert_main(["verify", str(src), str(tmp_path / "o")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == W and result["max_abs_diff"] <= 1e-4 and result["argmax_agreement"] == 1.0
    # Beyond W the converted model is compared as the dense model it equals (gamma=1, beta=0).
    assert convert_main(["verify", str(src), str(tmp_path / "o"), "--length", str(4 * W)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens"] == result["window"] == 4 * W and result["max_abs_diff"] <= 1e-4
    assert convert_main(["to-hf", str(tmp_path / "o"), str(tmp_path / "h"), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "h" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # A trainer checkpoint keeps neither tokenizer nor token ids: --tokenizer brings both.
    trained = tmp_path / "trained"
    trained.mkdir()
    shutil.copyfile(tmp_path / "o" / "model.safetensors", trained / "model.safetensors")
    raw = json.loads((tmp_path / "o" / "config.json").read_text())
    (trained / "config.json").write_text(json.dumps({**raw, "extra": {}}))
    assert convert_main(["to-hf", str(trained), str(tmp_path / "t"), "--tokenizer", str(tmp_path / "o")]) == 0
    exported = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, 2)
    assert convert_main(["from-hf", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_truncated_or_corrupt_safetensors_is_named_by_the_cli(hf_dirs, tmp_path, capsys):
    src = _edit_config(hf_dirs["llama"], tmp_path / "truncated")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # an interrupted download
    assert convert_main(["from-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{weights}" in err and "truncated or corrupt" in err and "Traceback" not in err
    weights.write_bytes(b"<html>rate limited</html>" * 4)  # not safetensors at all
    assert convert_main(["from-hf", str(src), str(tmp_path / "out2")]) == 2
    assert f"{weights}" in capsys.readouterr().err


def test_exported_tokenizer_loads_without_custom_code_or_a_prompt(orthros_dir, bpe_tokenizer_dir, tmp_path):
    """A fresh process with no stdin: the documented AutoTokenizer call neither asks nor runs the
    export's code, and encodes as the checkpoint's own tokenizer does."""
    tok_dir = bpe_tokenizer_dir(VOCAB, chat_template=False)
    exported = tmp_path / "hf"
    convert_to_hf(orthros_dir, exported, tokenizer=tok_dir)
    tokenizer_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config
    code = (
        "import json, sys; from transformers import AutoTokenizer; "
        "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=False); "
        "print(json.dumps(t('The most important thing about startups')['input_ids']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(exported)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300, env=cli_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    from orthros_train.common.tokenizer import load_tokenizer

    source = load_tokenizer(tok_dir)
    expected = source("The most important thing about startups")["input_ids"]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


@pytest.mark.parametrize(
    "changes, message",
    [
        # transformers 5 loads rope_scaling over rope_parameters: this file runs dynamic RoPE
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
          "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
          "rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5"),
        ({"rope_parameters": _DROP, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta must be a positive"),
        ({"rope_parameters": [1, 2]}, "rope_parameters must be a dict"),
    ],
)
def test_from_hf_refuses_rope_it_cannot_reproduce_in_either_config_style(hf_dirs, tmp_path, changes, message):
    src = _edit_config(hf_dirs["llama"], tmp_path / "src", **changes)
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(src, tmp_path / "dst", sliding_window=W)
    assert not (tmp_path / "dst").exists()


def test_from_hf_takes_the_rope_transformers_loads_when_both_styles_are_present(hf_dirs, tmp_path, capsys):
    """rope_scaling wins whole over rope_parameters (rope_theta falling back to the class
    default): the converted model must run that RoPE, and verify beyond W must agree."""
    src = _edit_config(
        hf_dirs["llama"], tmp_path / "src",
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    hf_cfg = transformers.AutoConfig.from_pretrained(src)
    convert_from_hf(src, tmp_path / "o", sliding_window=W)
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert cfg["rope_theta"] == hf_cfg.rope_parameters["rope_theta"]
    assert convert_main(["verify", str(src), str(tmp_path / "o"), "--tokens", str(3 * W)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["max_abs_diff"] <= 1e-4
    # the same weights with the RoPE the file seems to say (rope_parameters) are a different model
    (tmp_path / "o" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": None, "rope_theta": 500000.0}))
    assert convert_main(["verify", str(src), str(tmp_path / "o"), "--tokens", str(3 * W)]) == 1


def test_verify_beyond_the_window_refuses_a_trained_output_affine(hf_dirs, tmp_path, capsys):
    convert_from_hf(hf_dirs["llama"], tmp_path / "o", sliding_window=W)
    state = safetensors.torch.load_file(tmp_path / "o" / "model.safetensors")
    state["layers.0.self_attn.gamma"] += 0.1
    safetensors.torch.save_file(state, tmp_path / "o" / "model.safetensors")
    assert convert_main(["verify", str(hf_dirs["llama"]), str(tmp_path / "o"), "--tokens", str(2 * W)]) == 2
    assert "no longer the identity" in capsys.readouterr().err
    assert convert_main(["verify", str(hf_dirs["llama"]), str(tmp_path / "o"), "--tokens", "0"]) == 2
    assert "--tokens 0: must be >= 1" in capsys.readouterr().err
    assert convert_main(["verify", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "config.json not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "0"], "--window 0: the base-stream window W must be >= 1"),
        (["--window", "-3"], "--window -3"),
        (["--max-shard-size", "4XB"], "max shard size '4XB' is not a size"),
        (["--max-shard-size", "0"], "max shard size '0' is not positive"),
        (["--max-shard-size=-1GB"], "is not positive"),
    ],
)
def test_cli_bad_arguments_are_refused_before_the_destination_exists(hf_dirs, tmp_path, capsys, args, message):
    assert convert_main(["from-hf", str(hf_dirs["llama"]), str(tmp_path / "dst"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_attention_heads": _DROP}, r"required field\(s\) \['num_attention_heads'\] missing"),
        ({"hidden_size": _DROP, "vocab_size": _DROP}, r"\['vocab_size', 'hidden_size'\]"),
        ({"num_attention_heads": 0}, "num_attention_heads=0: must be positive integers"),
        ({"hidden_size": "64"}, "hidden_size='64': must be positive integers"),
    ],
)
def test_from_hf_incomplete_config_is_named(hf_dirs, tmp_path, capsys, changes, message):
    src = _edit_config(hf_dirs["llama"], tmp_path / "src", **changes)
    assert convert_main(["from-hf", str(src), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_failed_write_leaves_no_destination_and_unwritable_is_named(hf_dirs, tmp_path, monkeypatch, capsys):
    import orthros_train.convert.checkpoint_io as io

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io, "write_sharded", full_disk)
    with pytest.raises(ConversionError, match="No space left on device.*nothing was kept"):
        convert_from_hf(hf_dirs["llama"], tmp_path / "dst", sliding_window=W)
    assert not (tmp_path / "dst").exists()
    monkeypatch.undo()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        assert convert_main(["from-hf", str(hf_dirs["llama"]), str(ro / "dst")]) == 2
        assert "cannot create destination" in capsys.readouterr().err


def test_verify_with_the_directories_swapped_is_named(hf_dirs, tmp_path, capsys):
    convert_from_hf(hf_dirs["llama"], tmp_path / "o", sliding_window=W)
    assert convert_main(["verify", str(tmp_path / "o"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "has no model_type: HF_DIR must be a Hugging Face model directory" in err and "Traceback" not in err
