"""bench/train_step.py runs end to end on CPU (smoke; no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
