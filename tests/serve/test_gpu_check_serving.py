"""bench/gpu_check.py's serving section, dry run on CPU where vLLM is: both engines start, decode and
prefill, and the Orthros engine's greedy tokens equal the project's generate (nothing is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def test_serving_section_dry_run(tmp_path):
    run = gpu_check.Run(tmp_path, dry=True)
    run.deadline = float("inf")
    gpu_check.run_serving(run)
    sec = run.report["sections"]["serving"]
    assert sec["status"] == "done" and not sec["errors"], sec
    rows = {r["model"]: r for r in sec["rows"]}
    assert set(rows) == {"orthros", "llama"}
    assert rows["orthros"]["greedy_equals_generate"] == 1.0
    assert all(v is None for r in rows.values() for k, v in r.items() if k.startswith(("decode_tok_s", "ttft_ms")))
    assert "Serving in vLLM" in (tmp_path / "gpu_check.md").read_text()
