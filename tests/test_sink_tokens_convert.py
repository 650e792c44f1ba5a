"""Sink tokens through conversion: ``orthros-convert from-hf --sink-tokens``, the ``to-hf`` export's
config and remote code, ``verify``, and the eval overrides that switch sinks off (tiny random HF
Llama / Qwen3 models made here, as tests/test_convert.py does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import TINY_HF_SHAPE, spread_hf_norms, tiny_model

from orthros_train.convert.cli import main as convert_main
from orthros_train.convert.from_hf import convert_from_hf
from orthros_train.convert.prompt_logits import prompt_logits
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.errors import UserError
from orthros_train.eval.common import parse_overrides
from orthros_train.infer.loading import load_model
from orthros_train.model import OrthrosForCausalLM

transformers = pytest.importorskip("transformers")

W = 8
S = 4
VOCAB = 96


def _tiny_hf_model(kind: str):
    common = dict(vocab_size=VOCAB, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:  # Qwen3: q/k norm, explicit head_dim, tied head
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    return spread_hf_norms(model)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    dirs = {}
    for kind in ("llama", "qwen3"):
        _tiny_hf_model(kind).save_pretrained(root / kind)
        dirs[kind] = root / kind
    return dirs


def _load_hf(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_from_hf_with_sinks_equals_the_source_inside_w_and_at_w_above_t(hf_dirs, tmp_path, kind):
    """S = 4 changes nothing inside the window (each query's window already holds its sinks) nor
    with W >= T (the dense model); beyond W the sinks change the logits, and S = 0 there is the
    plain windowed model."""
    report = convert_from_hf(hf_dirs[kind], tmp_path / "o", sliding_window=W, sink_tokens=S)
    assert report.config.sink_tokens == S and f"{S} sink tokens" in report.summary()
    assert json.loads((tmp_path / "o" / "config.json").read_text())["sink_tokens"] == S
    hf = _load_hf(hf_dirs[kind])
    model = OrthrosForCausalLM.from_pretrained(tmp_path / "o").eval()
    ids = torch.randint(0, VOCAB, (2, 4 * W), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        inside = model(ids[:, :W]).logits
        dense = OrthrosForCausalLM.from_pretrained(tmp_path / "o", sliding_window=4 * W).eval()(ids).logits
        beyond = model(ids).logits
        plain = OrthrosForCausalLM.from_pretrained(tmp_path / "o", sink_tokens=0).eval()(ids).logits
    scale = float(want.abs().max())
    assert _max_diff(inside, want[:, :W]) <= 1e-5 * scale
    assert _max_diff(dense, want) <= 1e-5 * scale
    assert _max_diff(beyond[:, :W], want[:, :W]) <= 1e-5 * scale
    assert _max_diff(beyond[:, W:], plain[:, W:]) > 1e-3  # the sinks do act beyond W
    # ... and bring the converted model closer to its source there, with no training.
    assert _max_diff(beyond[:, W + S :], want[:, W + S :]) < _max_diff(plain[:, W + S :], want[:, W + S :])


@pytest.fixture(scope="module")
def trained_sinks(hf_dirs, tmp_path_factory):
    """A converted Qwen3 with S sinks whose output affine has been 'trained', and its export."""
    root = tmp_path_factory.mktemp("sinks")
    convert_from_hf(hf_dirs["qwen3"], root / "converted", sliding_window=W, sink_tokens=S)
    model = OrthrosForCausalLM.from_pretrained(root / "converted")
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)
            layer.self_attn.beta.normal_(0.0, 0.3)
    model.config.extra = json.loads((root / "converted" / "config.json").read_text())["extra"]
    model.save_pretrained(root / "trained")
    convert_to_hf(root / "trained", root / "export")
    return root / "trained", root / "export"


def test_to_hf_with_sinks_round_trip_logits(trained_sinks):
    """The export states sink_tokens and its remote code computes the project's model beyond W
    (a prompt read at once: its global tail included), and with logits_to_keep."""
    src, export = trained_sinks
    assert json.loads((export / "config.json").read_text())["sink_tokens"] == S
    hf = _load_hf(export, trust_remote_code=True)
    assert hf.config.sink_tokens == S
    model = OrthrosForCausalLM.from_pretrained(src).eval()
    # longer than W + the global tail (32, from-hf's default): windowed tokens, where sinks act, lie between
    ids = torch.randint(0, VOCAB, (2, 8 * W), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = hf(ids).logits, prompt_logits(model, ids)
        plain = prompt_logits(OrthrosForCausalLM.from_pretrained(src, sink_tokens=0).eval(), ids)
        tail = hf(ids, logits_to_keep=3).logits
    assert _max_diff(got, want) <= 1e-5 * float(want.abs().max())
    assert _max_diff(tail, want[:, -3:]) <= 1e-5 * float(want.abs().max())
    assert _max_diff(plain, want) > 1e-3  # the comparison would notice sinks left out


def test_remote_generate_with_sinks_equals_the_projects(trained_sinks):
    """Prefill + decode through transformers' generate (the OrthrosCache of every base key) equals
    generate_greedy, also for a left-padded row (its sinks are its own first tokens)."""
    src, export = trained_sinks
    hf = _load_hf(export, trust_remote_code=True)
    model = OrthrosForCausalLM.from_pretrained(src).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(4)
    long, short = torch.randint(3, VOCAB, (2 * W + 3,), generator=g), torch.randint(3, VOCAB, (W + 2,), generator=g)
    pad = len(long) - len(short)
    batch = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    new = 2 * W
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, len(long) :], model.generate_greedy(long[None], new)[0])
    assert torch.equal(out[1, len(long) :], model.generate_greedy(short[None], new)[0])


def test_cli_from_hf_to_hf_verify_with_sinks(hf_dirs, tmp_path, capsys):
    assert convert_main(["from-hf", str(hf_dirs["llama"]), str(tmp_path / "o"), "--window", str(W),
                         "--sink-tokens", str(S)]) == 0  # fmt: skip
    assert "4 sink tokens" in capsys.readouterr().out
    # beyond W a converted model is verified as the dense model (W raised to T): sinks included
    assert convert_main(["verify", str(hf_dirs["llama"]), str(tmp_path / "o"), "--tokens", str(3 * W)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sink_tokens"] == S and result["max_abs_diff"] <= 1e-3
    assert convert_main(["to-hf", str(tmp_path / "o"), str(tmp_path / "x")]) == 0
    capsys.readouterr()
    # the export against its checkpoint at any length: the remote code's sinks are checked
    assert convert_main(["verify", str(tmp_path / "x"), str(tmp_path / "o"), "--tokens", str(3 * W)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sink_tokens"] == S and result["window"] == W and result["max_abs_diff"] <= 1e-4


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "--sink-tokens -1 is negative"),
        ("2.5", "--sink-tokens '2.5' is not an integer"),
        ("four", "--sink-tokens 'four' is not an integer"),
        (str(W), f"--sink-tokens {W} is not below --window {W}"),
        ("100", "--sink-tokens 100 is not below --window 8"),
    ],
)
def test_bad_sink_tokens_flag_is_refused_in_one_line(hf_dirs, tmp_path, capsys, value, message):
    code = convert_main(["from-hf", str(hf_dirs["llama"]), str(tmp_path / "dst"), "--window", str(W),
                         f"--sink-tokens={value}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and f"from 0 (no sinks: the paper's layer) to {W - 1}" in err
    assert not (tmp_path / "dst").exists()


def test_eval_overrides_switch_sinks_off(trained_sinks):
    """``--override sink_tokens=0`` (alone, or with a wider window) loads the same weights as
    the paper's layer; a window at or below the sinks is refused by the config."""
    src, _ = trained_sinks
    ids = torch.randint(0, VOCAB, (1, 3 * W), generator=torch.Generator().manual_seed(6))
    for items, want in (
        (["sink_tokens=0"], {"sink_tokens": 0}),
        (["sliding_window=1024", "sink_tokens=0"], {"sliding_window": 1024, "sink_tokens": 0}),
    ):
        overrides = parse_overrides(items)
        assert overrides == want
        model = load_model(src, device="cpu", **overrides)  # what orthros-eval loads
        assert model.config.sink_tokens == 0 and model.config.sliding_window == want.get("sliding_window", W)
        ref = OrthrosForCausalLM.from_pretrained(src, **want).eval()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
    with pytest.raises(UserError, match="sink_tokens"):
        load_model(src, device="cpu", **parse_overrides([f"sliding_window={S}"]))


def test_a_recipe_that_drops_the_checkpoints_sinks_is_warned_about(tmp_path, caplog, monkeypatch):
    """Same weights, other attention: the run goes ahead (a study's arm may mean it) but says which
    model.* attention keys differ from init_from's config.json."""
    import logging

    import torch
    from fixtures import compose_recipe  # noqa: I001 - beside the other test-local imports

    from orthros_train.train import build
    from orthros_train.train.build import build_model

    # One process without megatron's groups: the plain model stands in for the parallel one.
    monkeypatch.setattr(build, "build_parallel_model", lambda cfg, pcfg, seed=None: OrthrosForCausalLM(cfg))
    monkeypatch.setattr(build, "load_reference_shards", lambda model, weights, cfg: None)
    ckpt = tmp_path / "ckpt"
    tiny_model(vocab_size=2048, sliding_window=8, sink_tokens=2).save_pretrained(ckpt)
    common = (f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={ckpt}", "model.sliding_window=8")
    with caplog.at_level(logging.WARNING, logger="orthros_train.train.build"):
        build_model(compose_recipe("tiny_cpu", *common, "+model.sink_tokens=2"), torch.device("cpu"))
        assert not [r for r in caplog.records if "init_from" in r.getMessage()]
        build_model(compose_recipe("tiny_cpu", *common), torch.device("cpu"))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "model.sink_tokens=0 in the recipe, 2 in" in said and "config.json" in said, said
