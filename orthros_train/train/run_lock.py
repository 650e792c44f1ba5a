"""One owner per run directory: a lock file held for the run's life.

Two launches into one ``trainer.run_dir`` (a duplicated or requeued job, a second terminal)
would interleave ``metrics.jsonl`` and break each other's checkpoints. The first launch takes
``<run_dir>/run.lock``; a second one is refused naming the holder.

``flock``/``fcntl`` locks are node-local on several cluster file systems (Lustre without
``-o flock``, GPFS in some modes, NFS without lockd), so they would not stop a second node. The
lock is instead the file itself, created atomically: the owner's details are written to a
private file, which is then hard-linked to ``run.lock``. ``link()`` fails when the target exists,
and unlike ``O_CREAT|O_EXCL`` it is atomic on old NFS too; a lost reply is caught by checking the
private file's link count (the classic NFS-safe recipe, as in ``lockfile``/``flufl.lock``).
fcntl-based libraries (``filelock``) are ruled out for the reason above.

A lock left by a process that died without releasing it (``kill -9``, a lost node) is taken over
with a warning when it is *stale*: its holder is on this host and its pid is gone, or its
heartbeat (the file's modification time, touched every ``heartbeat_s`` by a thread) is older
than ``stale_after_s``. A job requeued by Slurm takes its own lock over at once (same
``SLURM_JOB_ID``, passed in by the entry point). Taking over renames the stale file away (an
atomic step only one contender wins) and checks that what it moved is the lock it judged.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orthros_train.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunLockedError(UserError):
    """Another live process owns the run directory."""


@dataclass
class LockOwner:
    """Who holds a run directory (the lock file's content)."""

    host: str
    pid: int
    started: str  # ISO time the holder took the lock
    token: str  # unique per acquisition: tells this holder's file from a successor's
    job_id: str | None = None  # the Slurm job (a requeued job takes its own lock over)

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, started {self.started}"


def _read_owner(path: Path) -> LockOwner | None:
    """The lock's owner, or None when the file is gone or unreadable (a half-written one never is
    visible: the content is written before the link makes it the lock)."""
    try:
        data = json.loads(path.read_text())
        return LockOwner(**{k: data.get(k) for k in ("host", "pid", "started", "token", "job_id")})
    except (OSError, ValueError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """``<run_dir>/run.lock``, held from ``acquire`` to ``release`` (a context manager too).

    ``job_id``: this launch's scheduler job id (``SLURM_JOB_ID``, read by the entry point);
    ``heartbeat_s``: how often the holder touches the file; ``stale_after_s``: a heartbeat older
    than this marks a holder on another host as dead (keep it well above ``heartbeat_s`` and the
    clock skew between nodes)."""

    def __init__(
        self,
        run_dir: str | Path,
        job_id: str | None = None,
        heartbeat_s: float = 30.0,
        stale_after_s: float = 600.0,
    ) -> None:
        if stale_after_s <= heartbeat_s:
            raise UserError(f"stale_after_s={stale_after_s} must exceed heartbeat_s={heartbeat_s}")
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.job_id = job_id or None
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.owner: LockOwner | None = None
        self.lost = threading.Event()  # set when the heartbeat finds another owner's file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquire / release ----------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lock or raise ``RunLockedError`` naming the live holder; ``ValueError`` when
        the directory cannot be written."""
        self._make_dir()
        owner = LockOwner(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            token=uuid.uuid4().hex,
            job_id=self.job_id,
        )
        for _ in range(5):  # a contender may release or take over between our steps: look again
            if self._link(owner):
                self.owner = owner
                self._start_heartbeat()
                return
            holder = _read_owner(self.path)
            if holder is None:
                if not self.path.exists():
                    continue  # released meanwhile
                holder_age = self._age()
                if holder_age is not None and holder_age < self.stale_after_s:
                    raise RunLockedError(
                        f"trainer.run_dir={self.run_dir} is locked by {self.path}, which cannot be read; "
                        "if no run is using the directory, delete the file"
                    )
                self._take_over(None, "an unreadable lock file with an old heartbeat")
                continue
            reason = self._stale_reason(holder)
            if reason is None:
                raise RunLockedError(
                    f"trainer.run_dir={self.run_dir} is in use by another run ({holder.describe()}; "
                    f"lock {self.path}). Wait for it to finish, stop it, or pick another trainer.run_dir"
                )
            self._take_over(holder, reason)
        raise RunLockedError(f"could not take {self.path}: other launches keep taking it; try again")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self.owner is not None:
            current = _read_owner(self.path)
            if current is not None and current.token == self.owner.token:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            self.owner = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- internals ------------------------------------------------------------------------------
    def _make_dir(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".write-test-{uuid.uuid4().hex}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise UserError(
                f"trainer.run_dir={self.run_dir} cannot be written ({exc.strerror or exc}): pick a directory "
                "you can write (trainer.run_dir=...), or fix its permissions"
            ) from exc

    def _link(self, owner: LockOwner) -> bool:
        """Publish ``owner`` as the lock with one atomic link(); False when a lock exists."""
        private = self.run_dir / f".{LOCK_NAME}.{owner.host}.{owner.pid}.{owner.token}"
        try:
            private.write_text(json.dumps(asdict(owner)))
            try:
                os.link(private, self.path)
                return True
            except FileExistsError:
                return False
            except OSError:
                # NFS: the link may have been made though the reply was lost; the link count says.
                return os.stat(private).st_nlink == 2
        except OSError as exc:
            raise UserError(
                f"trainer.run_dir={self.run_dir}: cannot create the run lock {self.path} ({exc.strerror or exc})"
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                private.unlink()

    def _age(self) -> float | None:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except OSError:
            return None

    def _stale_reason(self, holder: LockOwner) -> str | None:
        """Why ``holder`` is dead (None: it may be alive)."""
        if holder.host == socket.gethostname() and holder.pid == os.getpid():
            return "this process took it earlier (a trainer it built before)"
        if self.job_id and holder.job_id == self.job_id:
            return f"it belongs to this Slurm job {self.job_id} (requeued)"
        if holder.host == socket.gethostname() and isinstance(holder.pid, int) and not _pid_alive(holder.pid):
            return f"its process {holder.pid} on this host is gone"
        age = self._age()
        if age is not None and age > self.stale_after_s:
            return f"its heartbeat is {age:.0f} s old (stale after {self.stale_after_s:.0f} s)"
        return None

    def _take_over(self, holder: LockOwner | None, reason: str) -> None:
        """Move the stale lock aside; if what moved is not the lock judged stale (a contender
        replaced it meanwhile), put it back."""
        aside = self.run_dir / f".{LOCK_NAME}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved or released it: try again
        except OSError as exc:
            raise UserError(f"cannot take over the stale lock {self.path} ({exc.strerror or exc})") from exc
        moved = _read_owner(aside)
        if holder is not None and (moved is None or moved.token != holder.token):
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # restore the live lock (fails if yet another took it)
            with contextlib.suppress(OSError):
                aside.unlink()
            return
        with contextlib.suppress(OSError):
            aside.unlink()
        who = holder.describe() if holder is not None else "unknown holder"
        log.warning("taking over the lock of %s from a dead run (%s): %s", self.run_dir, who, reason)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            owner = self.owner
            if owner is None:
                return
            current = _read_owner(self.path)
            if current is not None and current.token != owner.token and current.pid == os.getpid():
                return  # a later trainer of this same process took the directory over
            if current is None or current.token != owner.token:
                log.error(
                    "the lock of %s is no longer this run's (now: %s); another launch took the directory over",
                    self.run_dir,
                    current.describe() if current else "no lock",
                )
                self.lost.set()
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)


def held_by_another(run_dir: str | Path, job_id: str | None = None) -> LockOwner | None:
    """The live owner of ``run_dir``'s lock other than this process (or this Slurm job), if any.

    Read only: lets the entry point keep a launch that is about to be refused out of a live run's
    directory (Hydra writes its ``.hydra/`` and log there before the trainer asks for the lock)."""
    probe = RunLock(run_dir, job_id=job_id)
    holder = _read_owner(probe.path)
    if holder is None:
        return None
    return None if probe._stale_reason(holder) else holder
