"""One owner per run directory: the lock file, its heartbeat and the takeover of stale locks."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from orthros_train.errors import UserError
from orthros_train.train.run_lock import LOCK_NAME, RunLock, RunLockedError


def _foreign_lock(run_dir, host: str, pid: int, job_id: str | None = None, age_s: float = 0.0) -> None:
    """A lock written by another launch (as its own process would have written it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    owner = {"host": host, "pid": pid, "started": "2026-01-02T03:04:05+00:00", "token": "other", "job_id": job_id}
    path.write_text(json.dumps(owner))
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    try:
        owner = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
        # Another process on this host: its own pid, so the live holder is not its own.
        code = (
            "import sys; from orthros_train.errors import UserError; from orthros_train.train.run_lock import RunLock\n"
            f"try:\n    RunLock({str(tmp_path / 'run')!r}).acquire()\n"
            "except UserError as e:\n    print(e); sys.exit(3)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr
        assert "in use by another run" in proc.stdout
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in proc.stdout and owner["started"] in proc.stdout
    finally:
        first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # no private or stale files left


def test_a_live_holder_on_another_host_is_refused(tmp_path):
    _foreign_lock(tmp_path, "node-a17", 4242, age_s=5)
    with pytest.raises(RunLockedError, match=r"host node-a17, pid 4242, started 2026-01-02T03:04:05"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "other"  # left alone


def test_a_dead_pid_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = _dead_pid()
    _foreign_lock(tmp_path, socket.gethostname(), pid)
    with caplog.at_level(logging.WARNING, "orthros_train.train.run_lock"), RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.owner.token
    assert f"its process {pid} on this host is gone" in caplog.text and "taking over" in caplog.text


def test_an_old_heartbeat_is_taken_over_and_a_fresh_one_is_not(tmp_path, caplog):
    _foreign_lock(tmp_path, "node-b02", 99, age_s=30)
    with pytest.raises(RunLockedError):
        RunLock(tmp_path, heartbeat_s=1, stale_after_s=60).acquire()  # 30 s: still alive
    with caplog.at_level(logging.WARNING, "orthros_train.train.run_lock"):
        with RunLock(tmp_path, heartbeat_s=1, stale_after_s=20):
            pass
    assert "heartbeat is 30 s old" in caplog.text and "node-b02" in caplog.text


def test_a_requeued_slurm_job_takes_its_own_lock_over(tmp_path, caplog):
    _foreign_lock(tmp_path, "node-c03", 77, job_id="123456")
    with pytest.raises(RunLockedError):
        RunLock(tmp_path, job_id="999").acquire()  # another job: refused
    with caplog.at_level(logging.WARNING, "orthros_train.train.run_lock"), RunLock(tmp_path, job_id="123456"):
        pass
    assert "Slurm job 123456 (requeued)" in caplog.text


def test_the_heartbeat_keeps_the_lock_fresh_and_notices_a_takeover(tmp_path, caplog):
    lock = RunLock(tmp_path, heartbeat_s=0.2, stale_after_s=5)
    lock.acquire()
    path = tmp_path / LOCK_NAME
    old = time.time() - 100
    os.utime(path, (old, old))
    deadline = time.time() + 10
    while time.time() - path.stat().st_mtime > 50 and time.time() < deadline:
        time.sleep(0.1)
    assert time.time() - path.stat().st_mtime < 50  # touched again by the heartbeat
    _foreign_lock(tmp_path, "node-d04", 5)  # someone replaced the file
    with caplog.at_level(logging.ERROR, "orthros_train.train.run_lock"):
        assert lock.lost.wait(10)
    assert "no longer this run's" in caplog.text
    lock.release()
    assert json.loads(path.read_text())["host"] == "node-d04"  # release never removes another's lock


def test_an_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"trainer.run_dir=.*a_file/run cannot be written .*pick a directory"):
        RunLock(blocker / "run").acquire()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_run_dir_is_a_clear_error(tmp_path):
    run = tmp_path / "ro"
    run.mkdir()
    run.chmod(0o555)
    try:
        with pytest.raises(ValueError, match=r"cannot be written \(Permission denied\)"):
            RunLock(run).acquire()
    finally:
        run.chmod(0o755)
