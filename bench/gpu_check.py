"""One-shot GPU check: the first run on an H100/H200 turns into a table of every figure next to
its target, written as it goes.

    python bench/gpu_check.py --out gpu_check/            # one GPU, the whole run < 7 minutes
    python bench/gpu_check.py --out /tmp/gc --dry-run     # CPU: every section at tiny sizes

It prints its plan first, then writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``
after every section and item, and again on SIGTERM and on its own SIGALRM backstop (a kill at a
time limit or an OOM in a child leaves the report of everything finished so far). Every item has
its own try: a failure is recorded next to the item and the rest runs. The wall-clock budget
starts at process start (imports, JIT builds and autotuning count) and is checked inside the
sections; each section imports what it needs, so a missing package costs that section only.

Sections:

1. ``trainer``: the real trainer, ``orthros-train`` through ``torchrun --nproc-per-node 1``
   (NCCL, bf16, Triton attention; recipes/gpu_check.yaml): a run with saves; a second run killed
   with SIGKILL after its first save and resumed, whose losses must equal the first run's bit for
   bit; one SFT step and one RL step (sampling on the GPU) from its export; a transformers
   ``generate`` of the export. Then the 1.3B shape with as many layers as fit, timed through the
   trainer (tokens/s, MFU from the model's own FLOPs, peak memory next to the trainer's dry-run
   estimate for that same layout and precision).
2. ``correctness``: bf16 forward / backward / decode of the Triton kernels against the fp32
   reference op, and two layers under ``torch.cuda.set_sync_debug_mode("error")``.
3. ``kernels``: TFLOP/s of the output stream, base stream, sft and prefill layouts, forward and
   backward (deterministic and atomic), T = 4K..32K, next to SDPA's flash and cuDNN backends;
   the autotuner's choices recorded per sequence length.
4. ``inference``: prefill time to first token and decode tokens/s, Orthros vs dense.
5. ``serving``: the Orthros export and its dense Llama twin in vLLM as users run them (compiled,
   CUDA graphs on): decode tokens/s of a batch at a 1K context, TTFT at 16K and 128K, and the
   Orthros engine's greedy tokens against the project's ``generate``. It runs in the time the
   other sections leave (``--sections serving`` gives it the whole budget) and needs vLLM, which
   the locked-down GPU image lacks: there it records that and takes no time.

``--dry-run`` runs every section on CPU at tiny sizes (the trainer through torchrun on gloo, the
kernels on the Triton interpreter) and times nothing that means anything.
"""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the budget starts here: imports count

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

DRY = "--dry-run" in sys.argv
import torch  # noqa: E402

if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

TARGETS = {
    "output_vs_sdpa": 0.80,  # output-stream TFLOP/s / the faster SDPA backend's TFLOP/s, >=
    "base_time_ratio": 1.30,  # base-stream time / (its pairs at the output stream's rate), <=
    "mfu": 0.50,  # 1.3B-shape training MFU, >=
}
TOTAL_BUDGET_S = 7 * 60  # the whole run, from process start
ALARM_MARGIN_S = 10  # SIGALRM after the budget plus this: the backstop when a unit overruns
# Seconds per section (capped by what the whole run has left).
# ``serving`` (last) has no share of its own: it runs in the time the others leave, all of the
# budget with ``--sections serving``, and takes none where vLLM is not installed.
BUDGET_S = {"trainer": 170, "correctness": 40, "kernels": 130, "inference": 60, "serving": 0}


def shape_1p3b() -> dict:
    """The pretrain_1p3b recipe's model (its one statement, the recipe's model group), for any
    length up to 128K (imported here, not at the top: the report outlives a failed import)."""
    from orthros_train.infer.loading import PRESETS

    return {**PRESETS["1p3b"], "max_position_embeddings": 131072}


# bf16 tolerances against the fp32 reference on unit-variance inputs: the kernels' error is the
# bf16 rounding of their inputs/outputs (about 2**-8 relative), scaled by each tensor's size.
TOL = {"out": 2e-2, "lse": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
# FlashAttention-2's backward does 5 matrix products per tile (S, dP, dV, dK, dQ); ours, without
# atomics, recomputes S and dP in the dq kernel: 7. At equal tensor-core efficiency it reaches
# 5/7 of FA2's backward TFLOP/s counted on 5 products; the atomic variant does 5.
DETERMINISTIC_BWD_CEILING = 5 / 7


class Run:
    """The report and where it goes; written atomically after every item, section and signal."""

    def __init__(self, out_dir: Path, dry: bool) -> None:
        self.out_dir, self.dry = out_dir, dry
        self.deadline = _T0 + TOTAL_BUDGET_S
        self.child: subprocess.Popen | None = None  # a trainer process to kill with us
        self.report: dict = {
            "device": f"CPU ({platform.machine()}), dry run" if dry else torch.cuda.get_device_name(0),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "dry_run": dry,
            "budget_s": TOTAL_BUDGET_S,
            "section_budget_s": BUDGET_S,
            "targets_goal": TARGETS,
            "complete": False,
            "sections": {},
            "targets": [],
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        r = self.report
        r["elapsed_s"] = round(time.monotonic() - _T0, 1)
        try:
            r["targets"] = all_targets(r)
        except Exception as exc:  # noqa: BLE001 - a target that cannot be computed is reported
            r["targets_error"] = f"{type(exc).__name__}: {exc}"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_check.json", json.dumps(r, indent=1, default=str) + "\n"),
                           ("gpu_check.md", markdown(r))):  # fmt: skip
            tmp = self.out_dir / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out_dir / name)  # a reader never sees half a report

    def on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        self.report["interrupted"] = f"{name} after {time.monotonic() - _T0:.0f}s" + (
            " (the time budget's backstop)" if signum == signal.SIGALRM else ""
        )
        kill_child(self.child)
        try:
            self.write()
        finally:
            os._exit(124 if signum == signal.SIGALRM else 128 + signum)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing package is a fact of the report
        return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: torchrun puts its workers in sessions of their
    own, so killing torchrun's process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_child(proc: subprocess.Popen | None) -> None:
    """SIGKILL ``proc`` and everything it started (a kill -9 of a whole one-process run)."""
    if proc is None or proc.poll() is not None:
        return
    for pid in [*_descendants(proc.pid), proc.pid]:  # gathered first: orphans are re-parented
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class Guard:
    """Time budget of one section, capped by the whole run's: ``ok()`` is false once spent."""

    def __init__(self, run: Run, seconds: float) -> None:
        self.run = run
        # a dry run checks every item, however slow the interpreter on a shared CPU is
        self.deadline = math.inf if run.dry else min(time.monotonic() + seconds, run.deadline)
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def ok(self, what: str, need_s: float = 0.0) -> bool:
        if self.left() > need_s:
            return True
        self.skipped.append(what)
        return False


@contextmanager
def section(run: Run, name: str):
    t0 = time.monotonic()
    entry = run.report["sections"].setdefault(name, {"rows": [], "errors": []})
    entry["status"] = "running"
    run.write()
    try:
        yield entry
        entry["status"] = "done"
    except Exception as exc:  # noqa: BLE001 - a failed section is a result; the others still run
        entry["status"] = "failed"
        entry["error"] = f"{type(exc).__name__}: {exc}"[:800]
        entry["traceback"] = traceback.format_exc()[-2000:]
    finally:
        entry["seconds"] = round(time.monotonic() - t0, 1)
        run.write()


@contextmanager
def attempt(run: Run, sec: dict, what: str):
    """One item: its failure is recorded under the section's ``errors`` and the section goes on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one item's failure is a result
        sec.setdefault("errors", []).append({"item": what, "error": f"{type(exc).__name__}: {exc}"[:800]})
    finally:
        run.write()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 1. the real trainer
# ---------------------------------------------------------------------------------------------

# On CPU (dry run): gloo, fp32 (the interpreter's bf16 is not the GPU's), tiny sizes.
DRY_DEVICE = ["trainer.device=cpu", "trainer.precision=fp32", "parallel.backend=gloo"]
GPU_DEVICE = ["trainer.device=cuda", "trainer.precision=bf16", "parallel.backend=nccl"]
COMMON = ["trainer.wandb.enabled=false", "trainer.progress=false", "trainer.eval_every=0",
          "trainer.sample_prompt=null", "++model.attention_backend=triton", "trainer.gpu=null",
          "trainer.gpu_memory_gib=null"]  # fmt: skip
DRY_TINY = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.intermediate_size=128",
            "trainer.seq_len=64", "trainer.micro_batch_size=2", "trainer.eval_batches=1"]  # fmt: skip


def trainer_cmd(recipe: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
            "-m", "orthros_train.train.cli", "--config-name", recipe, *overrides]  # fmt: skip


def launch(run: Run, cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if run.dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # the interpreter on CUDA tensors copies them to the host
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    handle.close()
    run.child = proc
    return proc


def wait_for(run: Run, proc: subprocess.Popen, guard: Guard, log: Path, until=None, poll_s: float = 0.05) -> int:
    """Wait for ``proc`` (or for ``until()`` to hold, then kill it with SIGKILL) within the guard's
    time; a process still running at the deadline is killed and named."""
    while proc.poll() is None:
        if until is not None and until():
            kill_child(proc)
            return -9
        if guard.left() <= 0:
            kill_child(proc)
            raise TimeoutError(f"the trainer ran out of the section's time (log: {log})")
        time.sleep(poll_s)
    run.child = None
    if proc.returncode != 0:
        raise RuntimeError(f"trainer exited with {proc.returncode} (log {log}): {log_problem(log)}")
    return 0


def log_problem(log: Path) -> str:
    """The trainer's own error lines from its log, without torchrun's traceback around them."""
    lines = [
        line for line in log.read_text(errors="replace").splitlines()
        if line.strip() and not line.startswith((" ", "Traceback", "[", "E1", "W1", "I1"))
        and "torch/distributed" not in line and "ChildFailedError" not in line and "====" not in line
    ]  # fmt: skip
    # the exception line first (``KeyError: ...``), then the last lines (hydra's, torchrun's summary)
    raised = [line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception", "Interrupt"))]
    return " | ".join(dict.fromkeys(raised[-2:] + lines[-4:]))[-1200:]


def metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a resumed run's record of a step replaces the killed run's."""
    out: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # the line a SIGKILL cut short
                continue
            if "step" in rec and "loss" in rec:
                out[int(rec["step"])] = rec
    return out


def latest_step(run_dir: Path) -> int | None:
    try:
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
        return int(json.loads((run_dir / "checkpoints" / name / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


def run_trainer_section(run: Run) -> None:
    with section(run, "trainer") as sec:
        guard = Guard(run, BUDGET_S["trainer"])
        dry = run.dry
        work = run.out_dir / "trainer_runs"
        logs = run.out_dir / "trainer_logs"
        device = DRY_DEVICE if dry else GPU_DEVICE
        tiny = DRY_TINY if dry else []
        steps, every = (4, 2) if dry else (12, 3)
        base = [*device, *COMMON, *tiny, "trainer.log_every=1", f"trainer.save_every={every}"]
        sec["recipe"] = "recipes/gpu_check.yaml"
        sec["launcher"] = " ".join(trainer_cmd("gpu_check", [])[2:7])
        rows = sec["rows"]
        ref_dir, killed_dir = work / "reference", work / "killed"

        def row(name: str) -> dict:
            r = {"item": name, "ok": None, "seconds": None}
            rows.append(r)
            return r

        r = row(f"pretrain {steps} steps with saves")
        with attempt(run, sec, r["item"]):
            t0 = time.monotonic()
            proc = launch(
                run,
                trainer_cmd("gpu_check", [*base, f"trainer.max_steps={steps}", f"trainer.run_dir={ref_dir}"]),
                logs / "reference.log",
            )
            wait_for(run, proc, guard, logs / "reference.log")
            ref = metrics(ref_dir)
            r.update(
                seconds=round(time.monotonic() - t0, 1),
                steps=sorted(ref),
                final_loss=ref[max(ref)]["loss"],
                checkpoint=latest_step(ref_dir),
                ok=sorted(ref) == list(range(1, steps + 1)),
            )
            # the first launch pays for imports, NCCL init and Triton's compile + autotune: its seconds
            # against the resumed run's show that cost
        r = row("kill -9 after the first save, resume: bitwise-equal losses")
        with attempt(run, sec, r["item"]):
            t0 = time.monotonic()
            # a far max_steps, so the kill lands mid-run; the lr is constant, so steps are comparable
            proc = launch(
                run,
                trainer_cmd("gpu_check", [*base, "trainer.max_steps=100000", f"trainer.run_dir={killed_dir}"]),
                logs / "killed.log",
            )
            wait_for(run, proc, guard, logs / "killed.log", until=lambda: latest_step(killed_dir) is not None)
            saved = latest_step(killed_dir)
            r["killed_after_checkpoint"] = saved
            r["steps_logged_before_kill"] = max(metrics(killed_dir), default=0)
            if saved is None or saved >= steps:
                raise RuntimeError(f"the kill came too late: checkpoint {saved} is not before step {steps}")
            proc = launch(
                run,
                trainer_cmd(
                    "gpu_check",
                    [
                        *base,
                        f"trainer.max_steps={steps}",
                        f"trainer.run_dir={killed_dir}",
                        "trainer.resume=auto",
                        "trainer.resume_changes=allow",
                    ],
                ),
                logs / "resumed.log",
            )
            wait_for(run, proc, guard, logs / "resumed.log")
            ref, got = metrics(ref_dir), metrics(killed_dir)
            compared = list(range(saved + 1, steps + 1))
            diffs = {s: (ref.get(s, {}).get("loss"), got.get(s, {}).get("loss")) for s in compared}
            r.update(
                seconds=round(time.monotonic() - t0, 1),
                compared_steps=compared,
                mismatches={s: d for s, d in diffs.items() if d[0] is None or repr(d[0]) != repr(d[1])},
            )
            r["ok"] = not r["mismatches"]
        export = ref_dir / "checkpoints" / "final"
        r = row("export + transformers generate")
        with attempt(run, sec, r["item"]):
            r.update(generate_export(export, torch.device("cpu" if dry else "cuda")))
            r["ok"] = r["new_tokens"] > 0
        for kind, recipe, extra in (
            ("one SFT step from the export", "sft_tiny_cpu", [f"model.init_from={export}", *tiny]),
            ("one RL step, sampling on the trainer's device", "rl_tiny_cpu", []),
        ):
            r = row(kind)
            with attempt(run, sec, kind):
                if not guard.ok(kind, 5):
                    r["ok"] = None
                    continue
                t0 = time.monotonic()
                run_dir = work / recipe
                log = logs / f"{recipe}.log"
                proc = launch(
                    run,
                    trainer_cmd(
                        recipe,
                        [
                            *device,
                            *COMMON,
                            *extra,
                            "trainer.max_steps=1",
                            "trainer.log_every=1",
                            f"trainer.run_dir={run_dir}",
                        ],
                    ),
                    log,
                )
                wait_for(run, proc, guard, log)
                got = metrics(run_dir)
                r.update(seconds=round(time.monotonic() - t0, 1), loss=got.get(1, {}).get("loss"))
                r["ok"] = 1 in got and math.isfinite(got[1]["loss"])
        r = row("1.3B shape through the trainer")
        with attempt(run, sec, r["item"]):
            r.update(time_1p3b(run, guard, work, logs))
            r["ok"] = bool(r.get("records"))
        sec["skipped"] = guard.skipped


def generate_export(path: Path, dev: torch.device) -> dict:
    """The trainer's export as a user loads it in transformers: converted by orthros-convert's
    library call into a remote-code directory, loaded with the auto classes, ``generate``d from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros_train.convert.to_hf import convert_to_hf

    hf = path.parent / "final_hf"
    convert_to_hf(path, hf, overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=False)  # the tokenizer runs no custom code
    ids = tok("The most important thing about startups is", return_tensors="pt").input_ids.to(dev)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return {"model_class": type(model).__name__, "new_tokens": int(out.shape[1] - ids.shape[1]),
            "text": tok.decode(out[0, ids.shape[1]:])}  # fmt: skip


def layers_that_fit(device_bytes: int, seq_len: int = 4096) -> tuple[int, dict]:
    """Most layers (<= 24) whose modelled peak (one process, bf16 with fp32 masters, as the
    trainer runs it) stays under 85% of the device."""
    from orthros_train.model import OrthrosConfig
    from orthros_train.parallel.setup import ParallelConfig
    from orthros_train.train.memory import estimate_memory

    best, est = 1, None
    for n in range(1, 25):
        cfg = OrthrosConfig(**{**shape_1p3b(), "num_hidden_layers": n})
        e = estimate_memory(cfg, ParallelConfig(data_parallel=1, world_size=1), seq_len, 1, "bf16", "flash", 1.0)
        if e.total > 0.85 * device_bytes:
            break
        best, est = n, e
    return best, (est.as_gib() if est else {})


def time_1p3b(run: Run, guard: Guard, work: Path, logs: Path) -> dict:
    """The trainer's own plan (trainer.dry_run) for the layout, then steps timed by the trainer
    itself (metrics.jsonl: tokens/s, MFU from the model's FLOPs, peak memory), killed once enough
    steps are logged (its final save of a 1.3B-shape model is not what is measured)."""
    dry = run.dry
    gib = 2**30
    device_bytes = 80 * gib if dry else torch.cuda.get_device_properties(0).total_memory
    layers, _ = layers_that_fit(device_bytes)
    layout = [f"model.num_hidden_layers={layers}", "trainer.seq_len=4096", "trainer.micro_batch_size=1"]
    if dry:  # the same path at a size the interpreter can run; the plan is for the real layers
        timed_shape, device = [*DRY_TINY, "model.num_attention_heads=4", "model.num_key_value_heads=4"], DRY_DEVICE
    else:
        timed_shape, device = layout, GPU_DEVICE
    common = [*device, *COMMON, "parallel=single", "trainer.global_batch_size=null", "trainer.log_every=1",
              "trainer.save_every=0", "trainer.resume=none", "trainer.overwrite=true"]  # fmt: skip
    out: dict = {"layers": layers, "seq_len": 4096, "device_gib": round(device_bytes / gib, 1)}
    plan_dir = work / "plan_1p3b"
    plan_cmd = trainer_cmd("pretrain_1p3b", [*common, *layout, "trainer.dry_run=true", f"trainer.run_dir={plan_dir}"])
    log = logs / "plan_1p3b.log"
    proc = launch(run, plan_cmd, log)
    wait_for(run, proc, guard, log)
    text = log.read_text(errors="replace")
    plan = json.loads(text[text.index("{") : text.rindex("}") + 1])
    out["estimate_gib"] = plan.get("memory_per_gpu", {}).get("peak_gib")
    out["estimate_terms_gib"] = (plan.get("memory_per_gpu", {}).get("stages") or [{}])[0]
    out["flops_per_token"] = plan.get("flops_per_token")
    want = 4 if dry else 8
    run_dir = work / "timed_1p3b"
    log = logs / "timed_1p3b.log"
    proc = launch(
        run,
        trainer_cmd("pretrain_1p3b", [*common, *timed_shape, "trainer.max_steps=100000", f"trainer.run_dir={run_dir}"]),
        log,
    )
    wait_for(run, proc, guard, log, until=lambda: len(metrics(run_dir)) >= want, poll_s=0.2)
    recs = [metrics(run_dir)[s] for s in sorted(metrics(run_dir))][2:]  # two warm-up steps
    out["records"] = len(recs)

    def median(key: str) -> float | None:
        vals = sorted(r[key] for r in recs if r.get(key) is not None)
        return vals[len(vals) // 2] if vals else None

    out.update(tokens_per_s=median("tokens_per_s"), mfu=median("mfu"), peak_gib=median("max_memory_gib"))
    if out["peak_gib"] and out["estimate_gib"]:
        out["peak_over_estimate"] = out["peak_gib"] / out["estimate_gib"]
    if dry:
        out["note"] = "dry run: the plan is the real layout's, the timed steps ran at the tiny size on CPU"
    return out


# ---------------------------------------------------------------------------------------------
# 2. correctness
# ---------------------------------------------------------------------------------------------


def correctness_cases(dry: bool) -> list[dict]:
    import attention as attn_bench  # bench/attention.py: problems, FLOPs, timing

    from orthros_train.ops.reference import UNBOUNDED

    t = 64 if dry else 4096
    heads, kv, d, w = (2, 1, 16, 8) if dry else (32, 8, 128, 128)
    cases = []
    for layout in ("pretrain", "sft", "prefill"):
        qi, qw, cu = attn_bench.make_queries(layout, t, w)
        cases.append({"layout": layout, "q_index": qi, "q_window": qw, "cu": cu})
    # packed: several documents in one sequence, sft-like output tokens on every 3rd position
    cu = torch.tensor([0, t // 5, t // 2, t - t // 8, t], dtype=torch.int32)
    out = torch.arange(0, t, 3)
    qi = torch.cat([torch.arange(t), out])
    qw = torch.cat([torch.full((t,), w), torch.full((out.numel(),), UNBOUNDED)])
    cases.append({"layout": "packed", "q_index": qi, "q_window": qw, "cu": cu})
    for c in cases:
        c.update(T=t, heads=heads, kv_heads=kv, head_dim=d)
    return cases


def max_errors(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    """Max abs error per tensor, relative to the reference tensor's max magnitude."""
    return {
        n: float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp(min=1e-6))
        for n, a, b in zip(names, got, want)
    }


def run_correctness(run: Run) -> None:
    with section(run, "correctness") as sec:
        from orthros_train.ops import triton_attention as ta
        from orthros_train.ops.reference import UNBOUNDED, attention_reference
        from orthros_train.ops.triton_decode import decode_attention

        dry = run.dry
        dev = torch.device("cpu" if dry else "cuda")
        guard = Guard(run, BUDGET_S["correctness"])
        dtype = torch.float32 if dry else torch.bfloat16  # the interpreter's bf16 is not the GPU's
        blocks = (16, 16) if dry else None  # the interpreter: small fixed tiles; a GPU: the autotuned ones
        g = torch.Generator().manual_seed(0)
        for c in correctness_cases(dry):
            if not guard.ok(c["layout"]):
                continue
            with attempt(run, sec, f"{c['layout']} fwd+bwd"):
                n_q, t = c["q_index"].numel(), c["T"]
                q32 = torch.randn(n_q, c["heads"], c["head_dim"], generator=g)
                k32 = torch.randn(t, c["kv_heads"], c["head_dim"], generator=g)
                v32 = torch.randn(t, c["kv_heads"], c["head_dim"], generator=g)
                dout = torch.randn(q32.shape, generator=g).to(dev)
                qi, qw, cu = c["q_index"].to(dev), c["q_window"].to(dev), c["cu"].to(dev)
                ins = [x.to(dev, dtype).requires_grad_() for x in (q32, k32, v32)]
                out, lse = ta.attention_triton(*ins, qi, qw, cu, decode=False, blocks=blocks)
                got = [out, lse, *torch.autograd.grad(out, ins, dout.to(out.dtype))]
                ref_in = [x.detach().float().requires_grad_() for x in ins]  # same rounded inputs, fp32 math
                r_out, r_lse = attention_reference(*ref_in, qi, qw, cu)
                want = [r_out, r_lse, *torch.autograd.grad(r_out, ref_in, dout.float())]
                errs = max_errors(got, want, ["out", "lse", "dq", "dk", "dv"])
                sec["rows"].append(
                    {
                        "check": f"{c['layout']} fwd+bwd",
                        "T": t,
                        "dtype": str(dtype).split(".")[-1],
                        "max_rel_err": errs,
                        "ok": all(errs[n] <= TOL[n] for n in errs),
                    }
                )
        if guard.ok("decode"):
            with attempt(run, sec, "decode"):  # ragged cache lengths, one base + one output query per row
                lens = [70, 17, 1] if dry else [32768, 4099, 1]
                heads, kv, d = (2, 1, 16) if dry else (32, 8, 128)
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                qi = (cu[1:] - 1).long().repeat_interleave(2)
                qw = torch.tensor([128, UNBOUNDED]).repeat(len(lens))
                n_k = int(cu[-1])
                q, k, v = (torch.randn(n, hh, d, generator=g).to(dev, dtype)
                           for n, hh in ((qi.numel(), heads), (n_k, kv), (n_k, kv)))  # fmt: skip
                out, lse = decode_attention(q, k, v, qi.to(dev), qw.to(dev), cu.to(dev))
                r_out, r_lse = attention_reference(q.float(), k.float(), v.float(), qi.to(dev), qw.to(dev),
                                                   cu.to(dev))  # fmt: skip
                errs = max_errors([out, lse], [r_out, r_lse], ["out", "lse"])
                sec["rows"].append(
                    {
                        "check": f"decode ragged {lens}",
                        "dtype": str(dtype).split(".")[-1],
                        "max_rel_err": errs,
                        "ok": all(errs[n] <= TOL[n] for n in errs),
                    }
                )
        for backend in ("triton", "auto"):  # auto: what a recipe without attention_backend gets
            if guard.ok(f"sync-free layers ({backend})"):
                with attempt(run, sec, f"sync-free layers ({backend})"):
                    sec["rows"].append(sync_free_check(dev, backend, dry))
        sec["skipped"] = guard.skipped


def sync_free_check(dev: torch.device, backend: str, dry: bool) -> dict:
    """Two layers, forward + backward, under CUDA's sync detector. The layout's attention plan is
    prepared before the watched region and reused, as a training step reuses the batch's plan:
    preparing it (SDPA's segment lengths are host numbers) reads the layout on the host once per
    batch, which is not the per-layer sync this check looks for."""
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.model.orthros import plan_for_layout
    from orthros_train.phase import pretrain_layout

    shape = {**shape_1p3b(), "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
             "head_dim": 16, "intermediate_size": 128, "vocab_size": 256} if dry else shape_1p3b()  # fmt: skip
    cfg = OrthrosConfig(**{**shape, "num_hidden_layers": 2, "attention_backend": backend})
    model = OrthrosForCausalLM(cfg).to(dev, torch.float32 if dry else torch.bfloat16)
    layout = pretrain_layout(torch.randint(0, cfg.vocab_size, (1, 64 if dry else 2048))).to(dev)
    plan = plan_for_layout(cfg, layout)

    def step():
        x = model.embed_tokens(layout.input_ids)
        y = x[layout.output_index]
        for layer in model.layers:
            x, y = layer(x, y, plan)
        return x.float().sum() + y.float().sum()

    step().backward()  # warm-up: autotuning synchronises, once; the plan's metadata is prepared
    _sync()
    if dry:  # no CUDA: the detector does not exist; the step ran
        return {
            "check": f"2 layers fwd+bwd, backend {backend} (dry run: no sync detector on CPU)",
            "ok": True,
            "error": None,
        }
    torch.cuda.set_sync_debug_mode("error")
    try:
        step().backward()
        ok, err = True, None
    except RuntimeError as exc:
        ok, err = False, str(exc)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"check": f"2 layers fwd+bwd, backend {backend}, under set_sync_debug_mode('error')", "ok": ok, "error": err}


# ---------------------------------------------------------------------------------------------
# 3. kernel speed
# ---------------------------------------------------------------------------------------------

KERNEL_T = (4096, 8192, 16384, 32768)
DRY_KERNEL_T = (64,)
KERNEL_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "window": 128}
DRY_KERNEL_SHAPE = {"heads": 2, "kv_heads": 1, "head_dim": 16, "window": 8}
STREAMS = (("pretrain", "output"), ("pretrain", "base"), ("sft", "both"), ("prefill", "both"))
SDPA_BACKENDS = ("flash", "cudnn")


def kernel_plan(ts: tuple[int, ...], shape: dict) -> list[dict]:
    import attention as attn_bench

    h, d, w = shape["heads"], shape["head_dim"], shape["window"]
    rows = []
    for t in ts:
        for b in SDPA_BACKENDS:
            rows.append({"T": t, "case": f"sdpa {b} causal", "pairs": t * (t + 1) // 2})
        for layout, streams in STREAMS:
            qi, qw, cu = attn_bench.make_queries(layout, t, w, streams)
            pairs = attn_bench.unmasked_pairs(qi, qw, cu)
            rows.append({"T": t, "case": f"orthros {layout}[{streams}]", "pairs": pairs})
            if (layout, streams) == ("pretrain", "output"):
                rows.append({"T": t, "case": f"orthros {layout}[{streams}] atomic bwd", "pairs": pairs})
    for r in rows:
        fwd, bwd = attn_bench.flops(r["pairs"], h, d)
        r.update(fwd_gflop=fwd / 1e9, bwd_gflop=bwd / 1e9, fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None)
    return rows


def _sdpa_fn(q, k, v, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def fn():
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn


def run_kernels(run: Run) -> None:
    with section(run, "kernels") as sec:
        import attention as attn_bench


        dry = run.dry
        dev = torch.device("cpu" if dry else "cuda")
        ts, shape = (DRY_KERNEL_T, DRY_KERNEL_SHAPE) if dry else (KERNEL_T, KERNEL_SHAPE)
        rows = kernel_plan(ts, shape)
        sec["rows"] = rows
        sec["shape"] = {**shape, "dtype": "float32 (interpreter)" if dry else "bfloat16"}
        sec["deterministic_bwd_ceiling"] = (
            f"{DETERMINISTIC_BWD_CEILING:.3f}: the deterministic backward does 7 matrix products per tile to "
            "FlashAttention-2's 5 (dq recomputes S and dP), so at equal tensor-core efficiency it reaches 5/7 of "
            "SDPA's backward TFLOP/s counted on 5; the atomic row does 5"
        )
        guard = Guard(run, BUDGET_S["kernels"])
        h, hkv, d, w = (shape[k] for k in ("heads", "kv_heads", "head_dim", "window"))
        dtype = torch.float32 if dry else torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)
        sec["autotuned_by_T"] = {}
        blocks = (16, 16) if dry else None  # the interpreter: small fixed tiles; a GPU: the autotuned ones
        for t in ts:
            if not guard.ok(f"T={t}"):
                continue
            known = set(chosen_configs())
            k = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g).requires_grad_()
            v = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g).requires_grad_()
            for r in (r for r in rows if r["T"] == t):
                if not guard.ok(f"T={t} {r['case']}"):
                    continue
                with attempt(run, sec, f"T={t} {r['case']}"):
                    if r["case"].startswith("sdpa"):
                        if dry:
                            continue  # flash / cuDNN exist on CUDA only
                        qs = torch.randn(1, h, t, d, device=dev, dtype=dtype, generator=g).requires_grad_()
                        ks = k.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
                        vs = v.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
                        fn = _sdpa_fn(qs, ks, vs, r["case"].split()[1])
                        f_ms, b_ms = attn_bench.fwd_bwd_ms(fn, (qs, ks, vs), True)
                    else:
                        layout, streams = r["case"].split()[1].rstrip("]").split("[")
                        qi, qw, cu = (x.to(dev) for x in attn_bench.make_queries(layout, t, w, streams))
                        q = torch.randn(qi.numel(), h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
                        det = not r["case"].endswith("atomic bwd")
                        fn = attn_bench.orthros_fn(q, k, v, qi, qw, cu, deterministic=det, blocks=blocks)
                        f_ms, b_ms = attn_bench.fwd_bwd_ms(fn, (q, k, v), not dry, reps=1 if dry else 3)
                    r.update(fwd_ms=f_ms, bwd_ms=b_ms, fwd_tflops=r["fwd_gflop"] / f_ms,
                             bwd_tflops=r["bwd_gflop"] / b_ms)  # fmt: skip
                    if dry:  # interpreter timings are no measurement
                        r.update(fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None, ran=True)
            now = chosen_configs()
            # the autotuner's key decides whether a length gets its own configs: say so per T
            sec["autotuned_by_T"][str(t)] = {k_: c for k_, c in now.items() if k_ not in known} or (
                "no new key: the configs tuned for a shorter T were reused"
            )
            if not dry:
                torch.cuda.empty_cache()
        sec["skipped"] = guard.skipped


def chosen_configs() -> dict[str, str]:
    """The configs the autotuners settled on, per kernel, stream class and key."""
    from orthros_train.ops import triton_attention as ta

    out = {}
    for name, tuners in (("fwd", ta._FWD), ("dq", ta._BWD_DQ), ("dkdv", ta._BWD_DKDV)):
        for cls, tuner in tuners.items():
            for key, cfg in getattr(tuner, "cache", {}).items():
                out[f"{name}[{cls}] {key}"] = str(cfg)
    return out


def kernel_targets(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["T"], r["case"]): r for r in rows}
    for t in sorted({r["T"] for r in rows}):
        o, b = by[t, "orthros pretrain[output]"], by[t, "orthros pretrain[base]"]
        atomic = by.get((t, "orthros pretrain[output] atomic bwd"), {})
        for ph in ("fwd", "bwd"):
            # held to the faster SDPA backend on this problem
            sdpa = [by[t, f"sdpa {s} causal"][f"{ph}_tflops"] for s in SDPA_BACKENDS]
            best = max((x for x in sdpa if x), default=None)
            ratio = o[f"{ph}_tflops"] / best if o[f"{ph}_tflops"] and best else None
            out.append(_target(f"T={t} output stream {ph} TFLOP/s / faster SDPA (flash, cuDNN)", ratio, ">=",
                               "output_vs_sdpa"))  # fmt: skip
            if ph == "bwd":
                a = atomic.get("bwd_tflops")
                out.append(_target(f"T={t} output stream bwd (atomic) TFLOP/s / faster SDPA",
                                   a / best if a and best else None, ">=", "output_vs_sdpa"))  # fmt: skip
            ideal = o[f"{ph}_ms"] * b["pairs"] / o["pairs"] if o[f"{ph}_ms"] else None
            ratio = b[f"{ph}_ms"] / ideal if ideal and b[f"{ph}_ms"] else None
            out.append(_target(f"T={t} base stream {ph} time / pairs at output rate", ratio, "<=", "base_time_ratio"))
    return out


def _target(what: str, value: float | None, op: str, key: str) -> dict:
    goal = TARGETS[key]
    met = None if value is None else (value >= goal if op == ">=" else value <= goal)
    return {"target": what, "value": value, "goal": f"{op} {goal}", "met": met}


# ---------------------------------------------------------------------------------------------
# 4. prefill / decode
# ---------------------------------------------------------------------------------------------

PROMPTS = (32768, 131072)
DRY_PROMPTS = (64,)
DECODE_STEPS = 32


def run_inference(run: Run) -> None:
    with section(run, "inference") as sec:
        from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

        dry = run.dry
        dev = torch.device("cpu" if dry else "cuda")
        guard = Guard(run, BUDGET_S["inference"])
        trainer_rows = run.report["sections"].get("trainer", {}).get("rows", [])
        n_layers = next((r.get("layers") for r in trainer_rows if r.get("layers")), None) or 2
        n_layers = 2 if dry else n_layers
        sec["layers"] = n_layers
        prompts = DRY_PROMPTS if dry else PROMPTS
        shape = (
            {
                **shape_1p3b(),
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "head_dim": 16,
                "intermediate_size": 128,
                "vocab_size": 256,
                "sliding_window": 8,
            }
            if dry
            else shape_1p3b()
        )
        steps = 2 if dry else DECODE_STEPS
        for kind, backend in (("orthros", "triton"), ("dense", "sdpa")):
            with attempt(run, sec, f"{kind} model"):
                cfg = OrthrosConfig(**{**shape, "num_hidden_layers": n_layers, "attention_type": kind,
                                       "attention_backend": backend})  # fmt: skip
                model = OrthrosForCausalLM(cfg).to(dev, torch.float32 if dry else torch.bfloat16).eval()
                for t in prompts:
                    row = {"model": kind, "prompt": t, "ttft_ms": None, "decode_tokens_per_s": None}
                    sec["rows"].append(row)
                    if not guard.ok(f"{kind} T={t}"):
                        continue
                    with attempt(run, sec, f"{kind} T={t}"):
                        ids = torch.randint(0, cfg.vocab_size, (1, t), device=dev)
                        with torch.no_grad():
                            model.prefill(ids[:, : min(t, 1024)])  # warm-up (autotuning)
                            _sync()
                            t0 = time.perf_counter()
                            logits, cache = model.prefill(ids)
                            _sync()
                            row["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                            logits, cache = model.decode_step(logits.argmax(-1), cache)  # warm-up
                            _sync()
                            t0 = time.perf_counter()
                            for _ in range(steps):
                                logits, cache = model.decode_step(logits.argmax(-1), cache)
                            _sync()
                            row["decode_tokens_per_s"] = steps / (time.perf_counter() - t0)
                        del cache, logits
                        if dry:
                            row.update(ran=True, ttft_ms=None, decode_tokens_per_s=None)
                        else:
                            torch.cuda.empty_cache()
                del model
        by = {(r["model"], r["prompt"]): r for r in sec["rows"]}
        sec["speedups"] = [
            {"prompt": t,
             "ttft_dense_over_orthros": _ratio(by.get(("dense", t), {}).get("ttft_ms"),
                                               by.get(("orthros", t), {}).get("ttft_ms")),
             "decode_orthros_over_dense": _ratio(by.get(("orthros", t), {}).get("decode_tokens_per_s"),
                                                 by.get(("dense", t), {}).get("decode_tokens_per_s"))}
            for t in prompts
        ]  # fmt: skip
        sec["skipped"] = guard.skipped


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# 5. serving in vLLM with CUDA graphs
# ---------------------------------------------------------------------------------------------

SERVE_DECODE_BATCHES = (1, 16)
SERVE_DECODE_PROMPT = 1024
SERVE_DECODE_TOKENS = 64
SERVE_TTFT_PROMPTS = (16384, 131072)
SERVE_LAYERS = 4  # the 1.3B shape's width with few layers: engine start and graph capture fit the budget


def serving_models(root: Path, dry: bool) -> tuple[dict, Path, Path]:
    """A random-weight export of the 1.3B shape (``SERVE_LAYERS`` layers) and its dense Llama twin."""
    import serve as serve_bench  # bench/serve.py: the same export and twin as the CPU table

    from orthros_train.model import OrthrosConfig

    shape = {**shape_1p3b(), "num_hidden_layers": 2 if dry else SERVE_LAYERS}
    if dry:
        shape.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=256, vocab_size=384, sliding_window=16, max_position_embeddings=4096)
    export, dense = serve_bench.random_export(OrthrosConfig(**shape), root)
    return shape, export, dense


def run_serving(run: Run) -> None:
    """Both models in vLLM as users run them (compiled, CUDA graphs on): decode tokens/s of a batch
    at a 1K context and TTFT of one 16K / 128K prompt, the Orthros export beside its dense Llama twin,
    and the Orthros engine's greedy tokens against the project's ``generate``. Needs vLLM (the GPU
    build) in the environment; without it the section says so and takes no time."""
    import importlib.util
    import tempfile

    with section(run, "serving") as sec:
        if importlib.util.find_spec("vllm") is None:
            sec["status_note"] = ("vllm is not installed here: nothing to measure (pip install vllm, then "
                                  "--sections serving)")
            sec["skipped"] = ["vllm not installed"]
            return
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from orthros_train.infer.generate import generate
        from orthros_train.model import OrthrosForCausalLM

        dry = run.dry
        guard = Guard(run, max(0.0, run.left()))  # what the other sections left (all of it with --sections serving)
        batches = (2,) if dry else SERVE_DECODE_BATCHES
        prompt_len, new = (64, 4) if dry else (SERVE_DECODE_PROMPT, SERVE_DECODE_TOKENS)
        ttft_prompts = (256,) if dry else SERVE_TTFT_PROMPTS
        g = torch.Generator().manual_seed(3)
        with tempfile.TemporaryDirectory() as tmp:
            shape, export, dense = serving_models(Path(tmp), dry)
            sec["shape"] = {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "head_dim", "sliding_window")}
            max_len = max(ttft_prompts) + 64
            vocab = shape["vocab_size"]
            for name, path in (("orthros", export), ("llama", dense)):
                if not guard.ok(f"{name} engine", need_s=60):
                    continue
                with attempt(run, sec, f"{name} engine"):
                    llm = LLM(model=str(path), dtype="float32" if dry else "bfloat16", max_model_len=max_len,
                              gpu_memory_utilization=0.4, skip_tokenizer_init=True, seed=0,
                              enable_prefix_caching=False, enforce_eager=dry)
                    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
                    row = {"model": name, "cudagraph_mode": str(mode)}
                    sec["rows"].append(row)
                    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
                    for b in batches:
                        if not guard.ok(f"{name} decode B={b}"):
                            continue
                        prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (prompt_len,), generator=g)
                                                .tolist()) for _ in range(b)]
                        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
                        llm.generate(prompts, greedy, use_tqdm=False)  # warm-up
                        _sync()
                        t0 = time.perf_counter()
                        llm.generate(prompts, one, use_tqdm=False)
                        first = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        outs = llm.generate(prompts, greedy, use_tqdm=False)
                        total = time.perf_counter() - t0
                        # Decode: the batch's tokens after the first, over the time after the prefill.
                        row[f"decode_tok_s_b{b}"] = b * (new - 1) / max(total - first, 1e-9)
                        if name == "orthros" and b == batches[0]:
                            model = OrthrosForCausalLM.from_pretrained(Path(tmp) / "orthros").eval()
                            model = model.to("cpu" if dry else "cuda", torch.float32 if dry else torch.bfloat16)
                            with torch.no_grad():
                                want = generate(model, [p["prompt_token_ids"] for p in prompts],
                                                max_new_tokens=new).sequences
                            got = [list(o.outputs[0].token_ids) for o in outs]
                            row["greedy_equals_generate"] = sum(a == w for a, w in zip(got, want)) / len(want)
                            del model
                    for t in ttft_prompts:
                        if not guard.ok(f"{name} TTFT T={t}"):
                            continue
                        prompt = [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (t,), generator=g).tolist())]
                        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
                        llm.generate(prompt, one, use_tqdm=False)  # warm-up at this length
                        _sync()
                        t0 = time.perf_counter()
                        llm.generate([TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (t,), generator=g)
                                                   .tolist())], one, use_tqdm=False)
                        row[f"ttft_ms_{t}"] = (time.perf_counter() - t0) * 1e3
                    llm.llm_engine.engine_core.shutdown()
                    del llm
                    if not dry:
                        torch.cuda.empty_cache()
                    if dry:  # nothing timed means anything on CPU
                        for k in list(row):
                            if k.startswith(("decode_tok_s", "ttft_ms")):
                                row[k] = None
        by = {r["model"]: r for r in sec["rows"]}
        o, d = by.get("orthros", {}), by.get("llama", {})
        sec["ratios"] = {
            **{f"decode_orthros_over_llama_b{b}": _ratio(o.get(f"decode_tok_s_b{b}"), d.get(f"decode_tok_s_b{b}"))
               for b in batches},
            **{f"ttft_llama_over_orthros_{t}": _ratio(d.get(f"ttft_ms_{t}"), o.get(f"ttft_ms_{t}"))
               for t in ttft_prompts},
        }
        sec["skipped"] = guard.skipped


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

RUNNERS = {"trainer": run_trainer_section, "correctness": run_correctness, "kernels": run_kernels,
           "inference": run_inference, "serving": run_serving}  # fmt: skip


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']}, torch {report['torch']}, triton {report['triton']}, "
             f"{report.get('elapsed_s', 0):.0f} s of {report['budget_s']} s"
             + (" — **dry run: nothing was measured**" if report["dry_run"] else ""), ""]  # fmt: skip
    if report.get("interrupted"):
        lines += [f"**Interrupted: {report['interrupted']}** (what finished before is below)", ""]
    elif not report.get("complete"):
        lines += ["**Running** (this report is rewritten after every item)", ""]
    s = report["sections"]
    lines += ["## Sections", "", "| section | status | seconds | errors | skipped (time) |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, sec in s.items():
        errors = len(sec.get("errors", [])) + bool(sec.get("error"))
        lines.append(f"| {name} | {sec.get('status')} | {sec.get('seconds', '-')} | {errors} | "
                     f"{len(sec.get('skipped', []))} |")  # fmt: skip
    lines.append("")
    if "trainer" in s:
        lines += ["## The real trainer (torchrun, one process)", "", "| item | ok | seconds | details |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for r in s["trainer"]["rows"]:
            details = {k: v for k, v in r.items() if k not in ("item", "ok", "seconds")}
            ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
            lines.append(f"| {r['item']} | {ok} | {_f(r['seconds'], '.1f')} | "
                         f"{json.dumps(details, default=str)[:400].replace('|', '/')} |")  # fmt: skip
        lines.append("")
    if "correctness" in s:
        lines += ["## Correctness (max abs error / max |reference|)", "",
                  "| check | errors | ok |", "| --- | --- | --- |"]  # fmt: skip
        for r in s["correctness"]["rows"]:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in r.get("max_rel_err", {}).items()) or r.get("error") or ""
            lines.append(f"| {r['check']} | {errs} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if "kernels" in s:
        k = s["kernels"]
        lines += [f"## Kernels ({k.get('shape')})", "",
                  "| T | case | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |",
                  "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in k["rows"]:
            lines.append(f"| T={r['T']} | {r['case']} | {_f(r['fwd_ms'], '.3f')} | {_f(r['fwd_tflops'], '.1f')} | "
                         f"{_f(r['bwd_ms'], '.3f')} | {_f(r['bwd_tflops'], '.1f')} |")  # fmt: skip
        if k.get("deterministic_bwd_ceiling"):
            lines += ["", f"Deterministic backward ceiling: {k['deterministic_bwd_ceiling']}."]
        lines.append("")
    if "serving" in s:
        sv = s["serving"]
        lines += [f"## Serving in vLLM ({sv.get('shape')})", ""]
        if sv.get("status_note"):
            lines += [sv["status_note"], ""]
        for r in sv.get("rows", []):
            lines.append(f"- {r['model']}: " + ", ".join(f"{k} {_f(v) if isinstance(v, float) else v}"
                                                       for k, v in r.items() if k != "model"))
        for k, v in sv.get("ratios", {}).items():
            lines.append(f"- {k}: {_f(v)}")
        lines.append("")
    if "inference" in s:
        lines += [f"## Prefill / decode ({s['inference'].get('layers')} layers)", "",
                  "| model | prompt | TTFT ms | decode tokens/s |", "| --- | --- | --- | --- |"]  # fmt: skip
        for r in s["inference"]["rows"]:
            lines.append(f"| {r['model']} | {r['prompt']} | {_f(r['ttft_ms'], '.0f')} | "
                         f"{_f(r['decode_tokens_per_s'], '.1f')} |")  # fmt: skip
        lines.append("")
    lines += ["## Targets", "", "| target | value | goal | met |", "| --- | --- | --- | --- |"]
    for t in report.get("targets", []):
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {_f(t['value'], '.3f')} | {t['goal']} | {met} |")
    for name, sec in s.items():
        for e in sec.get("errors", []):
            lines.append(f"\n{name} / {e['item']}: {e['error']}")
        if sec.get("error"):
            lines.append(f"\n{name}: section failed: {sec['error']}")
        if sec.get("skipped"):
            lines.append(f"\n{name}: skipped for time: {', '.join(sec['skipped'])}")
    return "\n".join(lines) + "\n"


def all_targets(report: dict) -> list[dict]:
    s = report["sections"]
    out = kernel_targets(s["kernels"]["rows"]) if s.get("kernels", {}).get("rows") else []
    for r in s.get("trainer", {}).get("rows", []):
        if r["item"].startswith("1.3B"):
            out.append(_target("1.3B-shape training MFU (the real trainer)", r.get("mfu"), ">=", "mfu"))
    return out


def plan_text(sections: list[str], dry: bool) -> str:
    lines = [f"gpu_check plan ({'dry run on CPU, tiny sizes' if dry else 'one GPU'}; "
             f"{TOTAL_BUDGET_S} s from process start, SIGALRM at +{ALARM_MARGIN_S} s):"]  # fmt: skip
    what = {
        "trainer": "orthros-train via torchrun: steps + saves, kill -9 + resume (bitwise losses), SFT step, RL step, "
        "export + transformers generate, 1.3B shape timed",
        "correctness": "Triton fwd/bwd/decode vs the fp32 reference; two layers under the sync detector",
        "kernels": "TFLOP/s per layout and T, deterministic and atomic backward, SDPA flash and cuDNN",
        "inference": "prefill TTFT and decode tokens/s, Orthros vs dense",
        "serving": "vLLM with CUDA graphs: decode tokens/s and TTFT 16K/128K, the Orthros export vs its Llama twin; "
        "greedy tokens vs generate",
    }
    for name in sections:
        share = f"<= {BUDGET_S[name]:>3d} s" if BUDGET_S[name] else "  the rest"
        lines.append(f"  {name:<12} {share}  {what[name]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="CPU: every section at tiny sizes, nothing timed")
    p.add_argument("--sections", default=",".join(RUNNERS), help=f"comma-separated, from {list(RUNNERS)}")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --dry-run to check every section on CPU")
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(RUNNERS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {list(RUNNERS)}")
    run = Run(Path(args.out), args.dry_run)
    if args.dry_run:
        run.deadline = math.inf  # a dry run checks every item, however slow the interpreter is
    print(plan_text(sections, args.dry_run), flush=True)
    previous = {sig: signal.signal(sig, run.on_signal) for sig in (signal.SIGTERM, signal.SIGALRM)}
    if not args.dry_run:
        signal.alarm(max(1, int(run.left() + ALARM_MARGIN_S)))
    try:
        run.write()
        for name in sections:
            if run.left() <= 0:
                run.report["sections"][name] = {"status": "skipped (time)", "rows": [], "errors": []}
                run.write()
                continue
            RUNNERS[name](run)
        run.report["complete"] = True
        run.write()
    finally:
        signal.alarm(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(markdown(run.report))
    r = run.report
    failed = [x for sec in r["sections"].values() for x in sec.get("rows", []) if x.get("ok") is False]
    errors = [x for sec in r["sections"].values() for x in sec.get("errors", [])]
    return 1 if failed or errors or any(sec.get("error") for sec in r["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
