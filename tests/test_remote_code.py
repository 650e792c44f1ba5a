"""The remote code of a to-hf export: the package's own files (imports rewritten, nothing else),
loadable by transformers' dynamic-module loader with neither orthros_train nor triton, and computing
the package's model: forward logits, greedy generate with a global tail and sinks on prompts longer
than the window, ragged left-padded batches. A config.json that lost a key-rule field is refused."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from fixtures import tiny_config, tiny_model

from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.remote_code import REMOTE_CODE_FILES, shipping
from orthros_train.convert.to_hf import convert_to_hf, hf_config_from_orthros
from orthros_train.infer.generate import generate
from orthros_train.model import OrthrosForCausalLM
from orthros_train.model.layers import rope_parameters

transformers = pytest.importorskip("transformers")
from transformers import dynamic_module_utils  # noqa: E402 - after the importorskip

W, S, R = 8, 2, 3
VOCAB = 64


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(package model, its checkpoint, its export): W = 8, 2 sinks, a global tail of 3, a trained
    output affine, weights spread wide enough (std 0.15) that the tail and the sinks show in the logits."""
    root = tmp_path_factory.mktemp("remote")
    model = tiny_model(VOCAB, sliding_window=W, sink_tokens=S, base_global_tail=R, output_affine="resampled",
                       initializer_range=0.15).eval()
    model.save_pretrained(root / "src")
    convert_to_hf(root / "src", root / "export")
    return model, root / "src", root / "export"


def _load(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.float32, **kwargs
    ).eval()


def _import_lines(source: str) -> set[int]:
    """1-based line numbers of every import statement of a module (multi-line ones whole)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def test_shipped_files_are_the_package_files_with_only_their_imports_rewritten(exported):
    _, _, export = exported
    shipped = {p.name for p in export.glob("*.py")}
    assert shipped == set(REMOTE_CODE_FILES)
    assert {"configuration_orthros.py", "modeling_orthros.py", "orthros_model_orthros.py", "orthros_ops_keys.py",
            "orthros_phase_builders.py", "orthros_model_cache.py"} <= shipped
    for module in shipping.shipped_modules():
        name = shipping.exported_name(module)
        package = shipping.module_path(module).read_text()
        text = (export / name).read_text()
        # recomputed from the package file now: an export can only be what the package says
        assert text == shipping.shipped_source(module), name
        # and, independently of the rewrite: the same lines, changed only where an import stood
        assert text.count("\n") == package.count("\n"), name
        changed = {i + 1 for i, (a, b) in enumerate(zip(package.split("\n"), text.split("\n"))) if a != b}
        assert changed <= _import_lines(package), (name, sorted(changed - _import_lines(package)))
        for i in changed:  # a relative import, a refusal of a Triton-only import, or its emptied lines
            line = text.split("\n")[i - 1].strip()
            allowed = ("from .orthros_", "from .configuration_orthros", "raise ImportError(")
            assert not line or line.startswith(allowed), (name, line)
    # the ops are the key rule's single copy: ops/keys.py shipped verbatim but for its one import
    keys = (export / "orthros_ops_keys.py").read_text()
    assert keys == shipping.module_path("orthros_train.ops.keys").read_text().replace(
        "from orthros_train.errors import", "from .orthros_errors import")


def test_transformers_finds_every_shipped_file_and_no_import_it_would_refuse(exported):
    _, _, export = exported
    reachable = set()
    for entry in ("configuration_orthros.py", "modeling_orthros.py"):
        reachable |= {Path(f).name for f in dynamic_module_utils.get_relative_import_files(str(export / entry))}
        reachable.add(entry)
    assert reachable == {p.name for p in export.glob("*.py")}  # nothing missing, nothing shipped for nothing
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "safetensors"}
    for path in export.glob("*.py"):
        needed = set(dynamic_module_utils.get_imports(str(path)))  # what trust_remote_code checks
        assert needed <= allowed, (path.name, sorted(needed - allowed))
        assert not needed & {"triton", "megatron", "deepspeed", "hydra", "orthros_train", "numpy"}, path.name
    dynamic_module_utils.check_imports(str(export / "modeling_orthros.py"))


def test_a_module_that_needs_triton_when_loaded_is_never_shipped(monkeypatch):
    assert "imports triton" in shipping.unshippable("orthros_train.ops.triton_attention")
    assert shipping.unshippable("orthros_train.ops.attention") is None  # its triton import is lazy
    assert shipping.exported_name("orthros_train.ops.keys") == "orthros_ops_keys.py"
    # an entry module whose imports need triton at load time is refused, naming the chain
    monkeypatch.setattr(shipping, "ENTRY_MODULES", ("orthros_train.ops.triton_decode",))
    shipping.shipped_modules.cache_clear()
    try:
        with pytest.raises(shipping.ShippingError, match="triton_decode imports triton"):
            shipping.shipped_modules()
    finally:
        shipping.shipped_modules.cache_clear()


def test_the_export_loads_without_orthros_train_and_triton_and_generates(exported):
    import subprocess

    model, _, export = exported
    prompt = torch.randint(3, VOCAB, (1, 3 * W), generator=torch.Generator().manual_seed(7))
    script = (
        "import sys, torch; sys.modules['orthros_train'] = None; sys.modules['triton'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(export)!r}, trust_remote_code=True).eval()\n"
        "m.generation_config.eos_token_id = None\n"
        f"out = m.generate(torch.tensor({prompt.tolist()}), max_new_tokens=6, do_sample=False, pad_token_id=0)\n"
        "print(out[0, -6:].tolist())"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=export.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(model.generate_greedy(prompt, 6)[0].tolist())


def test_forward_logits_equal_the_packages(exported):
    """Every position of a prompt read at once (its last R tokens global), the prompt step alone
    (the package's prefill), and a left-padded row (its own tokens, the padding's logits 0)."""
    model, _, export = exported
    hf = _load(export)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 4 * W), generator=g)
    with torch.no_grad():
        got, want = hf(ids).logits, prompt_logits(model, ids)
        prefill, _ = model.prefill(ids)
        step = hf(ids, logits_to_keep=1).logits[:, -1]
        windowed = model(ids).logits  # the training view: no tail
        short = ids[1, : 2 * W + 3]
        padded = torch.cat([torch.zeros(ids.shape[1] - short.numel(), dtype=torch.long), short])
        mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - short.numel()).long()
        ragged = hf(torch.stack([ids[0], padded]), attention_mask=torch.stack([torch.ones_like(mask), mask])).logits
        alone = prompt_logits(model, short[None])[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((step - prefill).abs().max()) <= 1e-5 * scale
    assert float((got[:, -R - 1 :] - windowed[:, -R - 1 :]).abs().max()) > 1e-3 * scale  # the tail acts
    assert float((ragged[0] - want[0]).abs().max()) <= 1e-5 * scale
    assert float((ragged[1, -short.numel() :] - alone).abs().max()) <= 1e-5 * scale
    assert not ragged[1, : -short.numel()].any()


def test_greedy_generate_equals_the_packages_on_a_ragged_left_padded_batch(exported):
    """R > 0 and S > 0, prompts longer than W, rows of three lengths left-padded into one batch:
    transformers' generate equals the package's generate (one ragged batch) and generate_greedy
    (each row alone), and every step's logits the package's prefill and decode steps; without the
    tail (R = 0 in the loaded config) the steps' logits differ."""
    model, _, export = exported
    hf = _load(export)
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, VOCAB, (n,), generator=g) for n in (3 * W + 1, W + 3, 2 * W)]
    t, new = max(r.numel() for r in rows), 2 * W
    batch = torch.stack([torch.cat([torch.zeros(t - r.numel(), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([(torch.arange(t) >= t - r.numel()).long() for r in rows])
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    run = hf.generate(batch, **kwargs)
    out, scores = run.sequences[:, t:], torch.stack(run.scores, 1)  # [B, new, V]
    package = generate(model, [r.tolist() for r in rows], max_new_tokens=new, prefill_chunk_size=W)
    for i, row in enumerate(rows):
        assert out[i].tolist() == package.sequences[i] == model.generate_greedy(row[None], new)[0].tolist(), i
        with torch.no_grad():
            logits, cache = model.prefill(row[None])
            for k in range(new):
                assert float((scores[i, k] - logits[0]).abs().max()) <= 1e-4 * float(logits.abs().max()), (i, k)
                logits, cache = model.decode_step(out[i, k : k + 1], cache)
    no_tail = _load(export, base_global_tail=0)
    other = torch.stack(no_tail.generate(batch, **kwargs).scores, 1)
    assert float((other[:, 0] - scores[:, 0]).abs().max()) > 1e-3 * float(scores.abs().max())  # the tail acts


@pytest.mark.parametrize("key", ["base_window", "sink_tokens", "base_global_tail"])
def test_a_config_without_a_key_rule_field_is_refused_naming_it(exported, tmp_path, key):
    _, _, export = exported
    old = tmp_path / "old"
    shutil.copytree(export, old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg[key]
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"has no {key} .*re-export the checkpoint with `orthros-convert to-hf`"):
        _load(old)


def test_to_hf_states_the_key_rule_even_at_zero(tmp_path):
    OrthrosForCausalLM(tiny_config(VOCAB, sliding_window=W)).save_pretrained(tmp_path / "src")
    convert_to_hf(tmp_path / "src", tmp_path / "export")
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (cfg["base_window"], cfg["sink_tokens"], cfg["base_global_tail"]) == (W, 0, 0)


@pytest.mark.parametrize("extra", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "qk_norm": True},
    {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_routing": "joint",
     "shared_expert_intermediate_size": 8, "attention_bias": True, "tie_word_embeddings": True},
])
def test_the_exported_config_maps_back_to_the_package_config(extra):
    from orthros_train.convert.remote_code.configuration_orthros import OrthrosConfig as ExportConfig

    cfg = tiny_config(VOCAB, sliding_window=W, sink_tokens=S, base_global_tail=R, **extra)
    back = ExportConfig(**hf_config_from_orthros(cfg, "float32")).model_config()
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "rms_norm_eps", "qk_norm", "attention_bias", "tie_word_embeddings",
              "sliding_window", "sink_tokens", "base_global_tail", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
              "shared_expert_intermediate_size", "moe_routing", "max_position_embeddings")
    assert {f: getattr(back, f) for f in fields} == {f: getattr(cfg, f) for f in fields}
    ours, theirs = (rope_parameters(c.head_dim, c.rope_theta, c.rope_scaling) for c in (cfg, back))
    assert torch.equal(ours[0], theirs[0]) and ours[1] == theirs[1]


def test_refusals_of_what_the_export_cannot_compute(exported):
    _, _, export = exported
    hf = _load(export)
    ids = torch.randint(3, VOCAB, (1, 2 * W))
    with pytest.raises(ValueError, match="prefill_chunk_size=4 with base_global_tail=3"):
        hf.generate(ids, max_new_tokens=2, prefill_chunk_size=4)
    filled = transformers.DynamicCache()
    filled.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    with pytest.raises(ValueError, match="continues only the OrthrosCache its own forward returned"):
        hf(ids, cache=filled)
    with pytest.raises(ValueError, match="not a StaticCache: generate with the default cache"):
        hf.generate(ids, max_new_tokens=2, cache_implementation="static")
