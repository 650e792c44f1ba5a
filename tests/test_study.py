"""The replication study (issue #11): the synthetic recall data, and the reduced pipeline end to end."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from orthros_train.data.synthetic_recall import (
    RecallMix,
    make_recall_document,
    prepare_recall_dataset,
    token_ranges,
)


def test_recall_document_is_answerable_only_by_recall() -> None:
    ranges = token_ranges(256, 16, reserved=(0,))
    doc = make_recall_document(random.Random(3), 200, 12, ranges, min_distance=2)
    assert len(doc.input_ids) == 200 and 0 not in doc.input_ids
    assert len(doc.distances) == len(doc.targets) == len(doc.output_positions) == 12
    keys = [doc.input_ids[p] for p in doc.output_positions]
    assert len(set(keys)) == len(keys) and all(k in ranges.keys for k in keys)
    for p, v, d in zip(doc.output_positions, doc.targets, doc.distances):
        assert 2 <= d < 200
        assert doc.input_ids[p + 1] == v and v in ranges.values  # the query's value follows its key
        assert doc.input_ids[p - d] == doc.input_ids[p] and doc.input_ids[p - d + 1] == v  # the pair, d earlier
        # the key occurs exactly twice: the value is determined by the pair alone
        assert doc.input_ids.count(doc.input_ids[p]) == 2
    filler = [t for i, t in enumerate(doc.input_ids) if t not in ranges.keys and t not in ranges.values]
    assert len(filler) == 200 - 4 * 12


def test_recall_mix_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        RecallMix.from_dict({"fraction": 0.5, "paris": 3})
    with pytest.raises(ValueError, match="fraction"):
        RecallMix(fraction=1.0)
    with pytest.raises(ValueError, match="pairs <= keys"):
        RecallMix(pairs=10, keys=5)


def test_recall_dataset_documents_fill_one_sample_each(tmp_path) -> None:
    from orthros_train.data.indexed import open_indexed

    mix = RecallMix(documents=5, pairs=4, keys=8)
    prefix = prepare_recall_dataset(mix, vocab_size=100, eod_token_id=0, seq_len=64, cache_dir=str(tmp_path))
    assert prepare_recall_dataset(mix, 100, 0, 64, str(tmp_path)) == prefix  # cached: same settings, same file
    ds = open_indexed(prefix)
    assert len(ds) == 5
    for i in range(5):
        doc = np.asarray(ds[i])
        assert doc.size == 64 and doc[-1] == 0 and (doc[:-1] != 0).all()  # seq_len tokens, EOD last


@pytest.mark.slow
def test_study_pipeline_end_to_end(tmp_path) -> None:
    """Three tiny runs through the real CLI, evaluated and reported (~2 min on a quiet 2-core CPU)."""
    from orthros_train.study import ARCHS, StudyOptions, run_study

    steps = 12
    report = tmp_path / "study.md"
    results = run_study(StudyOptions(
        out=tmp_path / "runs", report=report, quick=True, steps=steps, recall_documents=4,
        valid_tokens=2048, prefill_lengths=[128, 256], command="pytest",
    ), log=lambda msg: None)

    saved = json.loads((tmp_path / "runs" / "study.json").read_text())
    assert set(saved["runs"]) == set(ARCHS)
    tokens = {r["tokens"] for r in saved["runs"].values()}
    assert len(tokens) == 1  # equal token budgets
    params = {r["parameters"] for r in saved["runs"].values()}
    assert len(params) == 1  # one shape
    for arch, r in saved["runs"].items():
        assert r["attention_type"] == arch
        assert r["steps"] == steps and len(r["curve"]) == steps
        assert r["tokens"] == steps * 2 * r["seq_len"]  # quick: micro batch 2
        assert math.isfinite(r["final_train_loss"]) and math.isfinite(r["essay_valid"]["loss"])
        # far from trained: near the uniform loss over the vocabulary, not below a sane floor
        assert 2.0 < r["essay_valid"]["loss"] < math.log(r["config"]["vocab_size"]) + 1.5
        ev = r["essay_valid"]
        assert sum(b["tokens"] for b in ev["buckets"]) == ev["tokens"]
        rec = r["recall"]
        assert sum(b["queries"] for b in rec["buckets"]) == rec["queries"] > 0
        assert 0.0 <= rec["accuracy"] <= 1.0
        assert r["train_seconds"] > 0
        assert f"{ev['loss']:.3f}" in report.read_text()  # the table shows the JSON's numbers
    rows = saved["prefill"]["rows"]
    assert [r["length"] for r in rows] == [128, 256]
    assert all(r["orthros_ttft_s"] > 0 and r["dense_ttft_s"] > 0 for r in rows)
    for name in ("loss_curves", "recall_vs_distance", "loss_by_position", "prefill"):
        png = tmp_path / "study" / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert results["runs"]["orthros"]["essay_valid"]["loss"] == saved["runs"]["orthros"]["essay_valid"]["loss"]
    beside = json.loads((tmp_path / "study" / "study.json").read_text())  # the copy committed with the report
    assert beside["runs"]["dense"]["recall"] == saved["runs"]["dense"]["recall"]
