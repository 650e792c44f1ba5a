"""The one lock of the project: a lock file with a heartbeat, correct on NFS, Lustre and GPFS.

Run directories (``train/run_lock.py``) and data caches (``data/cache.py``) both live on file
systems shared by the nodes of a job and of other jobs. ``flock``/``fcntl`` locks are node-local
or unsupported there depending on the mount options (Lustre without ``-o flock``, GPFS in some
modes, NFS without lockd), and ``O_CREAT | O_EXCL`` is not atomic on NFSv2/v3 clients. So the lock
is a file created in one atomic step everywhere: the holder's details are written to a private
file (named per host, process and acquisition), which is then hard-linked to the lock's name.
``link()`` fails when the name exists, on every NFS version too; a reply lost on the wire is caught
by the private file's link count (2: the link was made), the classic recipe of
``lockfile``/``flufl.lock``. The content is complete before the link makes it the lock, so a
reader never sees half of it.

The holder refreshes the file's modification time every ``heartbeat`` seconds from a daemon
thread, and notices (``lost``) when the file has become another holder's. A holder is *stale*
when it is a process of this host that is gone, when its scheduler job is the caller's own (a
requeued Slurm job), or when its heartbeat is older than ``stale_after``: the file's age by this
host's clock, or (for a waiter) how long the waiter has watched the file's mtime stand still by
its own monotonic clock, whichever is larger; the second needs no clock agreement between nodes.
Keep ``stale_after`` well above ``heartbeat`` and the clock skew between nodes.

A stale lock is taken over by renaming it aside (one atomic step only one contender wins), then
checking that what moved is the lock judged stale (same inode, mtime and token); when it is not
(a successor took the name meanwhile) it is linked back. Release removes the file only while it
is still this holder's.

Imports nothing of the project but ``errors``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import stat as stat_module
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

_log = logging.getLogger(__name__)


class LockBusy(Exception):
    """A live holder kept the lock (at once, or for the whole waiting time)."""

    def __init__(self, message: str, holder: LockOwner | None = None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass
class LockOwner:
    """Who holds a lock (the lock file's content)."""

    host: str
    pid: int
    started: str  # ISO time the holder took the lock
    token: str  # unique per acquisition: tells this holder's file from a successor's
    job_id: str | None = None  # the scheduler job (a requeued job takes its own lock over)

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, started {self.started}"


def read_owner(path: str | Path) -> LockOwner | None:
    """The owner a lock file names, or None when it is gone or unreadable. ``started`` written as
    seconds since the epoch (older lock files) is read as an ISO time."""
    try:
        data = json.loads(_read_regular(path))
        started = data.get("started")
        if isinstance(started, (int, float)) and not isinstance(started, bool):
            started = datetime.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")
        return LockOwner(host=data["host"], pid=data["pid"], started=str(started), token=str(data.get("token")),
                         job_id=data.get("job_id"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return None


def _read_regular(path: str | Path, limit: int = 1 << 16) -> bytes:
    """The bytes of a lock file; ``OSError`` for anything but a regular file (a FIFO at the lock's
    name would block a plain read forever, a directory or a device is no lock file either)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host exists (True when that cannot be told)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):  # someone else's, or not a pid
        return True
    return True


_Lock = TypeVar("_Lock", bound="HeartbeatLock")


class HeartbeatLock:
    """An exclusive lock file at ``path`` with a heartbeat, held from ``acquire`` to ``release``
    (a context manager too). The module docstring gives the protocol.

    ``stale_after``: seconds without a heartbeat after which a holder counts as dead;
    ``heartbeat``: how often the holder touches its file (default ``stale_after / 6``);
    ``job_id``: the caller's scheduler job (a lock of the same job is its own, requeued);
    ``timeout``: ``acquire`` waits at most this long for a live holder (None: forever; 0: not at
    all); ``poll``: seconds between looks while waiting; ``log``: the logger that reports
    takeovers and waits (the caller's, so its name says which lock).

    Subclasses adapt the messages: ``busy`` (the exception for a live holder), ``cannot_write``
    (for an ``OSError`` creating the file), ``reclaim_reason`` (more holders that count as dead,
    e.g. this very process) and ``holder_noun`` (what a holder is called in the log).
    """

    holder_noun = "holder"

    def __init__(self, path: str | Path, *, stale_after: float = 120.0, heartbeat: float | None = None,
                 job_id: str | None = None, timeout: float | None = None, poll: float = 0.2,
                 log: logging.Logger | None = None) -> None:
        self.path = Path(path)
        self.stale_after = float(stale_after)
        self.heartbeat = float(heartbeat) if heartbeat is not None else max(0.05, self.stale_after / 6)
        if self.stale_after <= self.heartbeat:
            raise ValueError(f"stale_after={stale_after} must exceed heartbeat={self.heartbeat}")
        self.job_id = job_id or None
        self.timeout = timeout
        self.poll = poll
        self.log = log or _log
        self.owner: LockOwner | None = None
        self.lost = threading.Event()  # set when the heartbeat finds another holder's file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- hooks for the callers' messages ---------------------------------------------------------
    def busy(self, holder: LockOwner | None, waited: float) -> Exception:
        """The exception ``acquire`` raises when a live holder keeps the lock."""
        who = holder.describe() if holder else "an unreadable lock file"
        return LockBusy(f"{self.path} is held by {who}" + (f" after {waited:.0f} s" if waited else ""), holder)

    def cannot_write(self, exc: OSError) -> Exception:
        """The exception for a lock file (or its folder) that cannot be created."""
        return exc

    def reclaim_reason(self, holder: LockOwner) -> str | None:
        """Why ``holder`` counts as dead beyond the rules every lock has (None: it does not)."""
        return None

    # -- acquire / release ----------------------------------------------------------------------
    def holder(self) -> LockOwner | None:
        """The current holder, as its file names it (None: no lock, or an unreadable one)."""
        return read_owner(self.path)

    def stale_reason(self, holder: LockOwner | None, watched: float = 0.0) -> str | None:
        """Why ``holder`` (None: an unreadable file) is dead, or None when it may be alive.
        ``watched``: seconds this caller has seen the file's mtime stand still."""
        here = socket.gethostname()
        if holder is not None:
            reason = self.reclaim_reason(holder)
            if reason:
                return reason
            if self.job_id and holder.job_id == self.job_id:
                return f"it belongs to this Slurm job {self.job_id} (requeued)"
            if holder.host == here and holder.pid != os.getpid() and not pid_alive(holder.pid):
                return f"its process {holder.pid} on this host is gone"
        age = max(self._age() or 0.0, watched)
        if age > self.stale_after:
            return f"its heartbeat is {age:.0f} s old (stale after {self.stale_after:.0f} s)"
        return None

    def acquire(self) -> None:
        """Take the lock, taking a stale one over; wait for a live holder up to ``timeout``, then
        raise ``busy``."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self.cannot_write(exc) from exc
        owner = LockOwner(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            token=uuid.uuid4().hex,
            job_id=self.job_id,
        )
        start = time.monotonic()
        seen: tuple[Any, float] | None = None  # (the file's identity, when this caller first saw it)
        announced = False
        while not self._link(owner):
            stat = self._stat()
            if stat is None:
                continue  # released between our link and stat: try again at once
            now = time.monotonic()
            identity = (stat.st_ino, stat.st_mtime_ns)
            if seen is None or seen[0] != identity:
                seen = (identity, now)
            holder = self.holder()
            reason = self.stale_reason(holder, watched=now - seen[1])
            if reason is not None:
                self._take_over(holder, stat, reason)
                seen = None
                continue
            waited = now - start
            if self.timeout is not None and waited >= self.timeout:
                raise self.busy(holder, waited)
            if not announced:
                self.log.info("waiting for %s, held by %s", self.path, holder.describe() if holder else "?")
                announced = True
            time.sleep(self.poll)
        self.owner = owner
        self.lost.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat {self.path}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self.owner is None:
            return
        current = self.holder()
        if current is not None and current.token == self.owner.token:
            with contextlib.suppress(OSError):
                self.path.unlink()
        elif not self.lost.is_set():
            self.log.warning("the lock %s was taken over while held (now: %s)", self.path,
                             current.describe() if current else "no lock")
        self.owner = None

    def __enter__(self: _Lock) -> _Lock:  # the subclass's own type: ``with RunLock(...) as lock``
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- internals ------------------------------------------------------------------------------
    def _link(self, owner: LockOwner) -> bool:
        """Publish ``owner`` as the lock with one atomic link(); False when a lock exists."""
        private = self.path.with_name(f".{self.path.name}.{owner.host}.{owner.pid}.{owner.token}")
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
            raise self.cannot_write(exc) from exc
        finally:
            with contextlib.suppress(OSError):
                private.unlink()

    def _stat(self) -> os.stat_result | None:
        """The lock name's own status (``lstat``: a dangling or looping symlink at the name is a
        lock that exists, not one released a moment ago, which ``acquire`` would retry at once)."""
        try:
            return os.lstat(self.path)
        except OSError:
            return None

    def _age(self) -> float | None:
        stat = self._stat()
        return None if stat is None else time.time() - stat.st_mtime

    def _take_over(self, holder: LockOwner | None, judged: os.stat_result, reason: str) -> None:
        """Move the stale lock aside; if what moved is not the lock judged stale (a heartbeat or a
        successor came meanwhile), put it back."""
        aside = self.path.with_name(f".{self.path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved or released it: look again
        except OSError as exc:
            raise self.cannot_write(exc) from exc
        moved, stat = read_owner(aside), None
        with contextlib.suppress(OSError):
            stat = os.lstat(aside)
        same = (stat is not None and (stat.st_ino, stat.st_mtime_ns) == (judged.st_ino, judged.st_mtime_ns)
                and (moved.token if moved else None) == (holder.token if holder else None))
        if not same:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # restore the live lock (fails if yet another took the name)
        else:
            who = holder.describe() if holder is not None else "an unreadable lock file"
            self.log.warning("taking over the lock %s held by %s (%s)", self.path, who, reason)
        try:
            aside.unlink()
        except FileNotFoundError:
            pass
        except OSError:  # a directory (or other non-file) stood at the lock's name: keep it, and say where
            self.log.warning("what stood at the lock's name %s was not a lock file; it is kept as %s",
                             self.path, aside)  # fmt: skip

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            owner = self.owner
            if owner is None:
                return
            current = self.holder()
            if current is not None and current.token != owner.token and current.pid == os.getpid() \
                    and current.host == owner.host:
                return  # a later holder in this same process took the lock over (it knows)
            if current is None or current.token != owner.token:
                self.log.error("the lock %s is no longer this %s's (now: %s); another process took it over",
                               self.path, self.holder_noun, current.describe() if current else "no lock")
                self.lost.set()
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)
