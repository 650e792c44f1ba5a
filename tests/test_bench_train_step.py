"""bench/train_step.py runs end to end on CPU (smoke; no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "train_step.py"


def test_train_step_bench_json_smoke():
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--json",
            "--lengths",
            "64",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--vocab",
            "64",
            "--window",
            "16",
            "--steps",
            "1",
            "--warmup",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == {"pretrain", "sft"}
    assert rows["pretrain"]["outputs"] == 64 and rows["sft"]["outputs"] == 6
    for r in rows.values():
        assert r["orthros_ms"] > 0 and r["dense_ms"] > 0 and r["ratio"] > 0
        assert r["peer_ms"] > 0 and r["peer_ratio"] > 0 and isinstance(r["weak_baseline"], bool)
    assert rows["pretrain"]["flop_ratio"] > 1 > rows["sft"]["flop_ratio"]  # two streams vs 6 outputs
    assert result["peer"].startswith("transformers") and result["time_basis"] == "process CPU time"


def test_peer_labels_are_the_layout_targets():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from train_step import make_layout, peer_batch
    finally:
        sys.path.remove(str(BENCH.parent))
    layout = make_layout("sft", 2, 10, 50, 0.3)
    ids, labels = peer_batch(layout, 2, 10)
    # HF shifts labels by one: labels[t] is the target of position t - 1.
    got = sorted((int(b), int(t - 1), int(labels[b, t])) for b, t in (labels != -100).nonzero())
    want = sorted((int(i) // 10, int(i) % 10, int(y)) for i, y in zip(layout.output_index, layout.labels))
    assert got == want and torch.equal(ids.flatten(), layout.input_ids)


@pytest.mark.slow  # inductor compiles the regions (~30 s on one core)
def test_fused_rows_compare_regional_compile_with_eager():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--fused", "--no-peer", "--lengths", "48", "--hidden", "32",
         "--layers", "1", "--heads", "2", "--vocab", "64", "--window", "16", "--steps", "1", "--warmup", "0",
         "--layouts", "pretrain"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)["fused"]
    assert row["seq_len"] == 48 and row["loss_diff"] <= 1e-5 and row["eager_ms"] > 0 and row["ratio"] > 0


def test_tokenwise_rows_compare_fused_with_eager_beside_the_byte_model():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--tokenwise", "--no-peer", "--lengths", "32", "--hidden", "32",
         "--layers", "1", "--heads", "2", "--vocab", "64", "--window", "8", "--steps", "1", "--warmup", "0",
         "--layouts", "pretrain", "sft", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["threads"] == 1 and result["machine"] and result["date"]
    rows = {r["layout"]: r for r in result["tokenwise"]}
    assert set(rows) == {"tokenwise pretrain", "tokenwise sft"}
    for r in rows.values():
        assert r["loss_diff"] <= 1e-5 and r["eager_ms"] > 0 and r["fused_ms"] > 0 and r["ratio"] > 0
        assert 0 < r["fused_layer_bytes"] < r["eager_layer_bytes"] and r["flop_ratio"] == 1.0
