"""One-shot GPU check: the first run on an H100/H200 turns into a report of every figure next to
its target, written as it goes.

On the GPU node, from the repository root (the repository and ``build/gpu_kit`` shipped
together; ``make gpu-kit`` builds the kit), one command does everything, the kit's install
included, in about 8 minutes::

    python3 bench/gpu_check.py --kit build/gpu_kit --out $OUT

On CPU, the rehearsal walks every item in the node's order through the same code paths at tiny
sizes (the trainer through torchrun on gloo, the kernels on the Triton interpreter; nothing it
times means anything)::

    python bench/gpu_check.py --rehearse --out DIR      # (--dry-run: the same)

``--kit DIR`` installs the kit's wheels the way the node has to (``pip install --no-index
--no-deps --target SCRATCH/site``) and starts the check again with that folder on
``PYTHONPATH``; the budget counts from the first start. Working files (trainer runs and logs,
the Triton cache, the installed kit, the tokenized corpora) go to a scratch folder (``--scratch``, by default a new
temporary one). ``--out`` receives at most ``OUT_FILES`` (5 files, flat): ``gpu_check.json``
and ``gpu_check.md``, rewritten after every item, on SIGTERM and on the budget's SIGALRM
backstop; ``gpu_check_logs.tar.gz``, every log of the run (each cut to its last 2 MiB), rewritten
after every item; and two plots when there is something to draw.

Items run in value order (``PLAN``): what a 15-minute lease must not leave unmeasured first.
Each has a budget on the node and starts only when the run has the time it needs (estimated
from the measured cost of a trainer launch and of Triton's cold compiles); what does not fit is
dropped and the report says so. One Triton cache (``TRITON_CACHE_DIR`` in the scratch folder,
with ``TRITON_CACHE_AUTOTUNING=1``) is shared by every process: the trainer runs, their resume
and this process compile and tune each kernel once, and a resumed run picks the tiles of the run
it resumes.
"""

from __future__ import annotations

import os
import sys
import time

# The budget counts from the node command's start: a re-exec after the kit's install passes it on.
_T0_WALL = float(os.environ.get("GPU_CHECK_T0") or time.time())
_T0 = time.monotonic() - (time.time() - _T0_WALL)
OUT_FILES = ("gpu_check.json", "gpu_check.md", "gpu_check_logs.tar.gz", "gpu_check_kernels.png",
             "gpu_check_loss.png")  # fmt: skip


def check_out(out: str) -> str | None:
    """Why ``--out`` cannot take the report (one line), or None: it must be a folder (or be
    creatable as one) that this process can write, and must not hold a GPU run's report (this run
    would replace it: a rehearsal's may be replaced)."""
    import json
    from pathlib import Path

    if not out.strip():  # Path('') is the current directory: the report would land wherever this runs
        return f"--out {out!r} is empty: give a folder for the report"
    path = Path(out)
    if path.exists() and not path.is_dir():
        return f"--out {out}: exists and is not a folder"
    report = path / "gpu_check.json"
    if report.exists():
        try:
            old = json.loads(report.read_text())
            measured = not old["dry_run"]
            what = f"a GPU run's report ({old.get('device')}, {old.get('date')})"
        except (OSError, ValueError, KeyError, TypeError):
            measured, what = True, "a gpu_check.json that is not a readable report"
        if measured:
            return (f"--out {out}: holds {what} that this run would replace; give --out a new or empty folder "
                    "(or move that report away first)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".gpu_check_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return f"--out {out}: cannot write there ({exc.strerror or type(exc).__name__})"
    return None


def check_scratch(scratch: str) -> str | None:
    """Why ``--scratch`` cannot hold the working files (one line), or None; creates the folder."""
    from pathlib import Path

    if not scratch.strip():  # a folder named '' (the current directory) or '  ' would be filled
        return f"--scratch {scratch!r} is empty: give a folder, or leave --scratch out for a new one"
    path = Path(scratch)
    if path.exists() and not path.is_dir():
        return f"--scratch {scratch}: exists and is not a folder (give a folder, or leave --scratch out for a new one)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--scratch {scratch}: cannot create it ({exc.strerror or type(exc).__name__})"
    return None


def _install_kit_and_reexec(argv: list[str]) -> None:
    """``--kit DIR``: the node's install (pip, no index, no dependencies, into SCRATCH/site), then
    this script again without ``--kit`` and with that folder on PYTHONPATH. A failed install is
    carried into the report (the preflight item fails and names it) rather than ending here."""
    import argparse
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kit", required=True)
    p.add_argument("--out")
    p.add_argument("--scratch")
    args, rest = p.parse_known_args(argv)
    for why in (args.out is not None and check_out(args.out),
                args.scratch is not None and check_scratch(args.scratch)):
        if why:
            print(f"gpu_check: error: {why}", file=sys.stderr)
            sys.exit(2)
    wheels = sorted(str(w) for w in Path(args.kit).glob("*.whl"))
    if not wheels:  # every trainer item would fail on its imports: minutes of a one-shot node for nothing
        what = "holds no wheels" if Path(args.kit).is_dir() else "is not a folder here" if Path(args.kit).exists() \
            else "does not exist here"
        print(f"gpu_check: error: --kit {args.kit} {what}: build it with `make gpu-kit` and send "
              f"{args.kit} along with the repository (build/ is git-ignored, so a copy of the tracked tree "
              "lacks it)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="gpu_check_"))
    site = scratch / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(site), *wheels]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    error = None if proc.returncode == 0 else f"pip exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
    info = {"kit": args.kit, "site": str(site), "wheels": len(wheels), "seconds": round(time.monotonic() - t0, 1),
            "command": " ".join(cmd[:11]) + f" {args.kit}/*.whl", "error": error}  # fmt: skip
    env = {**os.environ, "GPU_CHECK_T0": repr(_T0_WALL), "GPU_CHECK_KIT": json.dumps(info),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    again = [sys.executable, os.path.abspath(__file__), *rest, "--scratch", str(scratch)]
    if args.out:
        again += ["--out", args.out]
    os.execve(sys.executable, again, env)


if __name__ == "__main__" and any(a == "--kit" or a.startswith("--kit=") for a in sys.argv[1:]):
    _install_kit_and_reexec(sys.argv[1:])


import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

REHEARSE = any(a in ("--dry-run", "--rehearse") for a in sys.argv[1:])
_t_torch = time.monotonic()
import torch  # noqa: E402

TORCH_IMPORT_S = time.monotonic() - _t_torch
if REHEARSE or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (str(REPO), str(BENCH)):  # run as `python3 bench/gpu_check.py` from anywhere
    if _p not in sys.path:
        sys.path.insert(0, _p)

from orthros_train.common.files import write_atomic  # noqa: E402 - after REPO is on sys.path
from orthros_train.common.lifetime import child_environment  # noqa: E402

TARGETS = {
    "output_vs_sdpa": 0.80,  # output-stream TFLOP/s / the faster SDPA backend's TFLOP/s, >=
    "base_time_ratio": 1.30,  # base-stream time / (its pairs at the output stream's rate), <=
    "mfu": 0.50,  # 1.3B-shape training MFU, >=
}
# The whole run from the node command's start (the kit's install and every import count): 7.5
# minutes, so the command ends inside 9 with the alarm's margin, under the node's 10-minute limit.
TOTAL_BUDGET_S = 450
ALARM_MARGIN_S = 15  # SIGALRM after the budget plus this: the backstop when an item overruns
# Costs an item's start is weighed against, before they are measured in this run (then the
# measurement replaces them): a trainer launch (torchrun + megatron-core + DeepSpeed imports,
# ~10 s per process, NCCL init, the model built) and a cold Triton compile (2-3 s per config, sm_90,
# measured on CPU). One cold autotune of the attention kernels, forward and backward of both stream
# classes, compiles about COLD_AUTOTUNE_CONFIGS configs (~40 s); the lengths are not specialised on
# (``do_not_specialize``), so later layouts and lengths reuse those compiles and only benchmark
# them, and the on-disk cache shares them with every process of the run.
PRIOR_LAUNCH_S = 15.0
PRIOR_COMPILE_S = 2.5
COLD_AUTOTUNE_CONFIGS = 16
# bf16 tolerances against the fp32 reference on unit-variance inputs: the kernels' error is the
# bf16 rounding of their inputs/outputs (about 2**-8 relative), scaled by each tensor's size.
TOL = {"out": 2e-2, "lse": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
# FlashAttention-2's backward does 5 matrix products per tile (S, dP, dV, dK, dQ); ours, without
# atomics, recomputes S and dP in the dq kernel: 7. At equal tensor-core efficiency it reaches
# 5/7 of FA2's backward TFLOP/s counted on 5 products; the atomic variant does 5.
DETERMINISTIC_BWD_CEILING = 5 / 7
LOG_TAIL_BYTES = 2 * 2**20  # per log in the bundle


def shape_1p3b() -> dict:
    """The pretrain_1p3b recipe's model (its one statement, the recipe's model group), for any
    length up to 128K (imported here, not at the top: the report outlives a failed import)."""
    from orthros_train.infer.loading import PRESETS

    return {**PRESETS["1p3b"], "max_position_embeddings": 131072}


def tiny_shape(**extra) -> dict:
    """The rehearsal's model: the 1.3B's config at a size the interpreter runs in seconds."""
    return {**shape_1p3b(), "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": 256, **extra}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the plan, the run and the report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One line of the plan: ``fn(run, sec)`` returns its result (``ok`` False: a failed check)."""

    name: str
    section: str
    budget_s: float  # its cap on the node
    launches: int  # trainer processes it starts (each costs the measured launch time)
    work_s: float  # its own work beyond the launches (a cold autotune the first time)
    fn: Callable
    what: str


class Run:
    """The report and where it goes; written atomically after every item and signal."""

    def __init__(self, out_dir: Path, dry: bool, scratch: Path | None = None) -> None:
        self.out_dir, self.dry = Path(out_dir), dry
        self.scratch = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.logs = self.scratch / "logs"
        self.deadline = _T0 + TOTAL_BUDGET_S
        self.item_deadline = math.inf
        self.child: subprocess.Popen | None = None  # a trainer process to kill with us
        self.state: dict = {}  # what items hand on (the reference run, the layers that fit)
        kit = json.loads(os.environ.get("GPU_CHECK_KIT") or "null")
        self.costs = {"torch_import_s": round(TORCH_IMPORT_S, 1), "kit_install_s": kit and kit["seconds"],
                      "launch_s": None, "launch_s_assumed": PRIOR_LAUNCH_S, "compile_s_assumed": PRIOR_COMPILE_S}
        self.report: dict = {
            "device": f"CPU ({platform.machine()}), rehearsal" if dry or not torch.cuda.is_available()
            else torch.cuda.get_device_name(0),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
            "dry_run": dry, "budget_s": TOTAL_BUDGET_S, "kit": kit, "costs": self.costs,
            "triton_cache": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")},
            "targets_goal": TARGETS, "complete": False, "items": [], "dropped": [], "sections": {}, "targets": [],
        }  # fmt: skip

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def launch_s(self) -> float:
        """A trainer launch's cost: the measured one is the plan's launch, which stops before the
        training imports (megatron-core, DeepSpeed: ~10 s), so it never counts for less than the prior."""
        return max(self.costs["launch_s"] or 0.0, PRIOR_LAUNCH_S)

    def need_s(self, item: Item) -> float:
        """Seconds ``item`` needs to start: its launches at the measured cost, its own work, and a
        cold autotune if nothing has compiled the kernels yet."""
        cold = 0.0 if self.state.get("kernels_warm") else COLD_AUTOTUNE_CONFIGS * PRIOR_COMPILE_S
        return min(item.budget_s, item.launches * self.launch_s() + item.work_s + (cold if item.work_s else 0.0))

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
            write_atomic(self.out_dir / name, text, durable=False)  # a reader never sees half a report

    def bundle(self) -> None:
        """``gpu_check_logs.tar.gz``: every log and metrics file of the scratch folder, each cut to
        its last ``LOG_TAIL_BYTES`` (the trainer's error is at the end)."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for path in sorted(self.scratch.rglob("*")):
                if path.is_file() and (path.suffix in (".log", ".jsonl") or path.parent == self.logs):
                    data = path.read_bytes()[-LOG_TAIL_BYTES:]
                    info = tarfile.TarInfo(str(path.relative_to(self.scratch)))
                    info.size, info.mtime = len(data), int(path.stat().st_mtime)
                    tar.addfile(info, io.BytesIO(data))
        write_atomic(self.out_dir / "gpu_check_logs.tar.gz", buffer.getvalue(), durable=False)

    def on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        self.report["interrupted"] = f"{name} after {time.monotonic() - _T0:.0f}s" + (
            " (the time budget's backstop)" if signum == signal.SIGALRM else ""
        )
        kill_child(self.child)
        try:
            for entry in self.report["items"]:
                if entry["status"] == "running":
                    entry["status"] = "interrupted"
            self.write()
            self.bundle()
        finally:
            os._exit(124 if signum == signal.SIGALRM else 128 + signum)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing package is a fact of the report
        return None


def section_entry(run: Run, name: str) -> dict:
    return run.report["sections"].setdefault(name, {"status": "pending", "rows": [], "errors": []})


def run_item(run: Run, item: Item) -> None:
    """Run one item within its budget (or drop it when the run has not the time it needs) and
    record its status, result and seconds; the report and the log bundle follow."""
    entry = next(e for e in run.report["items"] if e["name"] == item.name)
    sec = section_entry(run, item.section)
    need = run.need_s(item)
    if item.launches == 0 and run.state.get("cuda_broken"):
        entry.update(status="skipped", reason=f"this process's CUDA context broke in {run.state['cuda_broken']}: "
                                               "nothing more runs in it (trainer items run in their own)")  # fmt: skip
        sec.setdefault("skipped", []).append(item.name)
    elif item.launches and run.state.get("launch_broken"):
        entry.update(status="skipped", reason=f"a trainer failed to start in {run.state['launch_broken']}: "
                                               "every trainer item would fail the same way")  # fmt: skip
        sec.setdefault("skipped", []).append(item.name)
    elif not run.dry and run.left() < need:
        entry.update(status="dropped", reason=f"needs ~{need:.0f} s, {max(run.left(), 0):.0f} s left")
        run.report["dropped"].append({"item": item.name, "reason": entry["reason"]})
        sec.setdefault("skipped", []).append(item.name)
    else:
        entry["status"], sec["status"] = "running", "running"
        run.write()
        t0 = time.monotonic()
        run.item_deadline = math.inf if run.dry else min(t0 + item.budget_s, run.deadline)
        try:
            result = item.fn(run, sec) or {}
            entry["status"] = result.pop("status", None) or ("failed" if result.get("ok") is False else "ok")
            entry["result"] = result
        except Exception as exc:  # noqa: BLE001 - one item's failure is a result; the rest runs
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:800],
                         traceback=traceback.format_exc()[-1500:])  # fmt: skip
            sec["errors"].append({"item": item.name, "error": entry["error"]})
        finally:
            kill_child(run.child)
            run.item_deadline = math.inf
            entry["seconds"] = round(time.monotonic() - t0, 1)
            if item.launches == 0 and (why := cuda_fault(run)):
                run.state["cuda_broken"] = entry["cuda_fault"] = f"{item.name} ({why})"
    sec["seconds"] = round(sum(e.get("seconds") or 0 for e in run.report["items"] if e["section"] == item.section), 1)
    if all(e["status"] not in ("pending", "running") for e in run.report["items"] if e["section"] == item.section):
        sec["status"] = "done"
    run.write()
    _quietly(run.bundle)


def cuda_fault(run: Run) -> str | None:
    """The error this process's CUDA context is stuck in, or None. A kernel's fault (an illegal
    address, a launch failure) is sticky: every later CUDA call in the process fails with it, so the
    items after it would report that fault under their own names."""
    if run.dry or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a bundle or a plot that fails costs nothing else
        print(f"gpu_check: {getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}", file=sys.stderr)


def left_s(run: Run) -> float:
    """Seconds the running item has left (inf in a rehearsal)."""
    return run.item_deadline - time.monotonic()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# the real trainer, through torchrun
# ---------------------------------------------------------------------------------------------

# On CPU (rehearsal): gloo, fp32 (the interpreter's bf16 is not the GPU's), tiny sizes.
DRY_DEVICE = ["trainer.device=cpu", "trainer.precision=fp32", "parallel.backend=gloo"]
GPU_DEVICE = ["trainer.device=cuda", "trainer.precision=bf16", "parallel.backend=nccl"]
# The trainer runs take the attention route a user's run takes (model.attention_backend=auto:
# FlashAttention varlen for the pretraining streams where the node has it); each row says which.
# Every trainer here is one process: a collective that waits 2 minutes waits for nothing, and the
# recipes' 30 would let a hung start-up eat several items' budgets.
COMMON = ["trainer.wandb.enabled=false", "trainer.progress=false", "trainer.eval_every=0",
          "trainer.sample_prompt=null", "trainer.gpu=null", "trainer.gpu_memory_gib=null",
          "parallel.timeout_minutes=2"]  # fmt: skip
# NCCL of a one-process world on a node without network: bootstrap over loopback, no InfiniBand
# probe, errors raised instead of hanging (a launcher's own values are kept).
WORLD1_NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                   "NCCL_DEBUG": "WARN"}  # fmt: skip
DRY_TINY = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.intermediate_size=128",
            "trainer.seq_len=64", "trainer.micro_batch_size=2", "trainer.eval_batches=1"]  # fmt: skip
# The tiny model's runs on the GPU take the 1.3B shape's attention geometry (head_dim 64 = 256 / 4
# heads, one query head per KV head), so they reuse the kernels compiled and tuned for it.
GPU_TINY = ["model.num_key_value_heads=4"]
GPU_RL = ["model.hidden_size=256", "model.num_key_value_heads=4"]  # rl_tiny_cpu's 64 wide model, likewise
# The rehearsal's RL step: 4 rollouts instead of 64 (sampling on the interpreter is the slow part).
DRY_RL = ["rl.group_size=2", "rl.prompts_per_step=2", "trainer.micro_batch_size=4"]


def trainer_cmd(recipe: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
            "-m", "orthros_train.train.cli", "--config-name", recipe, *overrides]  # fmt: skip


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


def launch(run: Run, cmd: list[str], name: str, data: bool = True) -> tuple[subprocess.Popen, Path]:
    """Start a trainer with its log at SCRATCH/logs/NAME.log; the Triton cache is inherited. The
    tokenized corpora go to SCRATCH/data_cache: built cold, as on a fresh node, then shared
    (``data=False``: a recipe that reads no corpus and has no cache, the RL pattern task)."""
    cmd = [*cmd, f"data.cache_dir={run.scratch / 'data_cache'}"] if data else cmd
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if run.dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # the interpreter on CUDA tensors copies them to the host
        env = {**WORLD1_NCCL_ENV, **env}
    log = run.logs / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # Tied to this process: a check killed outright (SIGKILL at a node's command limit) takes its
    # trainer with it instead of leaving it on the GPU for whatever runs next there.
    tied = [sys.executable, "-m", "orthros_train.common.lifetime", *cmd]
    with log.open("w") as handle:
        proc = subprocess.Popen(tied, cwd=REPO, env=child_environment(env), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    run.child = proc
    return proc, log


STARTUP_FAILURE = re.compile(r"ImportError|ModuleNotFoundError|NCCL|DistNetworkError|DistStoreError|[Rr]endezvous"
                             r"|CUDA error|no CUDA|CUDA driver|timed out|[Tt]imeout")


def wait_for(run: Run, proc: subprocess.Popen, log: Path, until=None, poll_s: float = 0.05) -> int:
    """Wait for ``proc`` (or for ``until()`` to hold, then kill it with SIGKILL) within the item's
    time; a process still running at the item's deadline is killed and named."""
    while proc.poll() is None:
        if until is not None and until():
            kill_child(proc)
            return -9
        if left_s(run) <= 0:
            kill_child(proc)
            raise TimeoutError(f"the trainer ran out of the item's time (log {log.name} in the bundle)")
        time.sleep(poll_s)
    run.child = None
    if proc.returncode != 0:
        problem = log_problem(log)
        # a start-up failure (imports, NCCL / rendezvous, the CUDA context) before the model was
        # built is every later trainer's too: those are skipped instead of spending their budgets
        if "attention route on " not in log.read_text(errors="replace") and STARTUP_FAILURE.search(problem):
            run.state["launch_broken"] = f"{log.stem} ({problem[:300]})"
        raise RuntimeError(f"trainer exited with {proc.returncode} (log {log.name}): {problem}")
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


def tiny_base(run: Run) -> list[str]:
    """Overrides of every tiny-model trainer run: device, the common switches, the size."""
    return [*(DRY_DEVICE if run.dry else GPU_DEVICE), *COMMON, *(DRY_TINY if run.dry else GPU_TINY)]


# pretrain_1p3b's step on each of its 8 GPUs (recipes/pretrain_1p3b.yaml, parallel node8_dp8_zero1):
# micro batches of 2 sequences, 256 / (2 x 8) = 16 of them per optimizer step. The MFU item takes
# the same step on one GPU (a global batch of 32), so the optimizer's share is the recipe's.
RECIPE_MICRO_BATCH = 2
RECIPE_ACCUMULATION = 16
MFU_STEPS = 6  # logged steps of the timed run: 2 warm-up, the medians of 4


def layers_that_fit(device_bytes: int, seq_len: int = 4096, micro_batch: int = RECIPE_MICRO_BATCH) -> tuple[int, dict]:
    """Most layers (<= 24) whose modelled peak (one process, bf16 with fp32 masters, as the
    trainer runs it) stays under 85% of the device."""
    from orthros_train.model import OrthrosConfig
    from orthros_train.parallel.setup import ParallelConfig
    from orthros_train.train.memory import estimate_memory

    best, est = 1, None
    for n in range(1, 25):
        cfg = OrthrosConfig(**{**shape_1p3b(), "num_hidden_layers": n})
        e = estimate_memory(cfg, ParallelConfig(data_parallel=1, world_size=1), seq_len, micro_batch, "bf16", "flash",
                            1.0)  # fmt: skip
        if e.total > 0.85 * device_bytes:
            break
        best, est = n, e
    return best, (est.as_gib() if est else {})


def item_train_1p3b(run: Run, sec: dict) -> dict:
    """The 1.3B shape with as many layers as fit at 4K tokens: the trainer's own plan
    (trainer.dry_run, whose launch measures what a launch costs here), then steps timed by the
    trainer itself (metrics.jsonl: tokens/s, MFU from the model's FLOPs, peak memory), killed once
    enough are logged (its final save of a 1.3B model is not what is measured). Each step is the
    recipe's per-GPU step (``RECIPE_ACCUMULATION`` micro batches of ``RECIPE_MICRO_BATCH``); the
    optimizer's part of it is timed apart afterwards (``optimizer_ms``). Where varlen failed its
    first call the run takes the Triton kernels, and the row says why."""
    gib = 2**30
    device_bytes = 80 * gib if run.dry else torch.cuda.get_device_properties(0).total_memory
    layers, _ = layers_that_fit(device_bytes)
    sequences = RECIPE_MICRO_BATCH * RECIPE_ACCUMULATION
    layout = [f"model.num_hidden_layers={layers}", "trainer.seq_len=4096",
              f"trainer.micro_batch_size={RECIPE_MICRO_BATCH}", f"trainer.global_batch_size={sequences}"]  # fmt: skip
    device = DRY_DEVICE if run.dry else GPU_DEVICE
    common = [*device, *COMMON, "parallel=single", "trainer.log_every=1",
              "trainer.save_every=0", "trainer.resume=none", "trainer.overwrite=true"]  # fmt: skip
    out: dict = {"item": "1.3B shape through the trainer", "layers": layers, "seq_len": 4096,
                 "micro_batch_size": RECIPE_MICRO_BATCH, "accumulation": RECIPE_ACCUMULATION,
                 "tokens_per_step": sequences * 4096, "device_gib": round(device_bytes / gib, 1)}  # fmt: skip
    if reason := run.state.get("fallback", {}).get("varlen"):
        common.append("++model.attention_backend=triton")  # ++: the recipe's model group may not state it
        out["fallback"] = f"varlen failed its first call ({reason[:200]}): model.attention_backend=triton"
    sec["rows"].append(out)
    t0 = time.monotonic()
    plan_dir = run.scratch / "runs" / "plan_1p3b"
    proc, log = launch(run, trainer_cmd("pretrain_1p3b", [*common, *layout, "trainer.dry_run=true",
                                                          f"trainer.run_dir={plan_dir}"]), "plan_1p3b")  # fmt: skip
    wait_for(run, proc, log)
    run.costs["launch_s"] = round(time.monotonic() - t0, 1)  # imports + config + plan: one launch's cost
    text = log.read_text(errors="replace")
    plan = json.loads(text[text.index("{") : text.rindex("}") + 1])
    out["estimate_gib"] = plan.get("memory_per_gpu", {}).get("peak_gib")
    out["flops_per_token"] = plan.get("flops_per_token")
    # the rehearsal: the same path at a size the interpreter can run; the plan is for the real layers
    # (accumulation 2 of the tiny micro batches: the same engine path)
    timed = [*DRY_TINY, "model.num_attention_heads=4", "model.num_key_value_heads=4", "trainer.global_batch_size=4"] \
        if run.dry else layout  # fmt: skip
    out.update(time_steps(run, [*common, *timed], want=4 if run.dry else MFU_STEPS))
    if run.dry:
        out["tokens_per_step"] = 4 * 64
    try:  # after the trainer is gone: its memory is free again
        out.update(optimizer_ms(run, layers))
    except Exception as exc:  # noqa: BLE001 - the MFU figure stands without the breakdown
        out["optimizer_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if not run.dry:
        torch.cuda.empty_cache()
    # a run on the Triton kernels compiled and tuned them into the shared cache
    run.state["kernels_warm"] = pretraining_on_triton(out.get("attention_route"))
    if out.get("peak_gib") and out["estimate_gib"]:
        out["peak_over_estimate"] = out["peak_gib"] / out["estimate_gib"]
    out["ok"] = bool(out.get("records"))
    return out


def optimizer_ms(run: Run, layers: int) -> dict:
    """One optimizer step over the MFU run's parameters the way its engine takes it with bf16
    (DeepSpeed's bf16 optimizer: fp32 master weights and gradients, the global gradient norm for
    clipping, torch's fused AdamW, the bf16 weights copied back), timed in this process: the
    trainer logs whole steps only, and this is the part of a step that does not grow with its
    micro batches. On CPU (the rehearsal) the tiny model's step runs and nothing is timed."""
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

    shape = tiny_shape() if run.dry else shape_1p3b()
    with torch.device("meta"):  # shapes only: nothing allocated for the model itself
        model = OrthrosForCausalLM(OrthrosConfig(**{**shape, "num_hidden_layers": 2 if run.dry else layers}))
    dev = torch.device("cpu" if run.dry else "cuda")
    masters = [torch.zeros(p.shape, device=dev, dtype=torch.float32, requires_grad=True) for p in model.parameters()]
    for m in masters:
        m.grad = torch.full_like(m, 1e-3)
    weights = [m.detach().to(torch.bfloat16) for m in masters]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=dev.type == "cuda")

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        torch._foreach_copy_(weights, [m.detach() for m in masters])

    step()  # the optimizer's states are allocated by its first step
    n = sum(m.numel() for m in masters)
    if run.dry:
        return {"optimizer_ms": None, "optimizer_parameters": n}
    import triton.testing

    return {"optimizer_ms": float(triton.testing.do_bench(step, warmup=5, rep=50)), "optimizer_parameters": n}


def time_steps(run: Run, overrides: list[str], want: int) -> dict:
    """Launch pretrain_1p3b, let it log ``want`` steps, kill it; medians after two warm-up steps."""
    run_dir = run.scratch / "runs" / "timed_1p3b"
    proc, log = launch(run, trainer_cmd("pretrain_1p3b", [*overrides, "trainer.max_steps=100000",
                                                          f"trainer.run_dir={run_dir}"]), "timed_1p3b")  # fmt: skip
    partial = None
    try:
        wait_for(run, proc, log, until=lambda: len(metrics(run_dir)) >= want, poll_s=0.2)
    except TimeoutError:
        partial = f"the item's time ran out after {len(metrics(run_dir))} of {want} steps: medians of those"
    logged = metrics(run_dir)
    if partial and len(logged) < 3:  # not one step past the two warm-up ones
        raise TimeoutError(f"the trainer ran out of the item's time after {len(logged)} steps (log {log.name})")
    recs = [logged[s] for s in sorted(logged)][2:]

    def median(key: str) -> float | None:
        vals = sorted(r[key] for r in recs if r.get(key) is not None)
        return vals[len(vals) // 2] if vals else None

    out = {"records": len(recs), "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
           "model_tflops_per_s": median("model_tflops_per_s"), "peak_gib": median("max_memory_gib"),
           **route_and_determinism(log)}  # fmt: skip
    if partial:
        out.update(status="partial", partial=partial)
    if run.dry:
        out["note"] = "rehearsal: the plan is the real layout's, the timed steps ran at the tiny size on CPU"
    return out


def route_and_determinism(log: Path) -> dict:
    """What a trainer's log says of its attention route and of the ops torch found no
    reproducible kernel for under ``trainer.deterministic`` (each warns once, naming itself)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    route = next((line.split("attention route on ", 1)[1] for line in text.splitlines()
                  if "attention route on " in line), None)  # fmt: skip
    ops = sorted(set(re.findall(r"(\w+) does not have a deterministic implementation", text))
                 | set(re.findall(r"(\w[\w ]*?) defaults to a non-deterministic algorithm", text)))
    return {"attention_route": route, "nondeterministic_ops": ops}


def item_resume(run: Run, sec: dict) -> dict:
    """recipes/gpu_check.yaml: a run with saves, then a second one killed with SIGKILL after its
    first save and resumed in a new process; its losses must equal the first run's bit for bit
    (the Triton autotune cache on disk gives the resumed process the first one's tiles)."""
    steps, every = (4, 2) if run.dry else (12, 3)
    base = [*tiny_base(run), "trainer.log_every=1", f"trainer.save_every={every}"]
    ref_dir, killed_dir = run.scratch / "runs" / "reference", run.scratch / "runs" / "killed"
    row = {"item": "kill -9 after the first save, resume: bitwise-equal losses", "recipe": "recipes/gpu_check.yaml"}
    sec["rows"].append(row)
    proc, log = launch(run, trainer_cmd("gpu_check", [*base, f"trainer.max_steps={steps}",
                                                      f"trainer.run_dir={ref_dir}"]), "reference")  # fmt: skip
    wait_for(run, proc, log)
    row.update(route_and_determinism(log))
    run.state["reference"] = ref_dir
    ref = metrics(ref_dir)
    row.update(steps=sorted(ref), final_loss=ref[max(ref)]["loss"] if ref else None)
    # a far max_steps, so the kill lands mid-run; the lr is constant, so steps are comparable
    proc, log = launch(run, trainer_cmd("gpu_check", [*base, "trainer.max_steps=100000",
                                                      f"trainer.run_dir={killed_dir}"]), "killed")  # fmt: skip
    wait_for(run, proc, log, until=lambda: latest_step(killed_dir) is not None)
    saved = latest_step(killed_dir)
    row.update(killed_after_checkpoint=saved, steps_logged_before_kill=max(metrics(killed_dir), default=0))
    if saved is None or saved >= steps:
        raise RuntimeError(f"the kill came too late: checkpoint {saved} is not before step {steps}")
    resume = [f"trainer.max_steps={steps}", f"trainer.run_dir={killed_dir}", "trainer.resume=auto",
              "trainer.resume_changes=allow"]  # fmt: skip
    proc, log = launch(run, trainer_cmd("gpu_check", [*base, *resume]), "resumed")
    wait_for(run, proc, log)
    got = metrics(killed_dir)
    compared = list(range(saved + 1, steps + 1))
    diffs = {s: (ref.get(s, {}).get("loss"), got.get(s, {}).get("loss")) for s in compared}
    row.update(compared_steps=compared,
               mismatches={s: d for s, d in diffs.items() if d[0] is None or repr(d[0]) != repr(d[1])})  # fmt: skip
    row["ok"] = sorted(ref) == list(range(1, steps + 1)) and not row["mismatches"]
    run.state["losses"] = {"reference": {s: r["loss"] for s, r in ref.items()},
                           "resumed": {s: r["loss"] for s, r in got.items() if s > saved}}  # fmt: skip
    _quietly(lambda: plot_losses(run))
    return dict(row)


def item_export_generate(run: Run, sec: dict) -> dict:
    """The reference run's export as a user loads it in transformers: converted by
    orthros-convert's library call into a remote-code directory, loaded with the auto classes,
    ``generate``d from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orthros_train.convert.to_hf import convert_to_hf

    export = run.state.get("reference", run.scratch / "runs" / "reference") / "checkpoints" / "final"
    if not export.exists():
        return {"status": "skipped", "reason": "no export: the resume item's reference run did not finish"}
    dev = torch.device("cpu" if run.dry else "cuda")
    hf = export.parent / "final_hf"
    convert_to_hf(export, hf, overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=False)  # the tokenizer runs no custom code
    ids = tok("The most important thing about startups is", return_tensors="pt").input_ids.to(dev)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    row = {"item": "export + transformers generate", "model_class": type(model).__name__,
           "new_tokens": int(out.shape[1] - ids.shape[1]), "text": tok.decode(out[0, ids.shape[1]:])}  # fmt: skip
    row["ok"] = row["new_tokens"] > 0
    sec["rows"].append(row)
    return dict(row)


def one_step_item(recipe: str, what: str, from_export: bool) -> Callable:
    """An item that runs one step of ``recipe`` (SFT from the reference run's export, or RL)."""

    def item(run: Run, sec: dict) -> dict:
        extra = []
        if from_export:
            export = run.state.get("reference", run.scratch / "runs" / "reference") / "checkpoints" / "final"
            if not export.exists():
                return {"status": "skipped", "reason": "no export: the resume item's reference run did not finish"}
            extra = [f"model.init_from={export}"]
        run_dir = run.scratch / "runs" / recipe
        size = tiny_base(run) if from_export else [*([*DRY_DEVICE, *DRY_RL] if run.dry else [*GPU_DEVICE, *GPU_RL]),
                                                   *COMMON]  # fmt: skip
        cmd = trainer_cmd(recipe, [*size, *extra, "trainer.max_steps=1", "trainer.log_every=1",
                                   f"trainer.run_dir={run_dir}"])  # fmt: skip
        proc, log = launch(run, cmd, recipe, data=from_export)
        wait_for(run, proc, log)
        got = metrics(run_dir)
        row = {"item": what, "loss": got.get(1, {}).get("loss"), "ok": 1 in got and math.isfinite(got[1]["loss"])}
        sec["rows"].append(row)
        return dict(row)

    return item


# ---------------------------------------------------------------------------------------------
# preflight: what the node's items need is there
# ---------------------------------------------------------------------------------------------

# What the trainer, conversion and inference import beyond torch (the kit's and the image's), and
# the corpora the recipes read (gpu_check.yaml and pretrain_1p3b: the essays; sft_tiny_cpu: the
# dialogues, both data wheels of the kit).
NODE_MODULES = ("megatron.core", "deepspeed", "hydra", "omegaconf", "antlr4", "datasets", "dill", "multiprocess",
                "hjson", "pydantic", "transformers", "triton", "safetensors", "tokenizers", "yaml", "numpy")
NODE_CORPORA = ("paul_graham", "chatterbot")


def _found(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def item_preflight(run: Run, sec: dict) -> dict:
    """Every module the items import and every corpus the recipes read is found, and the kit's
    wheels installed (their versions as its requirements.txt pins them): one line per problem."""
    from importlib import metadata

    problems = [f"module {m} not found" for m in NODE_MODULES if not _found(m)]
    kit = run.report.get("kit") or {}
    if kit.get("error"):
        problems.append(f"the kit's install failed: {kit['error']}")
    pins = Path(kit["kit"]) / "requirements.txt" if kit.get("kit") else None
    for line in pins.read_text().splitlines() if pins and pins.exists() else []:
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, version = spec.split("==", 1)
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                have = None
            if have != version:
                problems.append(f"kit package {spec} is {'at ' + have if have else 'not installed'}")
    corpora = {}
    try:
        from orthros_train.data.embedded import corpus_files

        for name in NODE_CORPORA:
            try:
                corpora[name] = len(corpus_files(name))
            except (FileNotFoundError, ValueError) as exc:
                problems.append(f"corpus {name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the package itself does not import: that is the finding
        problems.append(f"orthros_train.data does not import: {type(exc).__name__}: {exc}")
    row = {"check": "packages, kit and corpora", "modules": len(NODE_MODULES), "corpora": corpora,
           "problems": problems, "ok": not problems}  # fmt: skip
    sec["rows"].append(row)
    return dict(row)


# ---------------------------------------------------------------------------------------------
# first calls: every GPU call a timed item makes for the first time, at a tiny size, first
# ---------------------------------------------------------------------------------------------

# The check's own test hook (not the library's): GPU_CHECK_FORCE_FAIL=varlen,cudnn,graph makes
# those first calls fail as a node's library might, so a rehearsal walks the fallbacks.
FORCE_FAIL_ENV = "GPU_CHECK_FORCE_FAIL"
FIRST_CALL_T = 256  # tokens of the varlen probe: every kernel path, in milliseconds
# The capture child's limit: it starts in the first_calls item and runs beside the items after
# it; the first item that needs a graph reads it (a hung capture is killed there, not waited on).
GRAPH_PROBE_TIMEOUT_S = 90
FALLBACKS = {
    "varlen": "the MFU run takes model.attention_backend=triton; the varlen kernel rows are not timed",
    "cudnn": "the cuDNN SDPA rows are not timed; the output stream is held to SDPA flash alone",
    "graph": "decode is timed eager only (no CUDA graph rows)",
}


def forced_failure(call: str) -> None:
    if call in os.environ.get(FORCE_FAIL_ENV, "").split(","):
        raise RuntimeError(f"forced by {FORCE_FAIL_ENV}={os.environ[FORCE_FAIL_ENV]} (the check's test hook)")


def item_first_calls(run: Run, sec: dict) -> dict:
    """The first call of everything a timed item relies on, at a tiny size, before that item:
    FlashAttention varlen forward + backward on both pretraining streams against the reference op
    (the route the MFU run's ``auto`` takes), cuDNN SDPA forward + backward against SDPA's math
    backend (a kernels row), and a CUDA graph capture of the decode step (the decode rows), the
    last in a child process with its own time limit: a hung capture cannot be interrupted in this
    process, by the budget's alarm either. A call that fails routes its items to their fallback
    (``FALLBACKS``) with the reason in the report, instead of failing them."""
    fallback = run.state.setdefault("fallback", {})
    run.report["fallback"] = fallback  # the report shows what later items fell back from, and why
    start_graph_probe(run)
    for call, probe in (("varlen", probe_varlen), ("cudnn", probe_cudnn)):
        row: dict = {"call": call}
        sec["rows"].append(row)
        t0 = time.monotonic()
        try:
            forced_failure(call)
            row.update(probe(run))
        except Exception as exc:  # noqa: BLE001 - a failed first call is this row's result
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["seconds"] = round(time.monotonic() - t0, 2)
        if row.get("error"):
            fallback[call] = row["error"]
            row["fallback"] = FALLBACKS[call]
        if cuda_fault(run):
            break  # run_item names the fault; the later in-process items are skipped
    calls = {r["call"]: "fallback" if r.get("fallback") else "ok" for r in sec["rows"] if "call" in r}
    return {"calls": calls, "fallback": {k: FALLBACKS[k] for k in fallback if k in calls},
            **({"status": "fallback"} if any(v == "fallback" for v in calls.values()) else {})}  # fmt: skip


def probe_varlen(run: Run) -> dict:
    """varlen fwd+bwd of both pretraining streams at ``FIRST_CALL_T`` tokens vs the reference op."""
    from orthros_train.ops.reference import attention_reference

    shape = DRY_ATTN_SHAPE if run.dry else ATTN_SHAPE
    dev, dtype = _dev_dtype(run)
    t = 64 if run.dry else FIRST_CALL_T
    g = torch.Generator(device=dev).manual_seed(11)
    k, v = (torch.randn(t, shape["kv_heads"], shape["head_dim"], device=dev, dtype=dtype, generator=g)
            .requires_grad_() for _ in range(2))  # fmt: skip
    row = {"case": "varlen pretrain[both]"}
    fn, q = varlen_case(run, row, shape, (k, v), g)
    if fn is None:
        return {"implementation": None, "note": "no FlashAttention varlen here: auto takes the Triton kernels"}
    import attention as attn_bench

    qi, qw, cu = (x.to(dev) for x in attn_bench.make_queries("pretrain", t, shape["window"]))
    out = fn()
    dout = torch.randn(out.shape, device=dev, dtype=out.dtype, generator=g)
    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    r_out = attention_reference(*ref_in, qi, qw, cu)[0]
    errs = max_errors(got, [r_out, *torch.autograd.grad(r_out, ref_in, dout.float())], ["out", "dq", "dk", "dv"])
    bad = {n: e for n, e in errs.items() if not e <= TOL[n]}
    if bad:
        raise AssertionError(f"{row['implementation']} differs from the reference: max rel err {bad}")
    return {"implementation": row["implementation"], "T": t, "max_rel_err": errs}


def probe_cudnn(run: Run) -> dict:
    """cuDNN SDPA fwd+bwd (causal, the kernels item's case) vs SDPA's math backend."""
    if run.dry:
        return {"note": "CPU: no cuDNN SDPA to call"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, d = ATTN_SHAPE["heads"], ATTN_SHAPE["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(1, h, FIRST_CALL_T, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))  # fmt: skip
    got = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        got.append([out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))])
    errs = max_errors(got[0], got[1], ["out", "dq", "dk", "dv"])
    bad = {n: e for n, e in errs.items() if not e <= TOL[n]}
    if bad:
        raise AssertionError(f"cuDNN SDPA differs from the math backend: max rel err {bad}")
    return {"T": FIRST_CALL_T, "max_rel_err": errs}


def start_graph_probe(run: Run) -> None:
    """Start the capture child (``--graph-probe``), tied to this process, its log in the bundle."""
    log = run.logs / "graph_probe.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "orthros_train.common.lifetime", sys.executable, os.path.abspath(__file__),
           "--graph-probe", *(["--rehearse"] if run.dry else [])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as handle:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_environment(env), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    run.state["graph_probe"] = {"proc": proc, "log": log, "started": time.monotonic()}


def graph_fallback(run: Run) -> str | None:
    """Why the decode rows cannot use a CUDA graph (the capture child failed or hung), or None;
    waits for the child up to its limit the first time it is asked."""
    fallback = run.state.setdefault("fallback", {})
    probe = run.state.get("graph_probe")
    if probe is None or "graph" in fallback or probe.get("done"):
        return fallback.get("graph")
    proc, log = probe["proc"], probe["log"]
    try:
        proc.wait(timeout=max(0.0, probe["started"] + GRAPH_PROBE_TIMEOUT_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_child(proc)
        fallback["graph"] = f"the capture child did not finish within {GRAPH_PROBE_TIMEOUT_S} s (hung; killed)"
    probe["done"] = True
    text = log.read_text(errors="replace")
    result = next((json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{")), None)
    if "graph" not in fallback and (proc.returncode != 0 or result is None):
        fallback["graph"] = f"the capture child exited with {proc.returncode}: {log_problem(log)[:300]}"
    elif "graph" not in fallback and not result.get("tokens_equal"):
        fallback["graph"] = f"the captured decode step chose other tokens than eager decode: {result}"
    run.report.setdefault("first_calls", {})["graph"] = result or {"error": fallback.get("graph")}
    return fallback.get("graph")


def graph_probe(dry: bool) -> dict:
    """The child's work: a 2-layer tiny model's decode step captured in a CUDA graph (the rehearsal:
    the same static step without a graph), its greedy tokens against eager decode."""
    from orthros_train.infer.generate import decode
    from orthros_train.infer.static_decode import StaticDecoder
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

    forced_failure("graph")
    dev, dtype = (torch.device("cpu"), torch.float32) if dry else (torch.device("cuda"), torch.bfloat16)
    cfg = OrthrosConfig(**{**tiny_shape(sliding_window=8), "num_hidden_layers": 2})
    model = OrthrosForCausalLM(cfg).to(dev, dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        logits, cache = model.prefill(ids)
        eager_cache = repeated_rows(cache, 1, capacity=16 + 8)
        graph_cache = eager_cache.clone()
        _, eager = _decode_seconds(lambda nxt: decode(model, nxt, eager_cache), logits, 4)
        decoder = StaticDecoder(model, graph_cache, graph=not dry)
        try:
            _, graphed = _decode_seconds(lambda nxt: decoder.step([0], nxt), logits, 4)
        finally:
            decoder.close()
    return {"captured": not dry, "tokens_equal": bool(torch.equal(eager, graphed))}


# ---------------------------------------------------------------------------------------------
# correctness of the kernels against the fp32 reference op
# ---------------------------------------------------------------------------------------------

ATTN_SHAPE = {"heads": 32, "kv_heads": 32, "head_dim": 64, "window": 128}  # the 1.3B's attention
DRY_ATTN_SHAPE = {"heads": 2, "kv_heads": 1, "head_dim": 16, "window": 8}
CORRECT_LAYOUTS = ("pretrain", "sft", "rl", "prefill", "packed")


def correctness_case(layout: str, t: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_index, q_window, cu_seqlens) of a phase's layout: one document for pretrain / sft /
    prefill (bench/attention.py's), several for rl (prompt + response rows, output tokens on the
    responses) and packed (documents of uneven length, output tokens on every third position)."""
    import attention as attn_bench  # bench/attention.py: problems, FLOPs, timing

    from orthros_train.ops.reference import UNBOUNDED

    if layout in attn_bench.LAYOUTS:
        return attn_bench.make_queries(layout, t, w)
    cu = torch.tensor([0, t // 5, t // 2, t - t // 8, t], dtype=torch.int32)
    if layout == "rl":  # the second 60% of each row is the response
        out = torch.cat([torch.arange(int(a + 0.4 * (b - a)), int(b)) for a, b in zip(cu[:-1], cu[1:])])
    else:
        out = torch.arange(0, t, 3)
    qi = torch.cat([torch.arange(t), out])
    qw = torch.cat([torch.full((t,), w), torch.full((out.numel(),), UNBOUNDED)])
    return qi, qw, cu


def max_errors(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    """Max abs error per tensor, relative to the reference tensor's max magnitude."""
    return {
        n: float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp(min=1e-6))
        for n, a, b in zip(names, got, want)
    }


def correctness_item(layout: str) -> Callable:
    """An item: bf16 forward + backward of the Triton kernels on ``layout`` against the fp32
    reference on the same rounded inputs (fp32 and fixed small tiles on the interpreter)."""

    def item(run: Run, sec: dict) -> dict:
        from orthros_train.ops import triton_attention as ta
        from orthros_train.ops.reference import attention_reference

        dev, dtype = _dev_dtype(run)
        shape = DRY_ATTN_SHAPE if run.dry else ATTN_SHAPE
        t = 64 if run.dry else 4096
        g = torch.Generator().manual_seed(CORRECT_LAYOUTS.index(layout))
        qi, qw, cu = (x.to(dev) for x in correctness_case(layout, t, shape["window"]))
        q32 = torch.randn(qi.numel(), shape["heads"], shape["head_dim"], generator=g)
        k32, v32 = (torch.randn(t, shape["kv_heads"], shape["head_dim"], generator=g) for _ in range(2))
        dout = torch.randn(q32.shape, generator=g).to(dev)
        ins = [x.to(dev, dtype).requires_grad_() for x in (q32, k32, v32)]
        blocks = (16, 16) if run.dry else None  # the interpreter: small fixed tiles; a GPU: the autotuned ones
        out, lse = ta.attention_triton(*ins, qi, qw, cu, decode=False, blocks=blocks)
        got = [out, lse, *torch.autograd.grad(out, ins, dout.to(out.dtype))]
        ref_in = [x.detach().float().requires_grad_() for x in ins]  # same rounded inputs, fp32 math
        r_out, r_lse = attention_reference(*ref_in, qi, qw, cu)
        errs = max_errors(got, [r_out, r_lse, *torch.autograd.grad(r_out, ref_in, dout.float())],
                          ["out", "lse", "dq", "dk", "dv"])  # fmt: skip
        row = {"check": f"{layout} fwd+bwd", "T": t, "dtype": str(dtype).split(".")[-1], "max_rel_err": errs,
               "ok": all(errs[n] <= TOL[n] for n in errs)}  # fmt: skip
        sec["rows"].append(row)
        return dict(row)

    return item


def _dev_dtype(run: Run) -> tuple[torch.device, torch.dtype]:
    # the interpreter's bf16 is not the GPU's: fp32 there
    return (torch.device("cpu"), torch.float32) if run.dry else (torch.device("cuda"), torch.bfloat16)


def item_decode(run: Run, sec: dict) -> dict:
    """The decode kernel on ragged cache lengths, one base + one output query per row."""
    from orthros_train.ops.reference import UNBOUNDED, attention_reference
    from orthros_train.ops.triton_decode import decode_attention

    dev, dtype = _dev_dtype(run)
    g = torch.Generator().manual_seed(7)
    lens = [70, 17, 1] if run.dry else [32768, 4099, 1]
    shape = DRY_ATTN_SHAPE if run.dry else ATTN_SHAPE
    heads, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qi = (cu[1:] - 1).long().repeat_interleave(2)
    qw = torch.tensor([shape["window"], UNBOUNDED]).repeat(len(lens))
    n_k = int(cu[-1])
    q, k, v = (torch.randn(n, hh, d, generator=g).to(dev, dtype)
               for n, hh in ((qi.numel(), heads), (n_k, kv), (n_k, kv)))  # fmt: skip
    qi, qw, cu = qi.to(dev), qw.to(dev), cu.to(dev)
    out, lse = decode_attention(q, k, v, qi, qw, cu)
    r_out, r_lse = attention_reference(q.float(), k.float(), v.float(), qi, qw, cu)
    errs = max_errors([out, lse], [r_out, r_lse], ["out", "lse"])
    row = {"check": f"decode ragged {lens}", "dtype": str(dtype).split(".")[-1], "max_rel_err": errs,
           "ok": all(errs[n] <= TOL[n] for n in errs)}  # fmt: skip
    sec["rows"].append(row)
    return dict(row)


def item_fused_tokenwise(run: Run, sec: dict) -> dict:
    """model.fused_tokenwise on vs off: two 1.3B layers and the LM head at 4K tokens, bf16 fwd+bwd
    timed after a warm-up; the kernels' first-call check, the loss difference and the ratio. The
    default is off until this item has timed it: a ratio < 1 says to set model.fused_tokenwise=auto."""
    import copy
    import time

    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.ops.fused_tokenwise import kernel_problem
    from orthros_train.options import FusedTokenwise
    from orthros_train.phase import pretrain_layout

    dev, dtype = _dev_dtype(run)
    cfg = OrthrosConfig(**{**(tiny_shape() if run.dry else shape_1p3b()), "num_hidden_layers": 2})
    eager = OrthrosForCausalLM(cfg).to(dev, dtype)
    fast = copy.deepcopy(eager)
    for model, mode in ((eager, FusedTokenwise.off), (fast, FusedTokenwise.on)):
        for module in model.modules():
            if hasattr(module, "fusion"):
                module.fusion = mode
    ids = torch.randint(0, cfg.vocab_size, (1, 24 if run.dry else 4096), generator=torch.Generator().manual_seed(0))
    layout = pretrain_layout(ids, labels=torch.roll(ids, -1, 1)).to(dev)
    row: dict = {"check": "fused_tokenwise on vs off", "dtype": str(dtype).split(".")[-1],
                 "kernel_problem": kernel_problem(dev, dtype)}
    ms, losses = {}, {}
    for name, model in (("eager", eager), ("fused", fast)):
        times = []
        for _ in range(1 if run.dry else 7):
            _sync()
            start = time.perf_counter()
            loss = model.forward_layout(layout, return_logits=False).loss
            loss.backward()
            _sync()
            times.append(time.perf_counter() - start)
            losses.setdefault(name, float(loss.detach()))
        ms[name] = 1e3 * sorted(times[2:] or times)[len(times[2:] or times) // 2]  # median after the warm-up
    row.update({"eager_ms": ms["eager"], "fused_ms": ms["fused"], "ratio": ms["fused"] / ms["eager"],
                "loss_rel_diff": abs(losses["fused"] - losses["eager"]) / max(abs(losses["eager"]), 1e-6)})
    row["ok"] = row["kernel_problem"] is None and row["loss_rel_diff"] <= (1e-5 if dtype == torch.float32 else 2e-2)
    row["verdict"] = ("set model.fused_tokenwise=auto (fused on CUDA): faster here" if row["ratio"] < 1
                      else "keep model.fused_tokenwise=off: the fused path is not faster here")
    sec["rows"].append(row)
    return dict(row)


def sync_free_item(backend: str) -> Callable:
    def item(run: Run, sec: dict) -> dict:
        row = sync_free_check(_dev_dtype(run)[0], backend, run.dry)
        sec["rows"].append(row)
        return dict(row)

    return item


def sync_free_check(dev: torch.device, backend: str, dry: bool) -> dict:
    """Two layers, forward + backward, under CUDA's sync detector. The layout's attention plan is
    prepared before the watched region and reused, as a training step reuses the batch's plan:
    preparing it (SDPA's segment lengths are host numbers) reads the layout on the host once per
    batch, which is not the per-layer sync this check looks for."""
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.model.orthros import plan_for_layout
    from orthros_train.phase import pretrain_layout

    cfg = OrthrosConfig(**{**(tiny_shape() if dry else shape_1p3b()), "num_hidden_layers": 2,
                           "attention_backend": backend})  # fmt: skip
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
        return {"check": f"2 layers fwd+bwd, backend {backend} (rehearsal: no sync detector on CPU)", "ok": True,
                "error": None}  # fmt: skip
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
# kernel speed
# ---------------------------------------------------------------------------------------------

KERNEL_T = (4096, 16384, 32768)
DRY_KERNEL_T = {4096: 64, 16384: 96, 32768: 128}  # the rehearsal's lengths for the node's
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
            if layout == "pretrain":  # the route GPU ``auto`` takes for it (ops/route.py), side by side
                rows.append({"T": t, "case": f"varlen {layout}[{streams}]", "pairs": pairs})
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


# Below this many ms per call, do_bench's time holds visible host gaps between launches: such a
# case is timed by the profiler's kernel time as well (bench/attention.py fwd_bwd_kernel_ms).
KERNEL_ONLY_BELOW_MS = 1.0


def kernels_item(t: int) -> Callable:
    """An item: every case of the table at sequence length ``t`` (the 1.3B's attention shape);
    the autotuner's choices it made for this length, or that a shorter one's were reused."""

    def item(run: Run, sec: dict) -> dict:
        shape = DRY_ATTN_SHAPE if run.dry else ATTN_SHAPE
        sec["shape"] = {**shape, "dtype": "float32 (interpreter)" if run.dry else "bfloat16"}
        sec["deterministic_bwd_ceiling"] = (
            f"{DETERMINISTIC_BWD_CEILING:.3f}: the deterministic backward does 7 matrix products per tile to "
            "FlashAttention-2's 5 (dq recomputes S and dP), so at equal tensor-core efficiency it reaches 5/7 of "
            "SDPA's backward TFLOP/s counted on 5; the atomic row does 5"
        )
        t_run = DRY_KERNEL_T[t] if run.dry else t
        rows = kernel_plan((t_run,), shape)
        if run.dry and t != KERNEL_T[0]:  # the interpreter is slow: the first length walks every case
            rows = [r for r in rows if r["case"] == "orthros pretrain[output]"]
        sec["rows"] += rows
        known = set(chosen_configs())
        dev, dtype = _dev_dtype(run)
        g = torch.Generator(device=dev).manual_seed(t)
        k, v = (torch.randn(t_run, shape["kv_heads"], shape["head_dim"], device=dev, dtype=dtype, generator=g)
                .requires_grad_() for _ in range(2))  # fmt: skip
        done = 0
        for r in rows:
            if left_s(run) <= 0:
                r["error"] = "not timed: the item's time ran out"
                continue
            if r["case"].startswith("sdpa") and run.dry:
                continue  # flash / cuDNN exist on CUDA only
            call = "varlen" if r["case"].startswith("varlen") else "cudnn" if "cudnn" in r["case"] else None
            if call and (reason := run.state.get("fallback", {}).get(call)):
                r["skipped"] = f"{call} failed its first call ({reason[:160]})"
                continue
            if not case_isolated(run, r, lambda r=r: time_case(run, r, shape, k, v, g)):
                break  # the CUDA context is broken: nothing more can run in this process
            done += 1 if "error" not in r else 0
        sec.setdefault("autotuned_by_T", {})[str(t_run)] = {k_: c for k_, c in chosen_configs().items()
                                                         if k_ not in known} or "no new key: reused"  # fmt: skip
        run.state["kernels_warm"] = True
        if not run.dry:
            torch.cuda.empty_cache()
        _quietly(lambda: plot_kernels(run, sec))
        cut = any(r.get("error", "").startswith("not timed") for r in rows)
        failed = any("error" in r and not r["error"].startswith("not timed") for r in rows)
        skipped = sum(1 for r in rows if "skipped" in r)
        return {"T": t_run, "cases": done, "of": len(rows), **({"skipped": skipped} if skipped else {}),
                **({"status": "partial"} if cut and not failed else {}),
                "ok": None if run.dry else done + skipped == len(rows)}  # fmt: skip

    return item


def case_isolated(run: Run, row: dict, fn: Callable[[], None]) -> bool:
    """Run one case of an item; its exception becomes the row's error and the next case runs (a
    backend that has never run here, cuDNN or torch's varlen, must not take its neighbours' rows
    with it). False when the exception left the CUDA context broken (``cuda_fault``)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - one case's failure is that case's result
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return cuda_fault(run) is None
    return True


def time_case(run: Run, r: dict, shape: dict, k: torch.Tensor, v: torch.Tensor, g: torch.Generator) -> None:
    """Fill one row's forward / backward ms and TFLOP/s (on the interpreter: ran, nothing timed).
    A case whose do_bench time is under ``KERNEL_ONLY_BELOW_MS`` (the small base-stream and 4K
    cases, where launch gaps are a visible part of it) is timed again by the profiler's kernel
    time; the row keeps both and says which one its TFLOP/s use."""
    import attention as attn_bench

    dev, dtype = k.device, k.dtype
    h, d, t = shape["heads"], shape["head_dim"], k.shape[0]
    if r["case"].startswith("varlen"):
        fn, q = varlen_case(run, r, shape, (k, v), g)
        if fn is None:
            return
        inputs = (q, k, v)
    elif r["case"].startswith("sdpa"):
        qs = torch.randn(1, h, t, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        ks, vs = (x.detach().transpose(0, 1).repeat_interleave(h // shape["kv_heads"], 0)[None].requires_grad_()
                  for x in (k, v))  # fmt: skip
        fn, inputs = _sdpa_fn(qs, ks, vs, r["case"].split()[1]), (qs, ks, vs)
    else:
        layout, streams = r["case"].split()[1].rstrip("]").split("[")
        qi, qw, cu = (x.to(dev) for x in attn_bench.make_queries(layout, t, shape["window"], streams))
        q = torch.randn(qi.numel(), h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        fn = attn_bench.orthros_fn(q, k, v, qi, qw, cu, deterministic=not r["case"].endswith("atomic bwd"),
                                   blocks=(16, 16) if run.dry else None)  # fmt: skip
        inputs = (q, k, v)
    f_ms, b_ms = attn_bench.fwd_bwd_ms(fn, inputs, not run.dry, reps=1 if run.dry else 3)
    if run.dry:  # interpreter timings are no measurement
        r["ran"] = True
        return
    r["timing"] = "do_bench"
    if min(f_ms, b_ms) < KERNEL_ONLY_BELOW_MS:
        try:
            kernel = attn_bench.fwd_bwd_kernel_ms(fn, inputs)
        except Exception as exc:  # noqa: BLE001 - the wall-clock figures stand
            r["timing"] = f"do_bench (the profiler failed: {type(exc).__name__}: {str(exc)[:120]})"
        else:
            if all(kernel):
                r.update(wall_fwd_ms=f_ms, wall_bwd_ms=b_ms, timing="profiler kernel time (no launch gaps)")
                f_ms, b_ms = kernel
    r.update(fwd_ms=f_ms, bwd_ms=b_ms, fwd_tflops=r["fwd_gflop"] / f_ms, bwd_tflops=r["bwd_gflop"] / b_ms)


def varlen_case(run: Run, r: dict, shape: dict, kv: tuple[torch.Tensor, torch.Tensor], g: torch.Generator):
    """``(fn, q)`` of a FlashAttention varlen row: the installed implementation on the GPU (the
    plain-torch stand-in in the rehearsal); ``(None, None)`` with the row's error when none is
    installed (torch's own varlen needs a release whose signature takes ``window_size``)."""
    import attention as attn_bench

    from orthros_train.ops.route import VarlenPlan, installed_varlen, varlen_streams, whole_streams
    from orthros_train.ops.sdpa_attention import query_segments

    name = "reference" if run.dry else installed_varlen()
    if name is None:
        r["error"] = "no FlashAttention varlen with window_size on this machine (flash-attn, or a newer torch)"
        return None, None
    layout, streams = r["case"].split()[1].rstrip("]").split("[")
    k, v = kv
    t = k.shape[0]
    qi, qw, cu = attn_bench.make_queries(layout, t, shape["window"], streams)
    segments = query_segments(qi, qw, cu)
    plan = VarlenPlan(name, whole_streams(segments, t, qi.numel()), max(seg.length for seg in segments))
    q = torch.randn(qi.numel(), shape["heads"], shape["head_dim"], device=k.device, dtype=k.dtype,
                    generator=g).requires_grad_()
    r["implementation"] = name
    cu = cu.to(k.device)
    return (lambda: varlen_streams(q, k, v, cu, plan)), q


def chosen_configs() -> dict[str, str]:
    """The configs the autotuners settled on, per kernel, stream class and key."""
    from orthros_train.ops import triton_attention as ta

    out = {}
    for name, tuners in (("fwd", ta._FWD), ("dq", ta._BWD_DQ), ("dkdv", ta._BWD_DKDV)):
        for (cls, bucket), tuner in tuners.items():
            for key, cfg in getattr(tuner, "cache", {}).items():
                out[f"{name}[{cls}, length <= {bucket}] {key}"] = str(cfg)
    return out


def kernel_targets(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["T"], r["case"]): r for r in rows}
    for t in sorted({r["T"] for r in rows}):
        if (t, "orthros pretrain[base]") not in by or (t, "sdpa flash causal") not in by:
            continue  # a rehearsal's shortened length
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
# prefill / decode
# ---------------------------------------------------------------------------------------------

INFER_LAYERS = 4  # the 1.3B shape's width with few layers: a dense 128K prefill of 24 layers is ~1 min
DECODE_STEPS = 32
DECODE_BATCHES = (1, 2)


def inference_item(t: int) -> Callable:
    """An item: time to first token of one ``t``-token prompt, then decode tokens/s of batches of
    such prompts, eager and with the step captured in a CUDA graph (``generate``'s ``cuda_graph``),
    the Orthros model (Triton) beside the dense one (SDPA), ``INFER_LAYERS`` layers of the 1.3B shape."""

    def item(run: Run, sec: dict) -> dict:
        from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

        dev, dtype = _dev_dtype(run)
        prompt = t // 1024 if run.dry else t  # the rehearsal: 16 and 128 tokens
        sec["layers"] = 2 if run.dry else INFER_LAYERS
        shape = tiny_shape(sliding_window=8) if run.dry else shape_1p3b()
        for kind, backend in (("orthros", "triton"), ("dense", "sdpa")):
            if left_s(run) <= 0:
                break
            cfg = OrthrosConfig(**{**shape, "num_hidden_layers": sec["layers"], "attention_type": kind,
                                   "attention_backend": backend})  # fmt: skip
            model = OrthrosForCausalLM(cfg).to(dev, dtype).eval()
            steps = 2 if run.dry else DECODE_STEPS
            row = {"model": kind, "prompt": prompt}
            sec["rows"].append(row)
            if not case_isolated(run, row, lambda r=row, m=model, n=steps: r.update(prefill_decode(run, m, prompt, n))):
                break
            if run.dry:  # the rehearsal walks the code, its timings mean nothing
                row.update({k: None for k in row if "_per_s" in k or k.endswith("_ms")}, ran=True)
            del model
            if not run.dry:
                torch.cuda.empty_cache()
        by = {r["model"]: r for r in sec["rows"] if r["prompt"] == prompt and "error" not in r}
        o, d = by.get("orthros", {}), by.get("dense", {})
        keys = [(f"{way}_orthros_over_dense_b{b}", f"{way}_tokens_per_s_b{b}")
                for way in ("decode", "graph_decode") for b in DECODE_BATCHES]  # fmt: skip
        ratios = {name: _ratio(o.get(key), d.get(key)) for name, key in keys}
        return {"prompt": prompt, "ttft_dense_over_orthros": _ratio(d.get("ttft_ms"), o.get("ttft_ms")), **ratios,
                "ok": None if run.dry else len(by) == 2}  # fmt: skip

    return item


def prefill_decode(run: Run, model, t: int, steps: int) -> dict:
    """TTFT of one ``t``-token prompt (after an untimed prefill of the same length: the Triton
    autotuners key on the length bucket, so a shorter warm-up would leave this one's autotune in
    the timing); per batch size, decode tokens/s eager, then (every eager row first: a capture
    that fails or hangs costs only its own rows) graph-captured, from copies of that prompt's
    cache; no graph rows where the first_calls capture child failed.
    A batch repeats the prompt rather than prefilling ``b`` of them: a batch's
    packed prefill is another length bucket (another cold autotune, ~40 s at 256K) and its decode
    costs the same. Stops adding batches when the item's time is spent."""
    from orthros_train.infer.generate import decode

    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, t), device=dev)
    row: dict = {}
    with torch.no_grad():
        model.prefill(ids)  # warm-up: this length's autotune and allocations
        _sync()
        t0 = time.perf_counter()
        logits, prompt_cache = model.prefill(ids)
        _sync()
        row["ttft_ms"] = (time.perf_counter() - t0) * 1e3
        caches, eager_tokens = {}, {}
        for b in DECODE_BATCHES:
            if left_s(run) <= 0:
                break
            cache = repeated_rows(prompt_cache, b, capacity=t + steps + 2)
            caches[b] = cache.clone()  # the graph's copy, decoded after every eager row
            first = logits.expand(b, -1)
            eager_s, eager_tokens[b] = _decode_seconds(lambda nxt, c=cache: decode(model, nxt, c), first, steps)
            row[f"decode_tokens_per_s_b{b}"] = b * steps / eager_s
            del cache
        # graph capture last: a capture that fails or hangs costs only these rows
        if caches and (reason := graph_fallback(run)):
            row["graph_skipped"] = f"the capture child failed ({reason[:160]})"
            caches = {}
        for b, graph_cache in caches.items():
            if left_s(run) <= 0:
                break
            graph_s, graph_tokens = _graph_decode_seconds(run, model, graph_cache, logits.expand(b, -1), steps)
            row[f"graph_decode_tokens_per_s_b{b}"] = b * steps / graph_s
            # greedy chains from one cache: the graph's tokens are the eager ones (bf16 ties aside)
            row[f"graph_tokens_equal_b{b}"] = float((graph_tokens == eager_tokens[b]).float().mean())
    return row


def repeated_rows(cache, b: int, capacity: int):
    """A cache of ``b`` rows, each a copy of ``cache``'s one row, with room for ``capacity`` tokens."""
    from orthros_train.model.cache import KVCache

    one = cache.clone(capacity=capacity)
    rows = KVCache(one.num_layers, b, capacity=capacity)
    rows.k = [None if x is None else x.repeat(b, 1, 1) for x in one.k]  # row r: slots [r * C, (r + 1) * C)
    rows.v = [None if x is None else x.repeat(b, 1, 1) for x in one.v]
    rows.set_lengths(one.lengths.repeat(b))
    return rows


def _decode_seconds(step: Callable, logits: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Seconds of ``steps`` greedy steps after one warm-up step, and the tokens chosen ``[steps, B]``."""
    logits = step(logits.argmax(-1))
    tokens = []
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens.append(logits.argmax(-1))
        logits = step(tokens[-1])
    _sync()
    return time.perf_counter() - t0, torch.stack(tokens).cpu()


def _graph_decode_seconds(run: Run, model, cache, logits: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """``_decode_seconds`` of the static step, captured on the node (the first step captures:
    it is the warm-up); the rehearsal runs the same step without a graph."""
    from orthros_train.infer.static_decode import StaticDecoder

    decoder = StaticDecoder(model, cache, graph=not run.dry)
    rows = list(range(cache.num_rows))
    try:
        return _decode_seconds(lambda nxt: decoder.step(rows, nxt), logits, steps)
    finally:
        decoder.close()


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# serving in vLLM with CUDA graphs
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


def item_serving(run: Run, sec: dict) -> dict:
    """Both models in vLLM as users run them (compiled, CUDA graphs on): decode tokens/s of a batch
    at a 1K context and TTFT of one 16K / 128K prompt, the Orthros export beside its dense Llama twin,
    and the Orthros engine's greedy tokens against the project's ``generate``. Needs vLLM (the GPU
    build), which the GPU image lacks: without it the item says so and takes no time."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        sec["status_note"] = "vllm is not installed here: nothing to measure (install vllm, then --sections serving)"
        sec.setdefault("skipped", []).append("vllm not installed")
        return {"status": "skipped", "reason": "vllm not installed"}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    root = run.scratch / "serving"
    shape, export, dense = serving_models(root, run.dry)
    sec["shape"] = {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "sliding_window")}  # fmt: skip
    for name, path in (("orthros", export), ("llama", dense)):
        if left_s(run) < 60:
            sec.setdefault("skipped", []).append(f"{name} engine")
            continue
        try:
            sec["rows"].append(serve_engine(run, name, path, shape, root))
        except Exception as exc:  # noqa: BLE001 - one engine's failure is a result
            sec["errors"].append({"item": f"{name} engine", "error": f"{type(exc).__name__}: {exc}"[:800]})
    by = {r["model"]: r for r in sec["rows"]}
    o, d = by.get("orthros", {}), by.get("llama", {})
    batches, prompts = ((2,), (256,)) if run.dry else (SERVE_DECODE_BATCHES, SERVE_TTFT_PROMPTS)
    sec["ratios"] = {
        **{f"decode_orthros_over_llama_b{b}": _ratio(o.get(f"decode_tok_s_b{b}"), d.get(f"decode_tok_s_b{b}"))
           for b in batches},
        **{f"ttft_llama_over_orthros_{t}": _ratio(d.get(f"ttft_ms_{t}"), o.get(f"ttft_ms_{t}")) for t in prompts},
    }  # fmt: skip
    return {"engines": len(sec["rows"]), "ok": not sec["errors"]}


def serve_engine(run: Run, name: str, path: Path, shape: dict, root: Path) -> dict:
    """One engine: decode tokens/s per batch (and greedy == generate for Orthros), TTFT per prompt."""
    from vllm import LLM, SamplingParams

    dry = run.dry
    batches = (2,) if dry else SERVE_DECODE_BATCHES
    prompt_len, new = (64, 4) if dry else (SERVE_DECODE_PROMPT, SERVE_DECODE_TOKENS)
    ttft_prompts = (256,) if dry else SERVE_TTFT_PROMPTS
    g = torch.Generator().manual_seed(3)
    llm = LLM(model=str(path), dtype="float32" if dry else "bfloat16", max_model_len=max(ttft_prompts) + 64,
              gpu_memory_utilization=0.4, skip_tokenizer_init=True, seed=0, enable_prefix_caching=False,
              enforce_eager=dry)  # fmt: skip
    row = {"model": name, "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    for b in batches:
        if left_s(run) <= 0:
            break
        prompts = _token_prompts(b, prompt_len, shape["vocab_size"], g)
        llm.generate(prompts, greedy, use_tqdm=False)  # warm-up
        _sync()
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        # Decode: the batch's tokens after the first, over the time after the prefill.
        row[f"decode_tok_s_b{b}"] = b * (new - 1) / max(time.perf_counter() - t0 - first, 1e-9)
        if name == "orthros" and b == batches[0]:
            row["greedy_equals_generate"] = greedy_agreement(root, prompts, outs, new, dry)
    for t in ttft_prompts:
        if left_s(run) <= 0:
            break
        llm.generate(_token_prompts(1, t, shape["vocab_size"], g), one, use_tqdm=False)  # warm-up at this length
        _sync()
        t0 = time.perf_counter()
        llm.generate(_token_prompts(1, t, shape["vocab_size"], g), one, use_tqdm=False)
        row[f"ttft_ms_{t}"] = (time.perf_counter() - t0) * 1e3
    llm.llm_engine.engine_core.shutdown()
    del llm
    if dry:  # nothing timed means anything on CPU
        row.update({k: None for k in row if k.startswith(("decode_tok_s", "ttft_ms"))})
    else:
        torch.cuda.empty_cache()
    return row


def _token_prompts(n: int, length: int, vocab: int, g: torch.Generator) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def greedy_agreement(root: Path, prompts: list, outs: list, new: int, dry: bool) -> float:
    from orthros_train.infer.generate import generate
    from orthros_train.model import OrthrosForCausalLM

    model = OrthrosForCausalLM.from_pretrained(root / "orthros").eval()
    model = model.to("cpu" if dry else "cuda", torch.float32 if dry else torch.bfloat16)
    with torch.no_grad():
        want = generate(model, [p["prompt_token_ids"] for p in prompts], max_new_tokens=new).sequences
    got = [list(o.outputs[0].token_ids) for o in outs]
    return sum(a == w for a, w in zip(got, want)) / len(want)


# ---------------------------------------------------------------------------------------------
# the plan: value order
# ---------------------------------------------------------------------------------------------

PLAN: tuple[Item, ...] = (
    Item("preflight", "setup", 5, 0, 0, item_preflight,
         "every module the items import, the kit's wheels at their pins, the corpora the recipes read"),
    Item("first_calls", "setup", 6, 0, 2, item_first_calls,
         "the first call of varlen fwd+bwd (both streams, vs the reference), cuDNN SDPA and a CUDA graph capture "
         "(a child with its own limit), at tiny sizes: a failure routes its items to a fallback, with the reason"),
    Item("train_1p3b", "training", 100, 2, 20, item_train_1p3b,
         "1.3B shape, as many layers as fit at 4K tokens, through the trainer: MFU, tokens/s, peak memory "
         "next to the trainer's own estimate"),
    *(Item(f"kernels_T{t}", "kernels", 50 if t == KERNEL_T[0] else 25, 0, 10, kernels_item(t),
           f"attention TFLOP/s at T={t}: output/base stream, sft, prefill, atomic bwd; SDPA flash and cuDNN")
      for t in KERNEL_T),
    *(Item(f"correct_{layout}", "correctness", 8, 0, 3, correctness_item(layout),
           f"bf16 Triton fwd+bwd vs the fp32 reference, {layout} layout") for layout in CORRECT_LAYOUTS),
    Item("correct_decode", "correctness", 8, 0, 3, item_decode, "the decode kernel, ragged caches up to 32K"),
    *(Item(f"sync_free_{b}", "correctness", 15, 0, 5, sync_free_item(b),
           f"two 1.3B layers fwd+bwd under set_sync_debug_mode('error'), backend {b}") for b in ("triton", "auto")),
    Item("resume", "training", 90, 3, 20, item_resume,
         "gpu_check.yaml with saves; a run killed with SIGKILL after its first save and resumed: bitwise-equal "
         "losses (shared Triton autotune cache)"),
    *(Item(f"ttft_{t // 1024}k", "inference", 40, 0, 10 if t < 65536 else 25, inference_item(t),
           f"prefill TTFT, decode tokens/s eager and CUDA graph (batch 1, 2) at {t // 1024}K, Orthros vs dense, "
           f"{INFER_LAYERS} layers")
      for t in (16384, 131072)),
    Item("fused_tokenwise", "kernels", 15, 0, 5, item_fused_tokenwise,
         "model.fused_tokenwise on vs off, two 1.3B layers + LM head at 4K, bf16 fwd+bwd: the kernels' first-call "
         "check, loss difference, time ratio (>= 1: set the key off)"),
    Item("export_generate", "training", 25, 0, 10, item_export_generate,
         "the reference run's export through transformers: AutoModelForCausalLM + generate"),
    Item("sft_step", "training", 40, 1, 5, one_step_item("sft_tiny_cpu", "one SFT step from the export", True),
         "one SFT step (chatterbot dialogues) from the export"),
    Item("rl_step", "training", 40, 1, 5, one_step_item("rl_tiny_cpu", "one RL step, sampling on the device", False),
         "one RL step, sampling on the trainer's device"),
    Item("serving", "serving", 120, 0, 60, item_serving,
         "vLLM with CUDA graphs: decode tokens/s, TTFT 16K/128K, greedy tokens vs generate (needs vllm)"),
)
SECTIONS = tuple(dict.fromkeys(i.section for i in PLAN))


def run_serving(run: Run) -> None:
    """The serving section alone (tests/serve/test_gpu_check_serving.py, where vLLM is)."""
    start(run, [i for i in PLAN if i.section == "serving"])


# ---------------------------------------------------------------------------------------------
# report: markdown and plots
# ---------------------------------------------------------------------------------------------


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _cell(x) -> str:
    return json.dumps(x, default=str)[:300].replace("|", "/")


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']}, Python {report['python']}, torch {report['torch']}, triton {report['triton']}, "
             f"{report.get('elapsed_s', 0):.0f} s of {report['budget_s']} s"
             + (" — **rehearsal: nothing was measured**" if report["dry_run"] else ""), ""]  # fmt: skip
    if report.get("interrupted"):
        lines += [f"**Interrupted: {report['interrupted']}** (what finished before is below)", ""]
    elif not report.get("complete"):
        lines += ["**Running** (this report is rewritten after every item)", ""]
    lines += ["## Items, in the order they run", "", "| item | status | seconds | result |",
              "| --- | --- | --- | --- |"]  # fmt: skip
    for e in report["items"]:
        shown = e.get("error") or e.get("reason") or {k: v for k, v in (e.get("result") or {}).items()
                                                      if k not in ("item", "check", "ok")}  # fmt: skip
        lines.append(f"| {e['name']} | {e['status']} | {_f(e.get('seconds'), '.1f')} | {_cell(shown)} |")
    lines += ["", f"Costs: {_cell(report.get('costs'))}; Triton cache: {_cell(report.get('triton_cache'))}", ""]
    s = report["sections"]
    lines += _md_kernels(s.get("kernels")) + _md_inference(s.get("inference")) + _md_serving(s.get("serving"))
    lines += ["## Targets", "", "| target | value | goal | met |", "| --- | --- | --- | --- |"]
    for t in report.get("targets", []):
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {_f(t['value'], '.3f')} | {t['goal']} | {met} |")
    lines += [f"\nWhy: {t['why']}" for t in report.get("targets", []) if t.get("why")]
    if report.get("fallback"):
        lines += ["", "## Fallbacks (a first call failed)", ""] + [f"- {k}: {v}" for k, v in report["fallback"].items()]
    if report.get("dropped"):
        lines += ["", "## Dropped for time", ""] + [f"- {d['item']}: {d['reason']}" for d in report["dropped"]]
    errors = [(e["name"], e["error"]) for e in report["items"] if e.get("error")]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {n}: {err}" for n, err in errors]
    return "\n".join(lines) + "\n"


def _md_table(title: str, rows: list[dict], columns: list[tuple[str, Callable[[dict], object]]]) -> list[str]:
    """``title``, then a markdown table with one line per row: ``columns`` are (header, cell of a row)."""
    lines = [title, "", "| " + " | ".join(h for h, _ in columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(f"{cell(r)}" for _, cell in columns) + " |" for r in rows]


def _md_kernels(k: dict | None) -> list[str]:
    if not k or not k.get("rows"):
        return []
    # attention rows (a length T each) in the kernels table; other rows of the section (the fused
    # token-wise check) as lines of their own
    attention = [r for r in k["rows"] if "T" in r]
    lines = _md_table(f"## Kernels ({k.get('shape')})", attention, [
        ("T", lambda r: f"T={r['T']}"), ("case", lambda r: r["case"]),
        ("fwd ms", lambda r: _f(r["fwd_ms"], ".3f")), ("fwd TFLOP/s", lambda r: _f(r["fwd_tflops"], ".1f")),
        ("bwd ms", lambda r: _f(r["bwd_ms"], ".3f")), ("bwd TFLOP/s", lambda r: _f(r["bwd_tflops"], ".1f")),
    ])  # fmt: skip
    lines += ["", *(f"- {r.get('check', 'check')}: " + ", ".join(f"{key} {value}" for key, value in r.items()
                                                            if key != "check")
                     for r in k["rows"] if "T" not in r)]
    if k.get("deterministic_bwd_ceiling"):
        lines += ["", f"Deterministic backward ceiling: {k['deterministic_bwd_ceiling']}."]
    return lines + [""]


def _md_inference(s: dict | None) -> list[str]:
    if not s or not s.get("rows"):
        return []
    return _md_table(f"## Prefill / decode ({s.get('layers')} layers)", s["rows"], [
        ("model", lambda r: r["model"]), ("prompt", lambda r: r["prompt"]),
        ("TTFT ms", lambda r: _f(r.get("ttft_ms"), ".0f")),
        *((f"decode tok/s b{b}, {way}", lambda r, k=f"{key}_tokens_per_s_b{b}": _f(r.get(k), ".1f"))
          for b in DECODE_BATCHES for way, key in (("eager", "decode"), ("CUDA graph", "graph_decode"))),
    ]) + [""]  # fmt: skip


def _md_serving(sv: dict | None) -> list[str]:
    if not sv:
        return []
    lines = [f"## Serving in vLLM ({sv.get('shape')})", ""]
    if sv.get("status_note"):
        lines += [sv["status_note"], ""]
    for r in sv.get("rows", []):
        lines.append(f"- {r['model']}: " + ", ".join(f"{k} {_f(v) if isinstance(v, float) else v}"
                                                   for k, v in r.items() if k != "model"))  # fmt: skip
    lines += [f"- {k}: {_f(v)}" for k, v in sv.get("ratios", {}).items()]
    return lines + [""]


def all_targets(report: dict) -> list[dict]:
    s = report["sections"]
    kernel_rows = s.get("kernels", {}).get("rows") or []
    out = kernel_targets(kernel_rows) if kernel_rows else []
    for r in s.get("training", {}).get("rows", []):
        if r.get("item", "").startswith("1.3B"):
            target = _target("1.3B-shape training MFU (the real trainer)", r.get("mfu"), ">=", "mfu")
            if target["met"] is False:
                target["why"] = mfu_miss(r, kernel_rows, TARGETS["mfu"])
            out.append(target)
    return out


def pretraining_on_triton(route: str | None) -> bool:
    """Whether a trainer's logged route (``cuda: pretraining -> triton; ...``, or ``every layout ->
    triton (model.attention_backend)`` when the backend is forced) runs pretraining on the Triton kernels."""
    parts = (route or "").split(": ", 1)[-1].split("; ")
    return any(p.startswith(("pretraining -> triton", "every layout -> triton")) for p in parts)


def attention_per_step(row: dict, kernel_rows: list[dict]) -> tuple[float, float] | None:
    """(seconds, TFLOP) of the MFU run's attention per step, from the kernels item's 4K rows of the
    route the run took (varlen or the Triton kernels; both streams, fwd + bwd, every layer and
    sequence), or None before those rows are timed."""
    kind = "orthros" if pretraining_on_triton(row.get("attention_route")) else "varlen"
    by = {r["case"]: r for r in kernel_rows if r.get("T") == 4096}
    cases = [by.get(f"{kind} pretrain[{stream}]") for stream in ("output", "base")]
    if not all(c and c.get("fwd_ms") and c.get("bwd_ms") for c in cases):
        return None
    per = row["layers"] * row["tokens_per_step"] // 4096
    return (per * sum(c["fwd_ms"] + c["bwd_ms"] for c in cases) / 1e3,
            per * sum(c["fwd_gflop"] + c["bwd_gflop"] for c in cases) / 1e3)  # fmt: skip


def mfu_miss(row: dict, kernel_rows: list[dict], goal: float) -> str | None:
    """One line: which part of the MFU run's step is furthest over its share of a step at the goal
    (each part's FLOPs at the goal's rate; the optimizer, timed apart, has no model FLOPs)."""
    mfu, tps, tflops = row.get("mfu"), row.get("tokens_per_s"), row.get("model_tflops_per_s")
    if not (mfu and tps and tflops and row.get("tokens_per_step")):
        return None
    step = row["tokens_per_step"] / tps
    flops = tflops * step  # TFLOP per step
    at_goal = step * mfu / goal  # the same FLOPs at the goal's rate
    parts: dict[str, tuple[float, float]] = {}
    if row.get("optimizer_ms"):
        parts["optimizer (timed apart)"] = (row["optimizer_ms"] / 1e3, 0.0)
    attention = attention_per_step(row, kernel_rows)
    if attention:
        parts["attention (4K kernel rows)"] = (attention[0], at_goal * attention[1] / flops)
    rest = "GEMMs + token-wise work" + ("" if attention else " + attention")
    parts[rest] = (step - sum(t for t, _ in parts.values()), at_goal - sum(sh for _, sh in parts.values()))
    order = sorted(parts, key=lambda k: parts[k][1] - parts[k][0])
    return (f"MFU {mfu:.2f} < {goal:.2f}: a step takes {step:.3f} s, {at_goal:.3f} s at {goal:.0%}; "
            + "; ".join(f"{k} {parts[k][0]:.3f} s vs a share of {parts[k][1]:.3f} s" for k in order))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_kernels(run: Run, sec: dict) -> None:
    """gpu_check_kernels.png: fwd / bwd TFLOP/s of every case at each measured T."""
    rows = [r for r in sec["rows"] if r.get("fwd_tflops")]
    if not rows:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, ph in zip(axes, ("fwd", "bwd")):
        for case in dict.fromkeys(r["case"] for r in rows):
            pts = [(r["T"], r[f"{ph}_tflops"]) for r in rows if r["case"] == case and r[f"{ph}_tflops"]]
            ax.plot(*zip(*pts), marker="o", label=case) if pts else None
        ax.set(title=f"{ph} TFLOP/s", xscale="log", xlabel="T")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run.out_dir / "gpu_check_kernels.png", dpi=90)
    plt.close(fig)


def plot_losses(run: Run) -> None:
    """gpu_check_loss.png: the reference run's losses and the resumed run's on top."""
    losses = run.state.get("losses")
    if not losses:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("reference", "-o"), ("resumed", "x")):
        pts = sorted(losses[name].items())
        if pts:
            ax.plot(*zip(*pts), style, label=name)
    ax.set(xlabel="step", ylabel="loss", title="kill -9 + resume vs uninterrupted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run.out_dir / "gpu_check_loss.png", dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def plan_text(items: list[Item], dry: bool) -> str:
    lines = [f"gpu_check plan ({'rehearsal on CPU, tiny sizes' if dry else 'one GPU'}; "
             f"{TOTAL_BUDGET_S} s from the command's start, SIGALRM at +{ALARM_MARGIN_S} s), "
             "in value order:"]  # fmt: skip
    for item in items:
        lines.append(f"  {item.name:<16} <= {item.budget_s:>4.0f} s  {item.what}")
    return "\n".join(lines)


def start(run: Run, items: list[Item]) -> None:
    """Run ``items`` in order with the report kept current (the entry point below and tests)."""
    known = {e["name"] for e in run.report["items"]}
    run.report["items"] += [{"name": i.name, "section": i.section, "status": "pending", "budget_s": i.budget_s}
                            for i in items if i.name not in known]  # fmt: skip
    for item in items:
        section_entry(run, item.section)
    run.write()
    for item in items:
        run_item(run, item)


def triton_cache(scratch: Path) -> None:
    """One on-disk Triton cache for this process and every trainer it starts, autotune results
    included (``TRITON_CACHE_AUTOTUNING``); a TRITON_CACHE_DIR already set (a kept folder) wins."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(scratch / "triton_cache"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help=f"folder for the report: at most {len(OUT_FILES)} files, flat")
    p.add_argument("--rehearse", "--dry-run", dest="rehearse", action="store_true",
                   help="CPU: every item in the node's order at tiny sizes, nothing timed")  # fmt: skip
    p.add_argument("--kit", help="install this kit folder's wheels first (the node: --kit build/gpu_kit)")
    p.add_argument("--scratch", help="working files (default: a new temporary folder)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {list(SECTIONS)}")
    p.add_argument("--items", default="", help="comma-separated item names (default: every item of --sections)")
    args = p.parse_args(argv)
    if args.kit:
        p.error("--kit installs the kit and starts again: give it on the command line (python3 bench/gpu_check.py)")
    for why in (check_out(args.out), args.scratch is not None and check_scratch(args.scratch)):
        if why:
            print(f"gpu_check: error: {why}", file=sys.stderr)
            raise SystemExit(2)
    args.scratch = None if args.scratch is None else Path(args.scratch)
    if not args.rehearse and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --rehearse to walk every item on CPU")
    unknown = sorted(set(filter(None, args.sections.split(","))) - set(SECTIONS))
    unknown += sorted(set(filter(None, args.items.split(","))) - {i.name for i in PLAN})
    if unknown:
        p.error(f"unknown sections or items {unknown}; choose from {list(SECTIONS)} or {[i.name for i in PLAN]}")
    return args


def main(argv: list[str] | None = None) -> int:
    if "--graph-probe" in (sys.argv[1:] if argv is None else argv):  # the capture child (first_calls)
        print(json.dumps(graph_probe(REHEARSE or not torch.cuda.is_available())), flush=True)
        return 0
    args = parse_args(argv)
    chosen = set(filter(None, args.items.split(",")))
    items = [i for i in PLAN if (i.name in chosen if chosen else i.section in args.sections.split(","))]
    run = Run(Path(args.out), args.rehearse, args.scratch)
    triton_cache(run.scratch)
    run.report["triton_cache"] = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")}
    run.report["scratch"] = str(run.scratch)
    if args.rehearse:
        run.deadline = math.inf  # a rehearsal walks every item, however slow the interpreter is
    print(plan_text(items, args.rehearse), flush=True)
    previous = {sig: signal.signal(sig, run.on_signal) for sig in (signal.SIGTERM, signal.SIGALRM)}
    if not args.rehearse:
        signal.alarm(max(1, int(run.left() + ALARM_MARGIN_S)))
    try:
        start(run, items)
        run.report["complete"] = True
        run.write()
        _quietly(run.bundle)
    finally:
        signal.alarm(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(markdown(run.report))
    bad = [e["name"] for e in run.report["items"] if e["status"] in ("failed", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
