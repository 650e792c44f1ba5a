"""One owner per run directory: a lock file held for the run's life.

Two launches into one ``trainer.run_dir`` (a duplicated or requeued job, a second terminal)
would interleave ``metrics.jsonl`` and break each other's checkpoints. The first launch takes
``<run_dir>/run.lock``; a second one is refused naming the holder.

The lock is ``common.lock.HeartbeatLock`` (a hard-linked lock file with a heartbeat, correct on
NFS, Lustre and GPFS, where ``flock`` would not stop a second node; its docstring gives the
protocol), taken without waiting: a live holder is refused at once. A lock left by a process that
died without releasing it (``kill -9``, a lost node) is taken over with a warning when it is
stale: its holder is on this host and its pid is gone, or its heartbeat is older than
``stale_after_s``. A job requeued by Slurm takes its own lock over at once (same
``SLURM_JOB_ID``, passed in by the entry point), and so does a later trainer of this same process.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

from orthros_train.common.lock import HeartbeatLock, LockOwner, read_owner
from orthros_train.errors import UserError

__all__ = ["LOCK_NAME", "LockOwner", "RunLock", "RunLockedError", "held_by_another"]

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunLockedError(UserError):
    """Another live process owns the run directory."""


class RunLock(HeartbeatLock):
    """``<run_dir>/run.lock``, held from ``acquire`` to ``release`` (a context manager too).

    ``job_id``: this launch's scheduler job id (``SLURM_JOB_ID``, read by the entry point);
    ``heartbeat_s``: how often the holder touches the file; ``stale_after_s``: a heartbeat older
    than this marks a holder on another host as dead (keep it well above ``heartbeat_s`` and the
    clock skew between nodes)."""

    holder_noun = "run"

    def __init__(
        self,
        run_dir: str | Path,
        job_id: str | None = None,
        heartbeat_s: float = 30.0,
        stale_after_s: float = 600.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        super().__init__(self.run_dir / LOCK_NAME, stale_after=stale_after_s, heartbeat=heartbeat_s, job_id=job_id,
                         timeout=0, log=log)

    def acquire(self) -> None:
        """Take the lock or raise ``RunLockedError`` naming the live holder; ``UserError`` when
        the directory cannot be written."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"trainer.run_dir={self.run_dir} is a file, not a directory: pick another trainer.run_dir")
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
        super().acquire()

    def busy(self, holder: LockOwner | None, waited: float) -> Exception:
        if holder is None:
            return RunLockedError(
                f"trainer.run_dir={self.run_dir} is locked by {self.path}, which is not a readable lock file; "
                f"if no run is using the directory, delete it (rm -r {self.path})"
            )
        return RunLockedError(
            f"trainer.run_dir={self.run_dir} is in use by another run ({holder.describe()}; "
            f"lock {self.path}). Wait for it to finish, stop it, or pick another trainer.run_dir"
        )

    def cannot_write(self, exc: OSError) -> Exception:
        return UserError(
            f"trainer.run_dir={self.run_dir}: cannot create the run lock {self.path} ({exc.strerror or exc})"
        )

    def reclaim_reason(self, holder: LockOwner) -> str | None:
        if holder.host == socket.gethostname() and holder.pid == os.getpid():
            return "this process took it earlier (a trainer it built before)"
        return None


def held_by_another(run_dir: str | Path, job_id: str | None = None) -> LockOwner | None:
    """The live owner of ``run_dir``'s lock other than this process (or this Slurm job), if any.

    Read only: lets the entry point keep a launch that is about to be refused out of a live run's
    directory (Hydra writes its ``.hydra/`` and log there before the trainer asks for the lock)."""
    probe = RunLock(run_dir, job_id=job_id)
    holder = read_owner(probe.path)
    if holder is None:
        return None
    return None if probe.stale_reason(holder) else holder
