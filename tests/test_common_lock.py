"""The one heartbeat lock: mutual exclusion across processes, stale holders taken over, live ones
refused and named, release, the heartbeat, and the NFS-safe creation."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from orthros_train.common import lock as lock_module
from orthros_train.common.lock import HeartbeatLock, LockBusy, read_owner


def _foreign(path, host: str, pid: int, age_s: float = 0.0, token: str = "other") -> None:
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-02T03:04:05+00:00", "token": token}))
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _critical_section(path: str, log: str, rounds: int) -> None:
    for _ in range(rounds):
        with HeartbeatLock(path, stale_after=30, poll=0.01):
            with open(log, "a") as f:
                f.write(f"enter {os.getpid()}\n")
            time.sleep(0.02)
            with open(log, "a") as f:
                f.write(f"exit {os.getpid()}\n")


def test_two_processes_never_hold_the_lock_together(tmp_path):
    path, log = str(tmp_path / "x.lock"), str(tmp_path / "log")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_critical_section, args=(path, log, 8)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    lines = open(log).read().splitlines()
    assert len(lines) == 32
    for enter, leave in zip(lines[::2], lines[1::2]):  # strictly alternating, same pid
        assert enter.startswith("enter") and leave == "exit" + enter[len("enter"):]
    assert sorted(os.listdir(tmp_path)) == ["log"]  # no lock, private or stale file left


def test_a_live_holder_is_refused_naming_it_and_release_removes_the_lock(tmp_path):
    path = tmp_path / "a.lock"
    holder = HeartbeatLock(path, stale_after=30)
    holder.acquire()
    try:
        owner = read_owner(path)
        assert owner.host == socket.gethostname() and owner.pid == os.getpid() and owner.token == holder.owner.token
        t0 = time.monotonic()
        with pytest.raises(LockBusy, match=rf"held by host {socket.gethostname()}, pid {os.getpid()}") as info:
            HeartbeatLock(path, stale_after=30, timeout=0).acquire()
        assert time.monotonic() - t0 < 5 and info.value.holder.token == holder.owner.token
        with pytest.raises(LockBusy, match="after 0 s"):
            HeartbeatLock(path, stale_after=30, timeout=0.3, poll=0.05).acquire()
    finally:
        holder.release()
    assert not path.exists()
    holder.release()  # idempotent


def test_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    path = tmp_path / "b.lock"
    pid = _dead_pid()
    _foreign(path, socket.gethostname(), pid)
    with caplog.at_level(logging.WARNING, "orthros_train.common.lock"):
        with HeartbeatLock(path, stale_after=600, timeout=0) as lock:
            assert read_owner(path).token == lock.owner.token
    assert f"pid {pid}" in caplog.text and f"its process {pid} on this host is gone" in caplog.text
    assert not path.exists()


def test_an_old_heartbeat_is_taken_over_and_a_fresh_foreign_one_is_not(tmp_path, caplog):
    path = tmp_path / "c.lock"
    _foreign(path, "node-b02", 99, age_s=30)
    with pytest.raises(LockBusy, match="node-b02"):
        HeartbeatLock(path, stale_after=60, timeout=0).acquire()
    assert read_owner(path).token == "other"  # left alone
    with caplog.at_level(logging.WARNING, "orthros_train.common.lock"), HeartbeatLock(path, stale_after=20, timeout=0):
        pass
    assert "heartbeat is 30 s old" in caplog.text and "node-b02" in caplog.text


def test_a_waiter_takes_over_a_lock_whose_heartbeat_stands_still(tmp_path):
    """No clock comparison between hosts: the waiter's own clock watching a frozen mtime."""
    path = tmp_path / "d.lock"
    _foreign(path, "elsewhere", 1)
    future = time.time() + 3600  # a holder whose clock runs an hour ahead
    os.utime(path, (future, future))
    t0 = time.monotonic()
    with HeartbeatLock(path, stale_after=0.5, poll=0.05, timeout=10):
        pass
    assert 0.4 < time.monotonic() - t0 < 5


def test_the_heartbeat_keeps_a_long_holder_alive_and_notices_a_takeover(tmp_path, caplog):
    path = tmp_path / "e.lock"
    holder = HeartbeatLock(path, stale_after=0.6, heartbeat=0.1)
    holder.acquire()
    try:
        with pytest.raises(LockBusy):  # three times stale_after: still alive, beating
            HeartbeatLock(path, stale_after=0.6, poll=0.05, timeout=1.8).acquire()
        assert read_owner(path).token == holder.owner.token
        _foreign(path, "node-d04", 5)  # someone replaced the file
        with caplog.at_level(logging.ERROR, "orthros_train.common.lock"):
            assert holder.lost.wait(10)
        assert "no longer this holder's" in caplog.text
    finally:
        holder.release()
    assert read_owner(path).host == "node-d04"  # release never removes another's lock


def test_an_unreadable_lock_counts_only_by_its_heartbeat(tmp_path):
    path = tmp_path / "f.lock"
    path.write_text("{not json")
    with pytest.raises(LockBusy, match="unreadable lock file"):
        HeartbeatLock(path, stale_after=60, timeout=0).acquire()
    old = time.time() - 120
    os.utime(path, (old, old))
    with HeartbeatLock(path, stale_after=60, timeout=0) as lock:
        assert read_owner(path).token == lock.owner.token


def test_a_takeover_puts_back_a_lock_that_changed_after_it_was_judged(tmp_path, monkeypatch):
    """Between judging a lock stale and moving it aside, a successor took the name: it is linked
    back and the caller looks again (here: refused by the live successor)."""
    path = tmp_path / "g.lock"
    _foreign(path, "node-e05", 7, age_s=100, token="dead")
    real_rename = os.rename

    def successor_first(src, dst):
        os.unlink(src)
        _foreign(path, "node-f06", 8, token="live")  # fresh heartbeat, another token
        real_rename(src, dst)

    monkeypatch.setattr(lock_module.os, "rename", successor_first)
    with pytest.raises(LockBusy, match="node-f06"):
        HeartbeatLock(path, stale_after=60, timeout=0).acquire()
    monkeypatch.undo()
    assert read_owner(path).token == "live"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.lock"]


def test_a_lost_link_reply_is_resolved_by_the_link_count(tmp_path, monkeypatch):
    """NFS: the server made the link but the reply was lost (an EIO to the client)."""
    path = tmp_path / "h.lock"
    real_link = os.link

    def link_then_fail(src, dst):
        real_link(src, dst)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(lock_module.os, "link", link_then_fail)
    with HeartbeatLock(path, stale_after=30, timeout=0) as lock:
        assert read_owner(path).token == lock.owner.token
    assert not path.exists()


def test_started_as_epoch_seconds_is_read(tmp_path):
    path = tmp_path / "i.lock"
    path.write_text(json.dumps({"host": "h", "pid": 3, "started": 0, "token": "t"}))
    owner = read_owner(path)
    assert owner.pid == 3 and owner.started.startswith(("1970", "1969"))
    assert read_owner(tmp_path / "missing") is None


def test_stale_after_must_exceed_the_heartbeat(tmp_path):
    with pytest.raises(ValueError, match="must exceed"):
        HeartbeatLock(tmp_path / "j.lock", stale_after=1, heartbeat=2)
