"""bench/gpu_check.py on CPU: its plan (value order, budgets that fit), the report it leaves in
``--out`` (at most 8 files, none deeper than 2 folders, also when an item fails or a signal
ends it), the preflight that fails when a package or corpus is missing, the kit's install by
``--kit``, and ``--rehearse`` walking every item through the same code paths at tiny sizes."""

from __future__ import annotations

import copy
import json
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from fixtures import REPO, cli_env

sys.path.insert(0, str(REPO / "bench"))
import gpu_check  # noqa: E402

NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def assert_out_comes_back(out: Path) -> list[str]:
    """What the GPU node returns: at most 8 files, no deeper than OUT/a/b/file, plain names."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3 and all(NAME.match(part) for part in rel.parts), rel
        assert f.stat().st_size <= 16 * 2**20, rel
    assert not [p for p in out.rglob("*") if p.is_dir() and not any(p.iterdir())]
    return sorted(str(f.relative_to(out)) for f in files)


def test_without_cuda_it_refuses_a_real_run(tmp_path):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path)])


def test_unknown_section_or_item_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--rehearse", "--sections", "kernels,bogus"])
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--rehearse", "--items", "preflight,nope"])
    assert "nope" in capsys.readouterr().err


def test_out_naming_a_file_or_a_read_only_place_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    target = tmp_path / "report.txt"
    target.write_text("mine")
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--out", str(target), "--rehearse"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"gpu_check: error: --out {target}: exists and is not a folder\n"
    assert target.read_text() == "mine"

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)  # what a read-only mount answers
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "ro"), "--rehearse"])
    want = f"gpu_check: error: --out {tmp_path / 'ro'}: cannot write there (Permission denied)\n"
    assert capsys.readouterr().err == want


def test_the_plan_runs_in_value_order_and_fits_the_node():
    names = [i.name for i in gpu_check.PLAN]
    assert names[:3] == ["preflight", "first_calls", "train_1p3b"]  # first calls checked, then 1.3B MFU first
    first = {sec: min(names.index(i.name) for i in gpu_check.PLAN if i.section == sec) for sec in gpu_check.SECTIONS}
    assert first["kernels"] < first["correctness"] < names.index("resume") < first["inference"]
    assert names.index("ttft_128k") < min(names.index(n) for n in ("export_generate", "sft_step", "rl_step", "serving"))
    assert {f"correct_{p}" for p in ("pretrain", "sft", "rl", "prefill", "packed", "decode")} <= set(names)
    assert {"sync_free_triton", "sync_free_auto"} <= set(names)
    # the node command ends inside 9 minutes: budget + alarm, and the caps of everything up to the
    # 16K TTFT fit the budget with the imports' and the kit install's time to spare
    assert gpu_check.TOTAL_BUDGET_S + gpu_check.ALARM_MARGIN_S <= 8 * 60
    caps = sum(i.budget_s for i in gpu_check.PLAN[: names.index("ttft_16k") + 1])
    assert caps <= gpu_check.TOTAL_BUDGET_S - 30
    text = gpu_check.plan_text(list(gpu_check.PLAN), dry=False)
    assert f"{gpu_check.TOTAL_BUDGET_S} s from the command's start" in text and all(n in text for n in names)


def test_an_item_starts_only_with_the_time_it_needs(tmp_path):
    run = gpu_check.Run(tmp_path / "out", dry=False, scratch=tmp_path / "scratch")
    resume = next(i for i in gpu_check.PLAN if i.name == "resume")
    cold = run.need_s(resume)
    run.state["kernels_warm"] = True  # the shared cache holds the tuned kernels
    warm = run.need_s(resume)
    assert warm < cold and warm == 3 * gpu_check.PRIOR_LAUNCH_S + resume.work_s
    run.costs["launch_s"] = 5.0  # the plan's launch stops before the training imports: not below the prior
    assert run.need_s(resume) == warm
    run.costs["launch_s"] = 20.0  # a slower machine's launch counts as measured
    assert run.need_s(resume) == 3 * 20.0 + resume.work_s
    run.deadline = time.monotonic() + 5
    run.report["items"] = [{"name": "resume", "section": "training", "status": "pending"}]
    gpu_check.run_item(run, resume)
    entry = run.report["items"][0]
    assert entry["status"] == "dropped" and "needs ~" in entry["reason"]
    assert run.report["dropped"] == [{"item": "resume", "reason": entry["reason"]}]
    assert "Dropped for time" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_kernel_targets_hold_the_output_stream_to_the_faster_sdpa_backend():
    rows = gpu_check.kernel_plan((64,), gpu_check.DRY_ATTN_SHAPE)
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


@pytest.mark.parametrize("hidden", ["needlehaystack", "chatterbot_corpus", "deepspeed"])
def test_a_missing_package_fails_the_preflight(tmp_path, monkeypatch, hidden):
    """What the kit or the image lacks fails the first item, by name (make test-gpu-node runs the
    preflight in a venv of exactly the image's packages plus the kit: CI fails, not the node)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--rehearse", "--items", "preflight",
                           "--scratch", str(tmp_path / "scratch")])  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    (entry,) = report["items"]
    assert entry["status"] == "failed" and report["complete"]
    assert any(hidden.split("_")[0] in p for p in entry["result"]["problems"]), entry
    assert_out_comes_back(tmp_path / "out")


def test_the_preflight_checks_the_kit_pins(tmp_path, monkeypatch):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "requirements.txt").write_text("# orthros-train GPU-node kit\nhjson==0.0.1  # needed by deepspeed\n")
    monkeypatch.setenv("GPU_CHECK_KIT", json.dumps({"kit": str(kit), "site": "", "wheels": 1, "seconds": 0.1,
                                                    "error": None}))  # fmt: skip
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    result = gpu_check.item_preflight(run, gpu_check.section_entry(run, "setup"))
    assert result["ok"] is False and any(p.startswith("kit package hjson==0.0.1 is at ") for p in result["problems"])


def _tiny_wheel(folder: Path) -> Path:
    path = folder / "gpucheckprobe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("gpucheckprobe/__init__.py", "VALUE = 7\n")
        zf.writestr("gpucheckprobe-1.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: gpucheckprobe\nVersion: 1.0\n")
        zf.writestr("gpucheckprobe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nTag: py3-none-any\n")
        zf.writestr("gpucheckprobe-1.0.dist-info/RECORD", "")
    return path


def test_kit_is_installed_the_node_way_and_the_check_starts_again(tmp_path):
    """``--kit``: pip --no-index --no-deps --target SCRATCH/site, then the check with it on PYTHONPATH."""
    kit = tmp_path / "kit"
    kit.mkdir()
    _tiny_wheel(kit)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--kit", str(kit), "--rehearse",
                           "--items", "preflight", "--out", str(out), "--scratch", str(scratch)],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["kit"]["wheels"] == 1 and report["kit"]["error"] is None
    assert "--no-index --no-deps --no-compile" in report["kit"]["command"]
    assert (scratch / "site" / "gpucheckprobe" / "__init__.py").exists()
    assert report["items"][0]["status"] == "ok"
    assert assert_out_comes_back(out) == ["gpu_check.json", "gpu_check.md", "gpu_check_logs.tar.gz"]


def test_a_kit_folder_without_wheels_stops_the_node_command_at_once(tmp_path):
    (tmp_path / "kit").mkdir()
    for kit in (tmp_path / "kit", tmp_path / "missing"):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--kit", str(kit), "--out",
                               str(tmp_path / "out")], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        what = "holds no wheels" if kit.exists() else "does not exist here"
        assert proc.returncode == 2 and what in proc.stderr and "make gpu-kit" in proc.stderr
        assert "git-ignored" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_case_that_raises_costs_only_its_row(tmp_path, monkeypatch):
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    rows = [{"case": "a"}, {"case": "b"}]

    def first_fails(row):
        if row["case"] == "a":
            raise RuntimeError("cuDNN: no kernel for this problem")
        row["ran"] = True
    assert all(gpu_check.case_isolated(run, r, lambda r=r: first_fails(r)) for r in rows)
    assert rows == [{"case": "a", "error": "RuntimeError: cuDNN: no kernel for this problem"},
                    {"case": "b", "ran": True}]  # fmt: skip
    monkeypatch.setattr(gpu_check, "cuda_fault", lambda run: "RuntimeError: CUDA error: an illegal memory access")
    assert not gpu_check.case_isolated(run, {}, lambda: first_fails({"case": "a"}))  # nothing more in this process


def test_after_a_sticky_cuda_fault_only_trainer_items_run(tmp_path, monkeypatch):
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    ran = []
    items = [gpu_check.Item("in_process_a", "correctness", 5, 0, 0, lambda r, s: ran.append("a"), "a"),
             gpu_check.Item("in_process_b", "correctness", 5, 0, 0, lambda r, s: ran.append("b"), "b"),
             gpu_check.Item("trainer", "training", 5, 1, 0, lambda r, s: ran.append("t"), "t")]  # fmt: skip
    run.report["items"] = [{"name": i.name, "section": i.section, "status": "pending"} for i in items]
    monkeypatch.setattr(gpu_check, "cuda_fault", lambda run: "RuntimeError: CUDA error: an illegal memory access")
    for item in items:
        gpu_check.run_item(run, item)
    status = {e["name"]: e["status"] for e in run.report["items"]}
    assert ran == ["a", "t"] and status == {"in_process_a": "ok", "in_process_b": "skipped", "trainer": "ok"}
    assert "illegal memory access" in run.report["items"][0]["cuda_fault"]
    assert "CUDA context broke in in_process_a" in run.report["items"][1]["reason"]


def test_the_timed_run_keeps_the_steps_it_logged_when_time_runs_out(tmp_path, monkeypatch):
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    records = {s: {"tokens_per_s": 100.0 * s, "mfu": 0.1 * s, "max_memory_gib": 1.0} for s in range(1, 6)}

    def out_of_time(*args, **kwargs):
        raise TimeoutError("the trainer ran out of the item's time")
    monkeypatch.setattr(gpu_check, "launch", lambda run, cmd, name: (None, tmp_path / "none.log"))
    monkeypatch.setattr(gpu_check, "wait_for", out_of_time)
    monkeypatch.setattr(gpu_check, "metrics", lambda run_dir: records)
    out = gpu_check.time_steps(run, [], want=8)
    assert out["status"] == "partial" and "after 5 of 8 steps" in out["partial"]
    assert out["records"] == 3 and out["tokens_per_s"] == 400.0
    records = {s: records[s] for s in (1, 2)}  # nothing past the warm-up steps: the time-out stands
    with pytest.raises(TimeoutError):
        gpu_check.time_steps(run, [], want=8)


def test_a_failing_item_still_leaves_a_report_that_comes_back(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(gpu_check, "sync_free_check", boom)
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--rehearse", "--items", "preflight,sync_free_triton",
                           "--scratch", str(tmp_path / "scratch")])  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [(e["name"], e["status"]) for e in report["items"]] == [("preflight", "ok"), ("sync_free_triton", "error")]
    assert "injected failure" in report["items"][1]["error"]
    assert "injected failure" in (tmp_path / "out" / "gpu_check.md").read_text()
    assert_out_comes_back(tmp_path / "out")


@pytest.mark.slow
def test_sigterm_mid_run_leaves_a_valid_report_and_no_trainer(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out), "--rehearse", "--items", "resume",
         "--scratch", str(scratch)],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = scratch / "logs" / "reference.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "step" in log.read_text(errors="replace")):  # the trainer is mid-run
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    assert stdout.startswith("gpu_check plan")  # the plan is printed first
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["interrupted"].startswith("SIGTERM") and not report["complete"]
    assert report["items"][0]["status"] == "interrupted"
    assert "Interrupted: SIGTERM" in (out / "gpu_check.md").read_text()
    assert "gpu_check_logs.tar.gz" in assert_out_comes_back(out)
    # the torchrun child went with it: nothing writes to its run directory any more
    metrics = scratch / "runs" / "reference" / "metrics.jsonl"
    before = metrics.read_text() if metrics.exists() else ""
    time.sleep(3)
    assert (metrics.read_text() if metrics.exists() else "") == before


@pytest.mark.slow
def test_rehearsal_walks_every_item_in_order_and_reports_after_each(tmp_path, monkeypatch):
    snapshots: list[dict] = []
    original = gpu_check.Run.write

    def write(self):
        original(self)
        snapshots.append(copy.deepcopy(self.report))

    monkeypatch.setattr(gpu_check.Run, "write", write)
    out = tmp_path / "out"
    code = gpu_check.main(["--out", str(out), "--rehearse", "--scratch", str(tmp_path / "scratch")])
    report = json.loads((out / "gpu_check.json").read_text())
    items = {e["name"]: e for e in report["items"]}
    assert list(items) == [i.name for i in gpu_check.PLAN] and report["complete"]
    bad = {n: e.get("error") or e.get("result") for n, e in items.items() if e["status"] not in ("ok", "skipped")}
    assert not bad, bad
    assert code == 0
    assert items["serving"]["status"] == "skipped" and items["serving"]["seconds"] < 5  # no vLLM here
    # a report on disk after every item, with the later ones still pending
    names = list(items)
    for i, name in enumerate(names):
        done = [s for s in snapshots if s["items"][i]["status"] not in ("pending", "running")]
        assert done and all(e["status"] == "pending" for e in done[0]["items"][i + 1 :]), name
    resume = items["resume"]["result"]
    assert resume["killed_after_checkpoint"] >= 1 and resume["compared_steps"] and not resume["mismatches"]
    # the route the trainer logged (CPU: SDPA) and no op left without a reproducible kernel
    assert resume["attention_route"].startswith("cpu: pretraining -> sdpa") and resume["nondeterministic_ops"] == []
    assert items["export_generate"]["result"]["new_tokens"] > 0
    big = items["train_1p3b"]["result"]
    assert big["layers"] >= 1 and big["estimate_gib"] > 0 and big["records"] >= 1
    assert big["attention_route"].startswith("cpu: pretraining -> sdpa")  # the route a user's run takes
    assert report["costs"]["launch_s"] > 0  # measured by the 1.3B item's plan launch
    rows = report["sections"]["kernels"]["rows"]
    assert [r["check"] for r in rows if "case" not in r] == ["fused_tokenwise on vs off"]  # its own row
    kernels = [r for r in rows if "case" in r]  # the attention kernels
    assert all(r.get("ran") for r in kernels if r["case"].startswith("orthros"))
    assert all(r["fwd_ms"] is None for r in kernels)
    inference = report["sections"]["inference"]["rows"]  # eager and static decode, batch 1 and 2, both models
    assert {(r["model"], r["prompt"]) for r in inference} == {(m, p) for m in ("orthros", "dense") for p in (16, 128)}
    assert all(r[f"graph_tokens_equal_b{b}"] == 1.0 and r[f"graph_decode_tokens_per_s_b{b}"] is None
               for r in inference for b in gpu_check.DECODE_BATCHES)  # fmt: skip
    assert all(t["met"] is None for t in report["targets"])
    assert "rehearsal: nothing was measured" in (out / "gpu_check.md").read_text()
    files = assert_out_comes_back(out)
    assert files == ["gpu_check.json", "gpu_check.md", "gpu_check_logs.tar.gz", "gpu_check_loss.png"]


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


def test_the_kernel_table_times_the_flashattention_route_beside_the_kernels(tmp_path, monkeypatch):
    """Every pretraining stream has a varlen row; the rehearsal runs it through the plain-torch
    stand-in (same numbers as the reference op), and a node without FlashAttention names why."""
    rows = gpu_check.kernel_plan((64,), gpu_check.DRY_ATTN_SHAPE)
    varlen = [r for r in rows if r["case"].startswith("varlen")]
    assert [r["case"] for r in varlen] == ["varlen pretrain[output]", "varlen pretrain[base]"]
    by = {r["case"]: r for r in rows}
    assert all(r["pairs"] == by[r["case"].replace("varlen", "orthros")]["pairs"] for r in varlen)
    shape, g = gpu_check.DRY_ATTN_SHAPE, torch.Generator().manual_seed(0)
    k, v = (torch.randn(64, shape["kv_heads"], shape["head_dim"], generator=g) for _ in range(2))
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    fn, q = gpu_check.varlen_case(run, varlen[1], shape, (k, v), g)
    from orthros_train.ops.reference import attention_reference

    qi, qw, cu = __import__("attention").make_queries("pretrain", 64, shape["window"], "base")
    torch.testing.assert_close(fn(), attention_reference(q, k, v, qi, qw, cu)[0])
    assert varlen[1]["implementation"] == "reference"
    import orthros_train.ops.route as route

    monkeypatch.setattr(route, "installed_varlen", lambda: None)
    run.dry = False
    assert gpu_check.varlen_case(run, varlen[0], shape, (k, v), g) == (None, None)
    assert "no FlashAttention varlen" in varlen[0]["error"]


def test_a_trainer_log_s_route_and_nondeterministic_ops_are_read(tmp_path):
    log = tmp_path / "t.log"
    log.write_text(
        "[rank0] attention route on cuda: pretraining -> triton; prefill -> triton\n"
        "UserWarning: scatter_add_cuda_kernel does not have a deterministic implementation, but you set ...\n"
        "UserWarning: Flash Attention defaults to a non-deterministic algorithm. To explicitly enable ...\n"
    )
    got = gpu_check.route_and_determinism(log)
    assert got == {"attention_route": "cuda: pretraining -> triton; prefill -> triton",
                   "nondeterministic_ops": ["Flash Attention", "scatter_add_cuda_kernel"]}  # fmt: skip
    assert gpu_check.route_and_determinism(tmp_path / "missing.log") == {"attention_route": None,
                                                                       "nondeterministic_ops": []}  # fmt: skip


def test_out_holding_a_gpu_run_s_report_is_refused_and_a_rehearsal_s_replaced(tmp_path, capsys):
    """A rehearsal (or another run) must not silently replace a node's report in --out."""
    out = tmp_path / "node_out"
    out.mkdir()
    node = json.dumps({"dry_run": False, "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-06 09:00 UTC"})
    (out / "gpu_check.json").write_text(node)
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--out", str(out), "--rehearse", "--items", "preflight"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu_check: error: --out {out}: holds a GPU run's report (NVIDIA H100 80GB HBM3, ")
    assert "give --out a new or empty folder" in err and len(err.strip().splitlines()) == 1
    assert (out / "gpu_check.json").read_text() == node
    (out / "gpu_check.json").write_text("{not json")  # unreadable: kept too
    assert "not a readable report" in gpu_check.check_out(str(out))
    (out / "gpu_check.json").write_text(json.dumps({"dry_run": True}))  # a rehearsal's: replaced
    assert gpu_check.check_out(str(out)) is None


def test_scratch_naming_a_file_is_refused_in_one_line(tmp_path, capsys):
    target = tmp_path / "scratch.txt"
    target.write_text("mine")
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--out", str(tmp_path / "out"), "--rehearse", "--scratch", str(target)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(f"gpu_check: error: --scratch {target}: exists and is not a folder")
    kit = tmp_path / "kit"
    kit.mkdir()
    _tiny_wheel(kit)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--kit", str(kit), "--rehearse",
                           "--out", str(tmp_path / "out"), "--scratch", str(target)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--scratch {target}: exists and is not a folder" in proc.stderr and target.read_text() == "mine"


def test_the_mfu_item_takes_the_recipe_s_per_gpu_step():
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "pretrain_1p3b.yaml").read_text())["trainer"]
    node = yaml.safe_load((REPO / "recipes" / "parallel" / "node8_dp8_zero1.yaml").read_text())
    dp = node.get("data_parallel") or node["world_size"]
    assert recipe["micro_batch_size"] == gpu_check.RECIPE_MICRO_BATCH
    assert recipe["global_batch_size"] // (recipe["micro_batch_size"] * dp) == gpu_check.RECIPE_ACCUMULATION


def test_an_mfu_miss_is_explained_in_one_line():
    """The part of the step furthest over its FLOP share at the goal comes first."""
    row = {"mfu": 0.25, "tokens_per_s": 131072 / 4.0, "model_tflops_per_s": 250.0, "tokens_per_step": 131072,
           "layers": 24, "optimizer_ms": 100.0, "attention_route": "cuda: pretraining -> triton; prefill -> triton"}
    kernels = [{"T": 4096, "case": f"orthros pretrain[{s}]", "fwd_ms": f, "bwd_ms": 2 * f, "fwd_gflop": g,
                "bwd_gflop": 2.5 * g} for s, f, g in (("output", 0.5, 275.0), ("base", 0.1, 17.0))]  # fmt: skip
    line = gpu_check.mfu_miss(row, kernels, 0.5)
    assert line.startswith("MFU 0.25 < 0.50: a step takes 4.000 s, 2.000 s at 50%; ") and "\n" not in line
    # attention: 24 layers x 32 sequences x 1.8 ms = 1.382 s against a FLOP share of 2 s x 0.97 / 1000
    attention = 24 * 32 * 1.8e-3
    assert f"attention (4K kernel rows) {attention:.3f} s" in line
    first = line.split("; ")[1]
    assert first.startswith("GEMMs + token-wise work")  # 4 - 0.1 - 1.382 s, the furthest over its share
    assert gpu_check.mfu_miss({**row, "mfu": None}, kernels, 0.5) is None
    assert gpu_check.pretraining_on_triton("cpu: every layout -> triton (model.attention_backend)")
    assert not gpu_check.pretraining_on_triton("cuda: pretraining -> flash_attn_3; prefill -> triton")
    without = gpu_check.mfu_miss(row, [], 0.5)  # kernel rows not timed yet: attention stays in the rest
    assert "GEMMs + token-wise work + attention" in without and "optimizer (timed apart) 0.100 s" in without


def test_first_calls_fall_back_with_the_reason(tmp_path, monkeypatch):
    """A forced varlen failure (the check's test hook) is recorded with its fallback; the kernels
    item then leaves the varlen rows untimed with the reason instead of failing them."""
    monkeypatch.setenv(gpu_check.FORCE_FAIL_ENV, "varlen")
    monkeypatch.setattr(gpu_check, "start_graph_probe", lambda run: None)  # the child: the slow test's
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    result = gpu_check.item_first_calls(run, gpu_check.section_entry(run, "setup"))
    assert result["status"] == "fallback" and result["calls"] == {"varlen": "fallback", "cudnn": "ok"}
    assert "forced by GPU_CHECK_FORCE_FAIL=varlen" in run.state["fallback"]["varlen"]
    assert run.report["fallback"] is run.state["fallback"]
    monkeypatch.delenv(gpu_check.FORCE_FAIL_ENV)
    run.state["fallback"].clear()
    result = gpu_check.item_first_calls(run, gpu_check.section_entry(run, "setup"))  # the stand-in vs reference
    assert result["calls"] == {"varlen": "ok", "cudnn": "ok"} and "status" not in result


def test_a_trainer_start_up_failure_skips_the_later_trainer_items(tmp_path):
    run = gpu_check.Run(tmp_path / "out", dry=True, scratch=tmp_path / "scratch")
    log = tmp_path / "plan_1p3b.log"
    log.write_text("ModuleNotFoundError: No module named 'megatron'\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(RuntimeError, match="megatron"):
        gpu_check.wait_for(run, proc, log)
    assert run.state["launch_broken"].startswith("plan_1p3b (")
    ran = []
    items = [gpu_check.Item("trainer", "training", 5, 1, 0, lambda r, s: ran.append("t"), "t"),
             gpu_check.Item("in_process", "correctness", 5, 0, 0, lambda r, s: ran.append("p"), "p")]  # fmt: skip
    run.report["items"] = [{"name": i.name, "section": i.section, "status": "pending"} for i in items]
    for item in items:
        gpu_check.run_item(run, item)
    assert ran == ["p"] and "a trainer failed to start in plan_1p3b" in run.report["items"][0]["reason"]


@pytest.mark.slow
def test_rehearsal_with_failed_first_calls_falls_back_and_still_reports(tmp_path, monkeypatch):
    """GPU_CHECK_FORCE_FAIL=varlen,graph: the MFU item runs on the Triton kernels and reports, the
    decode rows are eager only, each saying why; the same 8-file, 2-level --out."""
    monkeypatch.setenv(gpu_check.FORCE_FAIL_ENV, "varlen,graph")
    out = tmp_path / "out"
    code = gpu_check.main(["--out", str(out), "--rehearse", "--items", "first_calls,train_1p3b,ttft_16k",
                           "--scratch", str(tmp_path / "scratch")])  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    items = {e["name"]: e for e in report["items"]}
    assert code == 0 and items["first_calls"]["status"] == "fallback", items
    big = items["train_1p3b"]["result"]
    assert items["train_1p3b"]["status"] == "ok" and big["records"] >= 1
    assert big["fallback"].startswith("varlen failed its first call")
    assert gpu_check.pretraining_on_triton(big["attention_route"]), big["attention_route"]
    assert big["accumulation"] == gpu_check.RECIPE_ACCUMULATION and big["optimizer_parameters"] > 0
    rows = report["sections"]["inference"]["rows"]
    assert rows and all("capture child failed" in r["graph_skipped"] for r in rows)
    assert all("graph_decode_tokens_per_s_b1" not in r for r in rows)
    assert set(report["fallback"]) == {"varlen", "graph"}
    assert "Fallbacks (a first call failed)" in (out / "gpu_check.md").read_text()
    assert "logs/graph_probe.log" in tarfile.open(out / "gpu_check_logs.tar.gz").getnames()
    assert_out_comes_back(out)


@pytest.mark.parametrize("argv, named", [
    (["--out", ""], "--out '' is empty: give a folder for the report"),
    (["--out", "OUT", "--scratch", "  "],
     "--scratch '  ' is empty: give a folder, or leave --scratch out for a new one"),
])  # fmt: skip
def test_an_empty_out_or_scratch_is_refused_instead_of_filling_the_current_folder(tmp_path, monkeypatch, capsys,
                                                                                   argv, named):
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([*argv, "--rehearse", "--items", "preflight"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"gpu_check: error: {named}\n"
    assert [p.name for p in tmp_path.iterdir()] in ([], ["out"])  # no report, no folder named '  '
