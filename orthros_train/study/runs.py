"""How a study owns its folder and its training processes.

* **One owner per ``--out``**: the study takes the trainer's run-directory lock
  (``train/run_lock.py``) on ``--out`` for its whole life; a second study into the same folder is
  refused naming the holder.
* **Runs are kept**: a run directory remembers the command that trains it (``study_run.json``). A
  rerun with the same command reuses a finished run, resumes a partial one (the trainer's
  ``trainer.resume=auto``), and refuses one trained with another command; only ``--overwrite``
  deletes a run to train it again.
* **Signals**: training processes run in their own process group, so a Ctrl-C at the terminal
  reaches the study alone; on SIGINT or SIGTERM the study sends SIGTERM to every child's group (the
  trainer finishes its step and saves a checkpoint), waits for them and exits 130 / 143. A second
  signal kills the children at once. A study killed outright (SIGKILL, the OOM killer) takes its
  trainers with it: they asked the kernel for SIGTERM at their parent's death (``common/lifetime.py``).
* **Failures**: a child that fails is reported in one line naming the run and its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from orthros_train.common.files import write_atomic
from orthros_train.common.lifetime import child_environment
from orthros_train.errors import UserError

SPEC = "study_run.json"  # the command a run directory was started with (written before training)
TIMING = "study_train.json"  # seconds of the last training segment, written when it ends
# What a launch leaves before it trains (Hydra's folder, logs, a killed run's lock): not a run yet.
NOT_A_RUN_YET = {".hydra", "cli.log", "train.log", "run.lock"}
STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StudyInterrupted(Exception):
    """SIGINT/SIGTERM reached the study: its children are being stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class RunFailed(Exception):
    """A training process exited with an error (one line: the run and its log). Neither a bug of
    the study nor a refused input: the run's own log says what went wrong."""


class RunAborted(Exception):
    """A sibling run failed: this one was stopped (its checkpoint saved) and is not reported."""


class _Children:
    """The live training processes, and whether the study is stopping."""

    def __init__(self) -> None:
        # Re-entrant: the signal handler takes it in the main thread, which may already hold it.
        self.lock = threading.RLock()
        self.procs: set[subprocess.Popen] = set()
        self.stopping: int = 0  # the signal that stops the study (0: running)
        self.aborting = False  # a run failed: the others stop, nothing new starts

    def reset(self) -> None:
        self.stopping, self.aborting = 0, False

    def refuse_if_stopping(self) -> None:
        if self.stopping:
            raise StudyInterrupted(self.stopping)
        if self.aborting:
            raise RunAborted()

    def start(self, cmd: list[str], log_file: Any, env: dict[str, str]) -> subprocess.Popen:
        with self.lock:
            self.refuse_if_stopping()
            # process_group=0: its own group, out of the terminal's foreground group, so that the
            # study alone receives Ctrl-C and stops the child (with everything it started) itself.
            # child_environment: the trainer asks the kernel for SIGTERM should this study die unannounced
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_environment(env),
                                    process_group=0)  # fmt: skip
            self.procs.add(proc)
            return proc

    def done(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs.discard(proc)

    def signal_all(self, sig: int) -> None:
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def stop(self, signum: int) -> None:
        """The study stops: children get SIGTERM (a trainer saves), or SIGKILL when already stopping."""
        with self.lock:
            again = bool(self.stopping)
            self.stopping = self.stopping or signum
        self.signal_all(signal.SIGKILL if again else signal.SIGTERM)

    def abort(self) -> None:
        """A run failed: the others save and stop (SIGTERM), unless a signal already stopped them."""
        with self.lock:
            already = self.stopping or self.aborting
            self.aborting = True
        if not already:
            self.signal_all(signal.SIGTERM)

    def wait_all(self) -> None:
        while True:
            with self.lock:
                procs = list(self.procs)
            if not procs:
                return
            for proc in procs:
                proc.wait()
                self.done(proc)


CHILDREN = _Children()


def _lock_holder(out: Path) -> str:
    try:
        owner = json.loads((out / "run.lock").read_text())
        return f"host {owner['host']}, pid {owner['pid']}, started {owner['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"lock {out / 'run.lock'}"


@contextlib.contextmanager
def owned_study(out: Path, what: str) -> Iterator[None]:
    """Hold ``out`` for the study's life, with SIGINT/SIGTERM stopping its children.

    Raises ``UserError`` (one line) when another live study holds ``out``; inside, a stop signal
    raises ``StudyInterrupted`` in the main thread after the children were sent SIGTERM."""
    from orthros_train.train.run_lock import RunLock, RunLockedError

    if Path(out).exists() and not Path(out).is_dir():  # named as the flag the user gave, not as a run_dir
        raise UserError(f"--out {out} is a file, not a directory: pick another --out")
    lock = RunLock(out)
    try:
        lock.acquire()
    except RunLockedError as exc:
        raise UserError(f"--out {out} is in use by another {what} ({_lock_holder(Path(out))}); wait for it, "
                         "stop it, or pick another --out") from exc
    CHILDREN.reset()

    def on_signal(signum: int, frame: Any) -> None:
        first = not CHILDREN.stopping
        CHILDREN.stop(signum)
        if first:  # the second signal only hurries the children (SIGKILL); the first unwinds the study
            raise StudyInterrupted(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_EXIT} if main else {}
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        yield
    except BaseException:
        CHILDREN.abort()  # no child outlives the study
        CHILDREN.wait_all()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.release()


def interrupted_exit(prog: str, exc: StudyInterrupted, out: Path) -> int:
    """The one line a stopped study prints, and its exit status (130 after Ctrl-C, 143 after SIGTERM)."""
    import sys

    name = "Ctrl-C" if exc.signum == signal.SIGINT else signal.Signals(exc.signum).name
    print(f"{prog}: stopped by {name}; its training processes stopped, each keeping the checkpoints it had saved; "
          f"rerun the same command to resume the runs in {out}", file=sys.stderr)
    return STOP_EXIT.get(exc.signum, 128 + exc.signum)


def run_parallel(fn: Callable[..., Any], jobs: Sequence[tuple], workers: int) -> list[Any]:
    """``fn(*job)`` for every job, ``workers`` at a time; the first failure stops the others (their
    children get SIGTERM and save) and is raised."""
    CHILDREN.aborting = False
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(fn, *job) for job in jobs]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception()), None)
                if failed is not None:
                    raise failed.exception()
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                CHILDREN.abort()
                raise
    finally:
        # The pool has joined: its siblings are stopped. A later run in this process (the next
        # stage, or the next study in one interpreter) must not inherit the abort.
        CHILDREN.aborting = False


# -- one run --------------------------------------------------------------------------------------


def _overrides_of(command: Sequence[str]) -> dict[str, str]:
    return dict(a.lstrip("+").split("=", 1) for a in command if "=" in a and not a.startswith("-"))


def _difference(old: Sequence[str], new: Sequence[str]) -> str:
    a, b = _overrides_of(old), _overrides_of(new)
    diffs = [f"{k}: {a.get(k, '<unset>')} there, {b.get(k, '<unset>')} now"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if not diffs:
        return "another recipe" if list(old) != list(new) else "the same command"
    return "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")


def recorded_command(run_dir: Path) -> list[str] | None:
    """The command a study started ``run_dir`` with (studies before ``study_run.json``: the finished
    run's ``study_train.json``)."""
    for name in (SPEC, TIMING):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return list(json.loads((Path(run_dir) / name).read_text())["command"])
    return None


def run_state(run_dir: Path, command: Sequence[str]) -> str:
    """``new``, ``finished`` or ``partial`` for a run directory this ``command`` would train;
    ``ValueError`` naming it when it holds something else."""
    from orthros_train.train.run_dir import completed_checkpoint

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} <= NOT_A_RUN_YET:
        return "new"
    recorded = recorded_command(run_dir)
    if recorded is None:
        raise UserError(f"{run_dir} exists and is not a study run directory; pick another --out")
    if recorded != list(command):
        raise UserError(f"{run_dir} holds a run of another configuration ({_difference(recorded, command)}); "
                         "pass --overwrite to train it again, or pick another --out")
    try:
        max_steps = int(json.loads((run_dir / "recipe.json").read_text())["trainer"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return "partial"  # killed before the trainer wrote its recipe: train (it starts afresh)
    done = completed_checkpoint(run_dir, max_steps)
    return "finished" if done is not None and (run_dir / "checkpoints" / "final" / "config.json").is_file() \
        else "partial"


def _failure_line(run_dir: Path, returncode: int) -> str:
    """The run, its exit status, the log's last error line and the log's path, in one line."""
    log = Path(run_dir) / "train.log"
    last = ""
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln or ln.startswith("orthros-train")),
                    lines[-1] if lines else "")
    what = f": {last[:1500]}" if last else ""  # the trainer's refusals name keys and fixes: keep them whole
    return f"training run {run_dir} failed (exit {returncode}{what}); its log: {log}"


def launch(cmd: list[str], run_dir: Path, threads: int | None, stop_after_s: float | None,
           log: Callable[[str], None]) -> float:
    """Run the trainer ``cmd`` (its output appended to ``train.log``) as a stoppable child; seconds."""
    env = os.environ.copy()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with (Path(run_dir) / "train.log").open("a") as fh:
        proc = CHILDREN.start(cmd, fh, env)
        try:
            try:
                proc.wait(timeout=stop_after_s)
            except subprocess.TimeoutExpired:
                log(f"train {run_dir}: {stop_after_s / 60:.1f} min budget spent, stopping after this step (SIGTERM)")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
        finally:
            CHILDREN.done(proc)
    CHILDREN.refuse_if_stopping()  # stopped by a signal or a sibling's failure: not this run's result
    if proc.returncode != 0:
        raise RunFailed(_failure_line(run_dir, proc.returncode))
    return time.perf_counter() - start


def refuse_symlink(path: Path, what: str) -> None:
    """--overwrite deletes nothing through a symbolic link: that would delete outside --out."""
    if path.is_symlink():
        raise UserError(
            f"--overwrite: the {what} {path} is a symbolic link (to {os.readlink(path)}); the study does not delete "
            "through a link, which would remove files outside --out: remove the link yourself, or pick another --out"
        )


def train_or_reuse(cmd: list[str], run_dir: Path, log: Callable[[str], None], threads: int | None = 1,
                   stop_after_s: float | None = None, overwrite: bool = False) -> float:
    """Reuse a finished run of ``cmd`` in ``run_dir``, resume a partial one, or train a new one
    (``overwrite``: delete what is there first); returns the training seconds (recorded ones for
    a reused run)."""
    run_dir = Path(run_dir)
    if overwrite:
        refuse_symlink(run_dir, "run directory")
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)
    state = run_state(run_dir, cmd[1:])
    if state == "finished":
        log(f"reuse {run_dir}: finished with the same command")
        with contextlib.suppress(OSError, ValueError, KeyError):
            return float(json.loads((run_dir / TIMING).read_text())["seconds"])
        return 0.0
    run_dir.mkdir(parents=True, exist_ok=True)
    if state == "new":
        (run_dir / SPEC).write_text(json.dumps({"command": cmd[1:]}) + "\n")
    log(f"{'resume' if state == 'partial' else 'train'} {run_dir}: {' '.join(cmd[1:])}")
    seconds = launch(cmd, run_dir, threads, stop_after_s, log)
    log(f"train {run_dir}: done in {seconds / 60:.1f} min")
    (run_dir / TIMING).write_text(json.dumps({"seconds": seconds, "command": cmd[1:]}) + "\n")
    return seconds


def write_text_atomic(path: Path, text: str) -> Path:
    """A report appears whole or not at all (``common.files.write_atomic``; its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, text, durable=False)


def remove_stale(paths: Sequence[Path], log: Callable[[str], None]) -> None:
    """--overwrite: the reports of the study being replaced go before any run is retrained."""
    for path in map(Path, paths):
        refuse_symlink(path, "report")
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        log(f"--overwrite: removed the previous report {path}")
