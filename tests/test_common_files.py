"""The file floor: one atomic write (old file kept on failure, no temporary left, never torn,
umask mode), one sha256, and no other atomic writer or fixed temporary name in the project."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import threading
from pathlib import Path

import pytest

from orthros_train.common import files
from orthros_train.common.files import (
    current_umask,
    honour_umask,
    replace_durably,
    sha256_file,
    write_atomic,
    write_json_atomic,
)

ROOT = Path(__file__).resolve().parent.parent


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_write_atomic_writes_text_and_bytes_and_returns_the_path(tmp_path):
    target = tmp_path / "a.txt"
    assert write_atomic(str(target), "héllo\n") == target
    assert target.read_text(encoding="utf-8") == "héllo\n"
    write_atomic(target, b"\x00\x01", durable=False)
    assert target.read_bytes() == b"\x00\x01"
    write_json_atomic(tmp_path / "b.json", {"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    assert (tmp_path / "b.json").read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2)
    assert _leftovers(tmp_path, {"a.txt", "b.json"}) == []


@pytest.mark.parametrize("fail_at", ["replace", "fsync"])
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, fail_at, exc):
    target = tmp_path / "state.json"
    target.write_text("old")

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(files.os, fail_at, boom)
    with pytest.raises(type(exc)):
        write_atomic(target, "new content")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert _leftovers(tmp_path, {"state.json"}) == []


def test_the_temporary_is_named_per_host_and_process_beside_the_target(tmp_path, monkeypatch):
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(Path(src))
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", spy)
    write_atomic(tmp_path / "x.json", "{}")
    write_atomic(tmp_path / "x.json", "{}")
    assert len(seen) == 2 and seen[0] != seen[1]  # unique per call (threads too)
    for tmp in seen:
        assert tmp.parent == tmp_path and tmp.name.endswith(".tmp")
        assert tmp.name.startswith(f".x.json.{os.uname().nodename}.{os.getpid()}.")


def test_the_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a", "x")
        assert (tmp_path / "a").stat().st_mode & 0o777 == 0o640
        (tmp_path / "b").write_text("x")
        (tmp_path / "b").chmod(0o600)
        honour_umask(tmp_path / "b")
        assert (tmp_path / "b").stat().st_mode & 0o777 == 0o640
        assert current_umask() == 0o027
    finally:
        os.umask(old)


def test_replace_durably_publishes_a_finished_file(tmp_path):
    tmp = tmp_path / ".out.host.1.abc.tmp"
    tmp.write_bytes(b"payload")
    assert replace_durably(tmp, tmp_path / "out") == tmp_path / "out"
    assert (tmp_path / "out").read_bytes() == b"payload" and not tmp.exists()


def test_sha256_file_matches_hashlib(tmp_path):
    data = os.urandom(100_003)
    (tmp_path / "blob").write_bytes(data)
    assert sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()
    assert sha256_file(str(tmp_path / "blob"), chunk=4096) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


PAYLOADS = [bytes([65 + i]) * (1 << 20) for i in range(4)]  # 1 MiB each: a torn file would mix letters


def _writer(path: str, index: int, rounds: int) -> None:
    for _ in range(rounds):
        write_atomic(path, PAYLOADS[index], durable=False)


def test_concurrent_writers_never_produce_a_torn_file(tmp_path):
    target = tmp_path / "shared.bin"
    write_atomic(target, PAYLOADS[0])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(target), i, 15)) for i in (0, 1)]
    threads = [threading.Thread(target=_writer, args=(str(target), i, 15)) for i in (2, 3)]
    for w in procs + threads:
        w.start()
    reads = 0
    while any(p.is_alive() for p in procs) or any(t.is_alive() for t in threads):
        assert target.read_bytes() in PAYLOADS
        reads += 1
    for w in procs + threads:
        w.join()
    assert all(p.exitcode == 0 for p in procs)
    assert target.read_bytes() in PAYLOADS and reads > 0
    assert _leftovers(tmp_path, {"shared.bin"}) == []


# -- one writer, one lock: what a grep of the source finds -----------------------------------------
SCANNED = ("orthros_train", "data_tools", "bench")
RENAME = re.compile(r"os\.replace\(|os\.rename\(|\.rename\(|\btmp\.replace\(")
# A temporary name in a string literal: ``.tmp"``, ``.tmp-{...}"``, ``.tmp-"``.
TEMP_LITERAL = re.compile(r"""\.tmp(?:-[^\s"']*)?["']""")
# What makes a temporary name unique on a shared file system, or a line that only reads them.
UNIQUE = ("temp_name(", "uuid", "mkstemp(", "mkdtemp(", "unique", "gethostname()", "glob(", "endswith(")

# Renames outside common/files.py and common/lock.py, each with why it is not a file write.
RENAME_ALLOWED = {
    "orthros_train/train/run_dir.py": "publishes a converted-checkpoint directory written under a uuid name",
    "orthros_train/train/checkpoint_store.py": "publishes a checkpoint directory; renames shards inside its "
    "private directory (made durable by the directory's publication)",
    "orthros_train/data/cache.py": "publishes a cache directory built under a host+pid name, under the build lock",
    "orthros_train/common/safetensors_io.py": "queues the sharded writer's rename hook, which is replace_durably",
}
TEMP_ALLOWED: dict[str, str] = {
    "orthros_train/convert/destination.py": "a pattern that recognises the temporary files a conversion writes "
    "(to replace them on --overwrite), not a name anything is written under",
}


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            # the mechanisms themselves: atomic files, locks, and publishing a whole folder
            if rel in ("orthros_train/common/files.py", "orthros_train/common/lock.py",
                       "orthros_train/common/publish.py"):
                continue
            yield rel, path.read_text().splitlines()


def test_every_atomic_write_goes_through_common_files():
    stray = [f"{rel}:{i}: {line.strip()}" for rel, lines in _sources() if rel not in RENAME_ALLOWED
             for i, line in enumerate(lines, 1) if RENAME.search(line)]
    assert stray == [], "write through orthros_train.common.files.write_atomic (or replace_durably)"


def test_no_fixed_temporary_names():
    fixed = [f"{rel}:{i}: {line.strip()}" for rel, lines in _sources() if rel not in TEMP_ALLOWED
             for i, line in enumerate(lines, 1)
             if TEMP_LITERAL.search(line) and not any(mark in line for mark in UNIQUE)]
    assert fixed == [], "a fixed temporary name lets two writers on two hosts clobber each other"


def test_a_single_lock_implementation():
    """Only common/lock.py creates lock files (link, exclusive create) or heartbeats them (utime);
    run_lock.py and data/cache.py are thin users of it."""
    mechanics = re.compile(r"os\.link\(|O_EXCL|os\.utime\(")
    found = sorted({rel for rel, lines in _sources() for line in lines if mechanics.search(line)})
    assert found == []
