"""The replication study: the synthetic recall data, the passkey probe, the sweep/seed bookkeeping,
and the reduced pipeline end to end."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from orthros_train.data.synthetic_recall import (
    RecallMix,
    make_passkey_document,
    make_recall_document,
    prepare_recall_dataset,
    token_ranges,
)
from orthros_train.errors import UserError


def test_recall_document_queries_are_fixed_by_an_earlier_pair() -> None:
    ranges = token_ranges(256, 16, reserved=(0,))
    doc = make_recall_document(random.Random(3), 201, 6, ranges)
    ids = doc.input_ids
    assert len(ids) == 201 and 0 not in ids
    assert all(ids[i] in ranges.keys for i in range(0, 201, 2))  # k v k v ... ending on a lone key
    assert all(ids[i] in ranges.values for i in range(1, 200, 2))
    assert len(set(ids[0::2])) == 6  # the document's six keys
    assert len(doc.distances) == len(doc.targets) == len(doc.output_positions) > 50
    for p, v, d in zip(doc.output_positions, doc.targets, doc.distances):
        assert ids[p + 1] == v
        assert ids[p - d] == ids[p] and ids[p - d + 1] == v  # the key's previous occurrence, d back
        assert ids[p] not in ids[p - d + 1:p]  # ... and its latest one
    firsts = {ids[i] for i in range(0, 201, 2)}
    assert len(doc.output_positions) == 100 - len(firsts)  # every repeated key is a query, no first one


def test_values_per_key_binds_each_key_to_its_own_candidates() -> None:
    ranges = token_ranges(512, 8, reserved=(0,), values_per_key=4)
    assert len(ranges.values) == 32 and ranges.keys.stop == ranges.values.start
    doc = make_recall_document(random.Random(0), 64, 8, ranges)
    for p, v in zip(doc.output_positions, doc.targets):
        assert v in ranges.candidates(doc.input_ids[p])
    assert RecallMix(keys=8, pairs=8, values_per_key=4).chance == 0.25
    with pytest.raises(UserError, match="too small"):
        token_ranges(64, 8, values_per_key=8)


def test_passkey_needle_sits_at_the_asked_distance() -> None:
    ranges = token_ranges(300, 8, reserved=(0,), values_per_key=4)
    haystack = [1 + i % 200 for i in range(120)]
    for d in (2, 17, 64, 120):
        doc = make_passkey_document(random.Random(d), haystack, d, ranges)
        (q,), (v,) = doc.output_positions, doc.targets
        assert q == len(doc.input_ids) - 1 and doc.distances == [d]
        assert doc.input_ids[q - d] == doc.input_ids[q] and doc.input_ids[q - d + 1] == v  # needle [k v]
        assert v in ranges.candidates(doc.input_ids[q]) and doc.input_ids.count(doc.input_ids[q]) == 2
    with pytest.raises(UserError, match="distance"):
        make_passkey_document(random.Random(0), haystack, 121, ranges)
    with pytest.raises(UserError, match="every key"):
        make_passkey_document(random.Random(0), list(ranges.keys) * 4, 10, ranges)


def test_recall_mix_rejects_bad_settings() -> None:
    with pytest.raises(UserError, match="unknown key"):
        RecallMix.from_dict({"fraction": 0.5, "paris": 3})
    with pytest.raises(UserError, match="fraction"):
        RecallMix(fraction=1.0)
    with pytest.raises(UserError, match="pairs <= keys"):
        RecallMix(pairs=10, keys=5)
    with pytest.raises(UserError, match="min_pairs"):
        RecallMix(pairs=4, keys=8, min_pairs=5)
    with pytest.raises(UserError, match="values_per_key"):
        RecallMix(values_per_key=1)
    mix = RecallMix(pairs=6, keys=8, min_pairs=2)
    assert {mix.pairs_of_document(random.Random(i)) for i in range(50)} == set(range(2, 7))


def test_recall_dataset_documents_fill_one_sample_each(tmp_path) -> None:
    from orthros_train.data.indexed import open_indexed

    mix = RecallMix(documents=5, pairs=4, keys=8, values_per_key=2)
    prefix = prepare_recall_dataset(mix, vocab_size=100, eod_token_id=0, seq_len=64, cache_dir=str(tmp_path))
    assert prepare_recall_dataset(mix, 100, 0, 64, str(tmp_path)) == prefix  # cached: same settings, same file
    ds = open_indexed(prefix)
    assert len(ds) == 5
    for i in range(5):
        doc = np.asarray(ds[i])
        assert doc.size == 64 and doc[-1] == 0 and (doc[:-1] != 0).all()  # seq_len tokens, EOD last


def test_sweep_keeps_the_lowest_finite_loss_and_seeds_aggregate() -> None:
    from orthros_train.study.pipeline import pick_lr, spread

    assert pick_lr({1e-3: 2.0, 3e-3: 1.5, 1e-2: float("nan")}) == 3e-3
    assert pick_lr({1e-3: None, 3e-3: 2.5}) == 3e-3
    with pytest.raises(UserError, match="finite"):
        pick_lr({1e-3: None, 1e-2: float("inf")})
    s = spread([0.5, 1.0, None, 0.75])
    assert s["n"] == 3 and s["mean"] == 0.75 and s["min"] == 0.5 and s["max"] == 1.0
    assert math.isclose(s["std"], 0.25)
    assert spread([None])["mean"] is None and spread([0.3])["std"] == 0.0


@pytest.mark.slow  # 12 trainer runs: minutes on the shared CPU
def test_study_pipeline_end_to_end(tmp_path) -> None:
    """Sweep (two rates) and two seeds of the three models through the real CLI, evaluated and reported."""
    from orthros_train.study import ARCHS, StudyOptions, run_study

    steps = 4
    report = tmp_path / "study.md"
    results = run_study(StudyOptions(
        out=tmp_path / "runs", report=report, quick=True, steps=steps, seeds=(7, 8), lrs=(1e-3, 1e-2), jobs=2,
        recall_documents=2, passkey_documents=2, valid_tokens=512, prefill_lengths=[64], command="pytest",
    ), log=lambda msg: None)

    saved = json.loads((tmp_path / "runs" / "study.json").read_text())
    assert set(saved["runs"]) == set(saved["summary"]) == set(saved["sweep"]) == set(ARCHS)
    assert len({r["tokens"] for runs in saved["runs"].values() for r in runs}) == 1  # equal token budgets
    assert len({r["parameters"] for runs in saved["runs"].values() for r in runs}) == 1  # one shape
    text = report.read_text()
    for arch, runs in saved["runs"].items():
        sweep = saved["sweep"][arch]
        assert set(sweep["runs"]) == {"0.001", "0.01"} and sweep["best_lr"] in (1e-3, 1e-2)
        losses = sweep["blend_valid_loss"]
        assert losses[f"{sweep['best_lr']:g}"] == min(losses.values())
        assert [r["seed"] for r in runs] == [7, 8] and {r["lr"] for r in runs} == {sweep["best_lr"]}
        for r in runs:
            assert r["attention_type"] == arch
            assert r["steps"] == steps and len(r["curve"]) == steps
            assert r["tokens"] == steps * 2 * r["seq_len"]  # quick: micro batch 2
            assert 2.0 < r["essay_valid"]["loss"] < math.log(r["config"]["vocab_size"]) + 1.5  # untrained
            ev, rec = r["essay_valid"], r["recall"]
            assert sum(b["tokens"] for b in ev["buckets"]) == ev["tokens"]
            assert sum(b["queries"] for b in rec["buckets"]) == rec["queries"] > 0
            assert 0.0 <= rec["accuracy"] <= 1.0 and r["train_seconds"] > 0
            window = r["config"]["sliding_window"]
            far = r["passkey"]["pairs"]["4-8x_window"]
            assert (far["low"], far["high"]) == (4 * window, min(8 * window, (r["seq_len"] - 5) // 2 * 2))
            assert 0.0 <= far["accuracy"] <= 1.0 and 0.0 <= r["passkey"]["essays"]["4-8x_window"]["accuracy"] <= 1.0
        s = saved["summary"][arch]
        losses = [r["essay_valid"]["loss"] for r in runs]
        assert s["essay_loss"]["n"] == 2 and math.isclose(s["essay_loss"]["mean"], sum(losses) / 2)
        assert f"{s['essay_loss']['mean']:.3f} ± {s['essay_loss']['std']:.3f}" in text  # table shows the JSON
    (row,) = saved["prefill"]["rows"]
    assert row["length"] == 64 and row["orthros_ttft_s"] > 0 and row["dense_ttft_s"] > 0
    assert f"{row['flop_limit']:.2f}x" in text  # the limit stands beside the measured ratio
    for name in ("loss_curves", "recall_vs_distance", "loss_by_position", "prefill"):
        png = tmp_path / "study" / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert results["summary"] == saved["summary"]
    beside = json.loads((tmp_path / "study" / "study.json").read_text())  # the copy committed with the report
    assert beside["runs"]["dense"][1]["recall"] == saved["runs"]["dense"][1]["recall"]


def test_the_report_goes_under_out_unless_report_is_given(tmp_path, monkeypatch) -> None:
    """`orthros-study --quick` from the repository root must not overwrite the committed docs/study.md."""
    from orthros_train.study import cli

    seen = {}
    monkeypatch.setattr(cli, "run_study", lambda opts: seen.setdefault("opts", opts))
    assert cli.main(["--quick", "--out", str(tmp_path / "s")]) == 0
    assert seen.pop("opts").report == tmp_path / "s" / "study.md"
    assert cli.main(["--quick", "--out", str(tmp_path / "s"), "--report", str(tmp_path / "r.md")]) == 0
    assert seen.pop("opts").report == tmp_path / "r.md"
    assert cli.main(["--quick", "--no-report", "--out", str(tmp_path / "s")]) == 0
    assert seen.pop("opts").report is None
    from orthros_train.study import StudyOptions

    assert StudyOptions().report is None  # the library writes no report unless asked


def test_skip_train_on_an_empty_folder_names_the_missing_runs(tmp_path, capsys) -> None:
    from orthros_train.study import cli

    (tmp_path / "empty").mkdir()
    assert cli.main(["--skip-train", "--out", str(tmp_path / "empty"), "--lrs", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert "--skip-train evaluates existing runs, but these runs are not trained" in err
    assert str(tmp_path / "empty" / "orthros") in err and "no metrics.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "empty" / "study.json").exists() and not (tmp_path / "empty" / "study.md").exists()
    assert cli.main(["--report-only", "--out", str(tmp_path / "empty")]) == 2
    assert "study.json, which does not exist" in capsys.readouterr().err
    assert cli.main(["--train-archs", "dense", "--out", str(tmp_path / "empty"), "--lrs", "1e-3"]) == 2
    assert "--train-archs leaves ['orthros', 'sliding'] to --out" in capsys.readouterr().err
    # A run the study would not evaluate is named as outside --archs, not as "not trained".
    args = ["--archs", "orthros", "--train-archs", "dense", "--out", str(tmp_path / "empty"), "--lrs", "1e-3"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--train-archs dense not in --archs orthros" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--jobs", "0"], ["--steps", "0"], ["--recall-documents", "0"],
                                  ["--prefill-repeats", "-1"], ["--train-threads", "-1"]])
def test_zero_and_negative_study_sizes_are_refused(tmp_path, capsys, args) -> None:
    from orthros_train.study import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--out", str(tmp_path / "s"), *args])
    assert exc.value.code == 2 and f"argument {args[0]}" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
