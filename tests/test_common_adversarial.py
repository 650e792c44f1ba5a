"""Hostile inputs to the floor (``orthros_train.common``) and its callers: lock files that are not
lock files, weights folders that are not weights, tokenizer paths that hold no tokenizer and
overrides of the wrong kind. Each must end in one clear line, or be handled, never hang or spin."""

from __future__ import annotations

import os
import time

import pytest

from orthros_train.common.lock import HeartbeatLock, read_owner
from orthros_train.train.run_lock import RunLock, RunLockedError


def _odd_lock(kind: str, path) -> None:
    if kind == "dangling symlink":
        os.symlink(path.parent / "nowhere", path)
    elif kind == "symlink loop":
        os.symlink(path, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()


ODD_LOCKS = ("dangling symlink", "symlink loop", "fifo", "directory")


@pytest.mark.parametrize("kind", ODD_LOCKS)
def test_run_lock_refuses_an_odd_lock_file_at_once(tmp_path, kind):
    """A name that exists but is no lock file was a busy spin (the stat through a dangling symlink
    said "released", forever) or a blocking read (a FIFO); now it is refused in one line."""
    _odd_lock(kind, tmp_path / "run.lock")
    assert read_owner(tmp_path / "run.lock") is None
    start = time.monotonic()
    with pytest.raises(RunLockedError, match="not a readable lock file.*rm -r"):
        RunLock(tmp_path).acquire()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("kind", ODD_LOCKS)
def test_waiting_lock_takes_an_odd_stale_lock_file_over(tmp_path, kind):
    """A waiter judges such a name by its own age (``lstat``) and takes it over once stale."""
    path = tmp_path / "build.lock"
    _odd_lock(kind, path)
    old = time.time() - 3600
    os.utime(path, (old, old), follow_symlinks=False)
    lock = HeartbeatLock(path, stale_after=1.0, heartbeat=0.1, timeout=10, poll=0.01)
    lock.acquire()
    try:
        assert read_owner(path) is not None and read_owner(path).token == lock.owner.token
    finally:
        lock.release()
    assert not path.exists() and not path.is_symlink()
