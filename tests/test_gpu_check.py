"""bench/gpu_check.py on CPU: ``--dry-run`` runs every section at tiny sizes (the real trainer
through torchrun on gloo, the kernels on the interpreter) and the report survives failures and
signals."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from fixtures import REPO, cli_env

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402


def test_without_cuda_it_refuses_a_real_run(tmp_path):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])


def test_unknown_section_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--dry-run", "--sections", "kernels,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_the_plan_names_every_section_and_the_budget():
    text = gpu_check.plan_text(list(gpu_check.RUNNERS), dry=False)
    assert f"{gpu_check.TOTAL_BUDGET_S} s from process start" in text
    for name in gpu_check.RUNNERS:
        assert name in text
    # the sections fit the whole budget with room for imports and the interpreter-free JIT
    assert sum(gpu_check.BUDGET_S.values()) < gpu_check.TOTAL_BUDGET_S <= 7 * 60


def test_kernel_targets_hold_the_output_stream_to_the_faster_sdpa_backend():
    rows = gpu_check.kernel_plan((64,), gpu_check.DRY_KERNEL_SHAPE)
    for r in rows:
        if r["case"] == "sdpa flash causal":
            r.update(fwd_tflops=400.0, bwd_tflops=300.0)
        elif r["case"] == "sdpa cudnn causal":
            r.update(fwd_tflops=500.0, bwd_tflops=250.0)
        elif r["case"] == "orthros pretrain[output]":
            r.update(fwd_tflops=420.0, bwd_tflops=200.0, fwd_ms=1.0, bwd_ms=2.0)
        elif r["case"] == "orthros pretrain[output] atomic bwd":
            r.update(bwd_tflops=260.0)
    by = {t["target"]: t for t in gpu_check.kernel_targets(rows)}
    fwd = by["T=64 output stream fwd TFLOP/s / faster SDPA (flash, cuDNN)"]
    assert fwd["value"] == pytest.approx(420 / 500) and fwd["met"] is True
    bwd = by["T=64 output stream bwd TFLOP/s / faster SDPA (flash, cuDNN)"]
    assert bwd["value"] == pytest.approx(200 / 300) and bwd["met"] is False
    assert by["T=64 output stream bwd (atomic) TFLOP/s / faster SDPA"]["value"] == pytest.approx(260 / 300)


@pytest.mark.slow
def test_an_item_failing_alone_is_recorded_and_the_rest_runs(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(gpu_check, "sync_free_check", boom)
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--sections", "correctness"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sec = report["sections"]["correctness"]
    assert sec["status"] == "done" and report["complete"]
    assert [e["item"] for e in sec["errors"]] == ["sync-free layers (triton)", "sync-free layers (auto)"]
    assert all("injected failure" in e["error"] for e in sec["errors"])
    checks = [r["check"].split()[0] for r in sec["rows"]]
    assert checks == ["pretrain", "sft", "prefill", "packed", "decode"] and all(r["ok"] for r in sec["rows"])
    assert "injected failure" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_sigterm_mid_run_leaves_a_valid_report_and_no_trainer(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(tmp_path), "--dry-run"],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = tmp_path / "trainer_logs" / "reference.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "step" in log.read_text(errors="replace")):  # the trainer is mid-run
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert out.startswith("gpu_check plan")  # the plan is printed first
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["interrupted"].startswith("SIGTERM") and not report["complete"]
    assert report["sections"]["trainer"]["status"] == "running"
    assert "Interrupted: SIGTERM" in (tmp_path / "gpu_check.md").read_text()
    # the torchrun child went with it: nothing writes to its run directory any more
    metrics = tmp_path / "trainer_runs" / "reference" / "metrics.jsonl"
    before = metrics.read_text() if metrics.exists() else ""
    time.sleep(3)
    assert (metrics.read_text() if metrics.exists() else "") == before


@pytest.mark.slow
def test_dry_run_exercises_every_section_and_reports_after_each(tmp_path, monkeypatch):
    snapshots: list[dict] = []
    original = gpu_check.Run.write

    def write(self):
        original(self)
        snapshots.append(copy.deepcopy(self.report))

    monkeypatch.setattr(gpu_check.Run, "write", write)
    code = gpu_check.main(["--out", str(tmp_path), "--dry-run"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.RUNNERS) and report["complete"]
    errors = {name: s.get("errors") or s.get("error") for name, s in sections.items()}
    assert not any(errors.values()), errors
    assert code == 0
    # a report on disk after every section, with that section done and the next not yet started
    names = list(gpu_check.RUNNERS)
    for i, name in enumerate(names):
        done = [s for s in snapshots if s["sections"].get(name, {}).get("status") == "done"]
        assert done, name
        first = done[0]
        assert all(n not in first["sections"] for n in names[i + 1 :]), name
    # the real trainer: steps with saves, kill -9 + resume with bitwise-equal losses, SFT, RL,
    # the export generated from with transformers, the 1.3B plan with a timed tiny run
    rows = {r["item"].split()[0]: r for r in sections["trainer"]["rows"]}
    assert all(r["ok"] for r in sections["trainer"]["rows"]), sections["trainer"]["rows"]
    kill = rows["kill"]
    assert kill["killed_after_checkpoint"] >= 1 and kill["compared_steps"] and not kill["mismatches"]
    assert rows["export"]["new_tokens"] > 0
    big = rows["1.3B"]
    assert big["layers"] >= 1 and big["estimate_gib"] > 0 and big["records"] >= 1
    # correctness ran for real (interpreter, fp32): every layout, decode, the two layer checks
    checks = [r["check"].split()[0] for r in sections["correctness"]["rows"]]
    assert checks == ["pretrain", "sft", "prefill", "packed", "decode", "2", "2"]
    # kernels: the Orthros cases ran under the interpreter; nothing is reported as a timing
    kernels = sections["kernels"]["rows"]
    assert all(r.get("ran") for r in kernels if r["case"].startswith("orthros"))
    assert all(r["fwd_ms"] is None for r in kernels)
    assert "5/7" in sections["kernels"]["deterministic_bwd_ceiling"]
    assert all(r.get("ran") for r in sections["inference"]["rows"])
    # serving needs vLLM, which this environment lacks: it says so and takes no time
    # (tests/serve/test_gpu_check_serving.py runs it where vLLM is)
    assert sections["serving"]["skipped"] == ["vllm not installed"] and sections["serving"]["seconds"] < 5
    assert all(t["met"] is None for t in report["targets"])
    assert "dry run: nothing was measured" in (tmp_path / "gpu_check.md").read_text()


def test_bf16_model_keeps_fp32_rope_phases_at_position_131071():
    """``model.to(torch.bfloat16)`` (infer/loading.py, gpu_check) leaves RoPE's ``inv_freq`` fp32:
    the bf16 model's cos/sin at position 131071 are the fp32 model's, computed in fp32 then cast."""
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.model.layers import apply_rope

    cfg = OrthrosConfig(**{**gpu_check.shape_1p3b(), "hidden_size": 64, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 64,
                           "num_hidden_layers": 1, "rope_theta": 500000.0})  # fmt: skip
    fp32 = OrthrosForCausalLM(cfg)
    bf16 = OrthrosForCausalLM(cfg).to(torch.bfloat16)
    assert bf16.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32
    ref = fp32.layers[0].self_attn.rotary
    got = bf16.layers[0].self_attn.rotary
    assert got.inv_freq.dtype == torch.float32 and torch.equal(got.inv_freq, ref.inv_freq)
    pos = torch.tensor([131071])
    (c32, s32), (c16, s16) = ref.cos_sin(pos), got.cos_sin(pos)
    assert torch.equal(c16, c32) and torch.equal(s16, s32)
    x = torch.randn(1, 4, 16)
    want = apply_rope(x.to(torch.bfloat16), c32, s32)  # the angles in fp32, cast with the activations
    assert torch.equal(apply_rope(x.to(torch.bfloat16), c16, s16), want)
    # the cast back and a device move keep it fp32 too; the parameters did go to bf16
    assert bf16.float().layers[0].self_attn.rotary.inv_freq.dtype == torch.float32
    assert next(bf16.parameters()).dtype == torch.float32
    # what a bf16 inv_freq would have done: a phase error far above bf16's rounding of cos/sin
    bad = (pos.float() * ref.inv_freq.to(torch.bfloat16).float()) - pos.float() * ref.inv_freq
    assert bad.abs().max() > 0.1
