"""The conversion study (``orthros-study conversion``): the converted checkpoint, the arms built from one
teacher, the recovery curve's bookkeeping, the report, the early freeze, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from orthros_train.errors import UserError
from orthros_train.model import OrthrosForCausalLM
from orthros_train.model.config import OrthrosConfig
from orthros_train.study import conversion
from orthros_train.study.conversion import (
    ARMS,
    CONTINUED,
    ConversionOptions,
    checkpoint_at,
    convert_dense_checkpoint,
    curve_steps,
    equality_within_window,
    merge_overrides,
    save_every,
    summarize_arm,
)

W = 8


def _dense_teacher(path: Path) -> Path:
    """A tiny random dense checkpoint (the study's quick shape)."""
    cfg = OrthrosConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64, sliding_window=W, attention_type="dense",
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = OrthrosForCausalLM(cfg)
    with torch.no_grad():  # a trained teacher's affine is still 1/0 (dense never uses it): move it to see the reset
        for name, p in model.named_parameters():
            if name.endswith(("gamma", "beta")):
                p.add_(0.5)
    model.save_pretrained(path)
    return path


def test_converted_checkpoint_equals_the_teacher_inside_the_window(tmp_path) -> None:
    teacher = _dense_teacher(tmp_path / "teacher")
    converted = convert_dense_checkpoint(teacher, tmp_path / "converted", W)
    model = OrthrosForCausalLM.from_pretrained(converted)
    assert model.config.attention_type == "orthros" and model.config.sliding_window == W
    for name, p in model.named_parameters():
        if name.endswith("gamma"):
            assert torch.equal(p, torch.ones_like(p))
        elif name.endswith("beta"):
            assert torch.equal(p, torch.zeros_like(p))
    check = equality_within_window(teacher, converted, seq_len=48)
    assert check["within_w"] < 1e-5 < 1e-4 < check["beyond_w"]  # the same model inside W, not beyond it
    noisy = OrthrosForCausalLM.from_pretrained(convert_dense_checkpoint(teacher, tmp_path / "noisy", W, 0.1))
    gammas = torch.cat([p.detach().flatten() for n, p in noisy.named_parameters() if n.endswith("gamma")])
    assert 0.05 < float(gammas.std()) < 0.2 and abs(float(gammas.mean()) - 1) < 0.05


def test_curve_points_fall_on_saved_steps() -> None:
    points = curve_steps(200, conversion.CURVE_FRACTIONS)
    assert points == [(0.0, 0), (0.1, 20), (0.25, 50), (0.5, 100), (1.0, 200)]
    assert save_every(200, conversion.CURVE_FRACTIONS) == 10
    assert all(step % 10 == 0 for _, step in points)
    assert save_every(10, (0.0, 1.0)) == 0  # only the final checkpoint is needed
    with pytest.raises(UserError, match="distinct steps"):
        curve_steps(10, (0.1, 0.12))
    with pytest.raises(UserError, match="distinct steps"):
        curve_steps(10, (0.0, 0.01))  # rounds to step 0, the converted model
    with pytest.raises(UserError, match="outside"):
        curve_steps(10, (1.5,))
    run = Path("r")
    assert checkpoint_at(run, 20, 200) == run / "checkpoints" / "step_000000020" / "model"
    assert checkpoint_at(run, 200, 200) == run / "checkpoints" / "final"
    with pytest.raises(UserError, match="distinct steps"):
        ConversionOptions(steps=5, fractions=(0.1, 0.2), warmups=(0.0,), frozen=0.0)


def test_merge_overrides_keeps_the_last_value_per_key() -> None:
    merged = merge_overrides(["trainer.max_steps=12", "a=1"], ["trainer.max_steps=10", "++optim.frozen_steps=2"])
    assert merged == ["a=1", "trainer.max_steps=10", "++optim.frozen_steps=2"]


def _fake_eval(ckpt: Path, window: int = W, seq_len: int = 96, **_: Any) -> dict[str, Any]:
    """What evaluate_checkpoint returns, with numbers derived from the checkpoint's path."""
    h = sum(map(ord, str(ckpt))) % 97 / 97
    buckets = [{"low": lo, "high": hi, "label": f"[{lo}, {hi})", "tokens": 100, "loss": 5 + h + lo / 1000,
                "beyond_window": lo >= window} for lo, hi in ((0, window), (window, 2 * window), (2 * window, seq_len))]
    return {
        "attention_type": "orthros", "parameters": 1, "config": {"sliding_window": window},
        "essay_valid": {"loss": sum(b["loss"] for b in buckets) / 3, "buckets": buckets},
        "recall": {"accuracy": h, "accuracy_within_window": 1.0, "accuracy_beyond_window": h, "chance": 1 / 16,
                   "buckets": [{"label": "[0, 8)", "low": 0, "high": 8, "beyond_window": False, "queries": 3,
                                "accuracy": 1.0}, {"label": "[8, 96)", "low": 8, "high": 96, "beyond_window": True,
                                                   "queries": 5, "accuracy": h}]},
        "passkey": {"pairs": {"within_window": {"accuracy": 1.0}, "4-8x_window": {"accuracy": h}},
                    "essays": {"within_window": {"accuracy": 0.5}, "4-8x_window": {"accuracy": 0.0}}},
    }


def test_summarize_arm_means_and_stds() -> None:
    evals = [_fake_eval(Path(f"run{i}")) for i in range(3)]
    s = summarize_arm(evals)
    beyond = [e["recall"]["accuracy_beyond_window"] for e in evals]
    assert s["n"] == 3 and math.isclose(s["recall_beyond_w"], sum(beyond) / 3)
    assert math.isclose(s["recall_beyond_w_std"], torch.tensor(beyond).std().item(), rel_tol=1e-6)
    # Beyond W: the token-weighted buckets at positions >= W only.
    assert math.isclose(s["loss_beyond_w"], sum((e["essay_valid"]["buckets"][1]["loss"]
                                                 + e["essay_valid"]["buckets"][2]["loss"]) / 2 for e in evals) / 3)
    assert summarize_arm(evals[:1])["loss_std"] == 0.0


@pytest.fixture
def fake_study(tmp_path, monkeypatch):
    """run_conversion_study with the training processes and the evaluation replaced by records: every
    command the study would run, and results made of checkpoints' names."""
    calls: list[dict[str, Any]] = []

    def fake_train(arch, run_dir, overrides, log=None, threads=None, recipe=None, stop_after_s=None, overwrite=False):
        kv = dict(o.lstrip("+").split("=", 1) for o in overrides)
        calls.append({"arch": arch, "run_dir": Path(run_dir), **kv})
        steps = int(kv.get("trainer.max_steps", 12))
        run_dir = Path(run_dir)
        (run_dir / "checkpoints" / "final").mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.json").write_text(json.dumps({"trainer": {"seed": int(kv["trainer.seed"]), "seq_len": 96},
                                                         "optim": {"lr": float(kv["optim.lr"])}}))
        loss = 2.0 + abs(math.log10(float(kv["optim.lr"])) + 3) + float(kv.get("optim.frozen_steps", 0)) / 100
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": steps, "loss": loss, "eval_loss": loss,
                                                           "consumed_samples": 2 * steps, "tokens_per_s": 1.0}))
        return 1.0

    monkeypatch.setattr(conversion, "train_run", fake_train)
    monkeypatch.setattr(conversion, "evaluate_checkpoint",
                        lambda ckpt, data, seq_len, *a, **k: _fake_eval(Path(ckpt), seq_len=seq_len))
    teacher = _dense_teacher(tmp_path / "teacher")
    return calls, teacher


def test_every_arm_continues_from_the_one_teacher_on_the_same_tokens(fake_study, tmp_path) -> None:
    calls, teacher = fake_study
    out = tmp_path / "out"
    opts = ConversionOptions.quick_defaults(out=out, report=out / "conversion.md", teacher=teacher, seeds=(1, 2, 3),
                                            lrs=(1e-3, 3e-3), warmups=(0.0, 0.1), steps=20, command="pytest")
    results = conversion.run_conversion_study(opts, log=lambda msg: None)

    continued = [c for c in calls if "longctx" not in str(c["run_dir"])]
    converted = str(out / "converted")
    for c in continued:  # Orthros from the converted teacher (or its noisy variant), the baselines from the teacher
        assert c["trainer.max_steps"] == "20" and c["model.sliding_window"] == "8"
        assert c["trainer.save_every"] == "1"  # gcd(2, 5, 10): every arm's curve
        if c["arch"] == "orthros":
            assert c["model.init_from"].startswith(converted)
        else:
            assert c["model.init_from"] == str(teacher)
    sweep = [c for c in continued if "sweep" in str(c["run_dir"])]
    # Two rates at the first warm-up, then at the kept rate: the other warm-up, noisy gamma/beta, the freeze.
    assert len(sweep) == 2 + 3 and {c["trainer.seed"] for c in sweep} == {"1"}
    assert {c["optim.lr"] for c in sweep[2:]} == {"0.001"} and sweep[-1]["optim.frozen_steps"] == "2"
    chosen = results["sweep"]["chosen"]
    assert chosen == {"lr": 1e-3, "warmup": 0.0, "affine_noise": 0.0, "frozen": 0.0}  # the fake's lowest loss
    finals = [c for c in continued if "sweep" not in str(c["run_dir"])]
    for arch in CONTINUED.values():
        mine = [c for c in finals if c["arch"] == arch]
        seeds = sorted(c["trainer.seed"] for c in mine)
        assert seeds == (["2", "3"] if arch == "orthros" else ["1", "2", "3"])  # seed 1's Orthros run is the sweep's
        assert {(c["optim.lr"], c["optim.warmup_steps"], c["optim.min_lr"]) for c in mine} == {("0.001", "0", "0.0001")}
        assert all("optim.frozen_steps" not in c for c in mine)
    saved = json.loads((out / "conversion.json").read_text())
    assert set(saved["arms"]) == set(ARMS) and saved["window"] == W and saved["seeds"] == [1, 2, 3]
    for arm in ARMS:
        row = saved["arms"][arm]
        for key in ("loss", "loss_beyond_w", "recall_within_w", "recall_beyond_w"):
            assert f"{key}_std" in row and (0 <= row[key] <= 1 if key.startswith("recall") else row[key] > 0)
        assert row["n"] == (1 if arm in ("teacher", "converted") else 3)
    assert [p["fraction"] for p in saved["curve"]] == [0.0, 0.1, 0.25, 0.5, 1.0]
    assert [p["step"] for p in saved["curve"]] == [0, 2, 5, 10, 20]
    assert saved["curve"][0]["n"] == 1 and saved["curve"][-1]["n"] == 3
    # The curve's first point is the converted model, its last the arm's final checkpoints.
    assert saved["curve"][0]["loss_beyond_w"] == saved["arms"]["converted"]["loss_beyond_w"]
    assert saved["curve"][-1]["recall_beyond_w"] == saved["arms"]["orthros_continued"]["recall_beyond_w"]
    assert set(saved["curves"]) == set(CONTINUED) and saved["curves"]["orthros_continued"] == saved["curve"]
    assert saved["curves"]["dense_continued"][0]["loss"] == saved["arms"]["teacher"]["loss"]  # dense starts as it
    assert saved["conversion_check"]["within_w"] < 1e-5
    assert set(saved["longctx"]["rows"]) == {"unextended", "extended_untrained", "extended_continued"}
    (lc,) = [c for c in calls if "longctx" in str(c["run_dir"])]
    assert lc["trainer.seq_len"] == "384" and "yarn" in lc["model.rope_scaling"]
    assert lc["trainer.micro_batch_size"] == "1"  # 2 sequences of 96 -> 1 of 384
    text = (out / "conversion.md").read_text()
    o = saved["arms"]["orthros_continued"]
    assert f"{o['loss_beyond_w']:.3f} ± {o['loss_beyond_w_std']:.3f}" in text  # the table shows the JSON
    assert (out / "conversion" / "recovery.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Long-context extension" in text and "(kept)" in text


def test_report_only_rerenders_with_a_smollm2_section(fake_study, tmp_path) -> None:
    from orthros_train.study.cli import main

    calls, teacher = fake_study
    out = tmp_path / "out"
    assert main(["conversion", "--quick", "--out", str(out), "--teacher", str(teacher), "--no-longctx"]) == 0
    rows = {k: {"name": k, "loss": 3.0, "loss_within_w": 3.2, "loss_beyond_w": 2.9, "perplexity_beyond_w": 18.2,
                "niah": 0.5} for k in ("original", "converted", "continued")}
    (out / "smollm2.json").write_text(json.dumps({
        "window": 128, "seq_len": 512, "budget_minutes": 30, "recipe_settings": "lr 5e-05", "train_documents": 47,
        "heldout_files": ["a.txt", "b.txt"], "heldout_tokens": 4096, "rows": rows, "load_average": "1 1 1",
        "training": {"steps": 7, "tokens_per_step": 512, "tokens": 3584, "train_seconds": 60, "tokens_per_s": 60},
        "niah": {"cells": 6, "lengths": [512, 1024], "depths": [10, 50, 90], "beyond_w": 4}}))
    notes = tmp_path / "notes.md"
    notes.write_text("Hand-written analysis.")
    report = tmp_path / "docs" / "conversion_study.md"
    assert main(["conversion", "--report-only", "--out", str(out), "--report", str(report), "--notes", str(notes)]) == 0
    text = report.read_text()
    assert "## A real model: SmolLM2-135M" in text and "| 18.20 |" in text and "Hand-written analysis." in text
    assert "## Long-context extension" not in text
    assert (tmp_path / "docs" / "conversion_study" / "recovery.png").is_file()


def _refused(capsys, argv: list[str], *needles: str) -> None:
    from orthros_train.study.cli import main

    assert main(["conversion", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "study.json").write_text("{}")
    _refused(capsys, ["--quick", "--out", str(other)], "holds the replication study", "pick an empty or new folder")
    assert sorted(p.name for p in other.iterdir()) == ["study.json"]
    out = tmp_path / "new"
    _refused(capsys, ["--quick", "--out", str(out), "--teacher", str(tmp_path / "missing")],
             "--teacher", "no checkpoint there", "drop --teacher")
    _refused(capsys, ["--quick", "--out", str(out), "--window", "96"], "--window 96", "96 tokens",
             "below the sequence length")
    _refused(capsys, ["--quick", "--out", str(out), "--window", "40"], "needle 4 windows back", "--window <= 22")
    orthros = OrthrosForCausalLM(OrthrosConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=32))
    orthros.save_pretrained(tmp_path / "orthros")
    _refused(capsys, ["--quick", "--out", str(out), "--teacher", str(tmp_path / "orthros")],
             "attention_type is 'orthros'")
    _refused(capsys, ["--report-only", "--out", str(out)], "conversion.json, which does not exist")
    assert not out.exists()


def test_frozen_steps_update_only_the_output_affine_first() -> None:
    from orthros_train.train.config import OptimConfig
    from orthros_train.train.optim import build_optimizer

    cfg = OrthrosConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64, sliding_window=4)
    model = OrthrosForCausalLM(cfg)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0, frozen_steps=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    moved = []
    for _ in range(3):
        model(ids).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
        moved.append({n.rsplit(".", 1)[-1] if n.endswith(("gamma", "beta")) else "pretrained"
                      for n, p in model.named_parameters() if not torch.equal(p, before[n])})
    assert moved == [{"gamma", "beta"}, {"gamma", "beta"}, {"gamma", "beta", "pretrained"}]
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)  # the held groups get their rate back
    with pytest.raises(UserError, match="frozen_steps"):
        OptimConfig(frozen_steps=-1)


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path) -> None:
    """The reduced study through the real trainer: teacher, sweep, seeds, curves, long context, report."""
    from orthros_train.study.cli import main

    out = tmp_path / "conv"
    assert main(["conversion", "--quick", "--out", str(out), "--longctx-steps", "2"]) == 0
    saved = json.loads((out / "conversion.json").read_text())
    assert set(saved["arms"]) == set(ARMS) and saved["window"] == 8 and saved["seeds"] == [1, 2]
    assert [p["step"] for p in saved["curve"]] == [0, 1, 2, 5, 10]
    assert saved["conversion_check"]["within_w"] < 1e-4
    teacher, converted = saved["arms"]["teacher"], saved["arms"]["converted"]
    assert abs(teacher["loss"] - converted["loss"]) < 0.05  # the same model inside W, a little apart beyond it
    assert (out / "conversion.md").is_file() and (out / "conversion" / "recovery.png").is_file()
