"""bench/gpu_check.py on CPU: the dry run checks the plan and the report format (nothing timed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402


def test_dry_run_writes_the_report(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert report["dry_run"] and "dry run: nothing was measured" in md
    sections = report["sections"]
    assert set(sections) == {"correctness", "kernels", "train", "inference"}
    assert not any(s.get("error") for s in sections.values())
    # correctness ran for real (interpreter, fp32), every layout and decode
    checks = [r["check"] for r in sections["correctness"]["rows"]]
    assert [c.split()[0] for c in checks] == ["pretrain", "sft", "prefill", "packed", "decode"]
    assert all(r["ok"] for r in sections["correctness"]["rows"])
    # the other sections are planned: every case listed with its FLOPs, nothing measured
    kernels = sections["kernels"]["rows"]
    assert len(kernels) == len(gpu_check.KERNEL_T) * (1 + len(gpu_check.STREAMS))
    assert all(r["fwd_gflop"] > 0 and r["fwd_ms"] is None for r in kernels)
    train = sections["train"]
    assert 1 <= train["layers"] <= 24 and train["estimate_gib"]["total"] <= 0.85 * 80
    assert {r["model"] for r in train["rows"]} == {"orthros", "dense"}
    assert all(r["flops_per_step"] > 0 and r["mfu"] is None for r in train["rows"])
    assert len(sections["inference"]["rows"]) == 2 * len(gpu_check.PROMPTS)
    # every target is listed next to its goal, unmet-or-met left open (None) in a dry run
    goals = {t["goal"] for t in report["targets"]}
    assert goals == {">= 0.8", "<= 1.3", ">= 0.5"}
    assert all(t["met"] is None for t in report["targets"])
    assert md.count("\n| T=") == 4 * len(gpu_check.KERNEL_T)


def test_without_cuda_it_refuses_a_real_run(tmp_path):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])


def test_unknown_section_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--dry-run", "--sections", "kernels,bogus"])
    assert "bogus" in capsys.readouterr().err
