"""Derived caches that know their inputs: fingerprints, build-once folders and a build lock.

Every cache this package derives from data (megatron's sample/shuffle indices, the tokenized
embedded corpora, their tokenizers) is keyed by a *fingerprint* of what it was built from, not
only by names: re-tokenizing into the same prefix (``orthros-data tokenize --overwrite``) keeps
the paths but changes the files, and a cache keyed by path would silently serve indices of the
old data (samples cut at the wrong offsets, then a crash deep inside megatron). A folder per
fingerprint means a changed input gets a fresh cache and a stale one is never read; a small
record per *name* (the inputs' paths and the build parameters) remembers which fingerprint was
built last, so a rebuild says in the log which cache went stale and why.

A folder is built under a private name and renamed into place once complete with its
``fingerprint.json`` inside, so a reader never sees half a cache and a crash leaves only a
``*.tmp-*`` folder that the next build ignores. Concurrent builders take turns through
``BuildLock``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orthros_train.common.files import sha256_file, write_json_atomic
from orthros_train.data.indexed import DataError

log = logging.getLogger(__name__)

FINGERPRINT_FILE = "fingerprint.json"
HASH_CHUNK = 1 << 24


def file_fingerprint(path: str, content: bool = True) -> dict[str, Any]:
    """Size, modification time (ns) and, with ``content``, the SHA-256 of a file."""
    st = os.stat(path)
    out: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if content:
        out["sha256"] = sha256_file(path, HASH_CHUNK)
    return out


def indexed_fingerprint(prefix: str) -> dict[str, Any]:
    """What an indexed dataset is: the ``.bin``'s size and mtime, the ``.idx``'s size, mtime and hash.

    The ``.idx`` (document boundaries, a few bytes per document) is hashed; the ``.bin`` (the
    tokens, hundreds of GB for a real corpus) is not: every rewrite of the tokens rewrites the
    index beside it (new mtime), and the sample index depends on the boundaries alone.
    """
    return {
        "prefix": os.path.abspath(prefix),
        "bin": file_fingerprint(prefix + ".bin", content=False),
        "idx": file_fingerprint(prefix + ".idx", content=True),
    }


def corpus_fingerprint(files: list) -> list[dict[str, Any]]:
    """Path, size and SHA-256 of every source file of a (small, embedded) corpus. No mtime:
    reinstalling the same package must not invalidate a cache, new content must."""
    out = []
    for f in files:
        fp = file_fingerprint(str(f), content=True)
        out.append({"path": str(f), "size": fp["size"], "sha256": fp["sha256"]})
    return out


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of what a fast tokenizer encodes with: its serialised model, special tokens and
    chat template (the pieces a cache built with it depends on)."""
    parts = [tokenizer.backend_tokenizer.to_str(), str(getattr(tokenizer, "chat_template", None) or ""),
             json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def digest(obj: Any, length: int = 16) -> str:
    """A short stable hash of a JSON-serialisable object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


def describe_change(old: Any, new: Any, where: str = "") -> list[str]:
    """Human-readable differences between two fingerprints (``inputs[0].idx.size: 120 -> 176``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            sub = f"{where}.{key}" if where else str(key)
            if key not in old or key not in new:
                out.append(f"{sub}: {'added' if key not in old else 'removed'}")
            else:
                out += describe_change(old[key], new[key], sub)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            out += describe_change(a, b, f"{where}[{i}]")
        return out
    if old != new:
        def short(v: Any) -> str:
            text = json.dumps(v, default=str)
            return text if len(text) <= 40 else text[:37] + "..."

        return [f"{where}: {short(old)} -> {short(new)}"]
    return []


def read_fingerprint(folder: str) -> dict | None:
    """The fingerprint a complete cache folder records (None: missing or unreadable)."""
    try:
        with open(os.path.join(folder, FINGERPRINT_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def note_inputs(root: str, name_key: Any, fingerprint: dict, folder: str, what: str) -> None:
    """Remember that ``name_key`` (paths + parameters) was last built as ``folder``; when the
    previous build of the same names had another fingerprint, log which cache is stale and why."""
    record = os.path.join(root, f"inputs-{digest(name_key)}.json")
    try:
        with open(record) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        previous = None
    if previous and previous.get("folder") != folder:
        changes = describe_change(previous.get("fingerprint"), fingerprint) or ["inputs changed"]
        log.warning(
            "%s cache %s no longer matches its inputs (%s); using %s for the current data. The old "
            "folder is not read again; delete it to free the space.",
            what, previous.get("folder"), "; ".join(changes[:6]), folder,
        )
    if not previous or previous.get("folder") != folder:
        with contextlib.suppress(OSError):  # the record only feeds the log line above
            os.makedirs(root, exist_ok=True)
            write_json_atomic(record, {"folder": folder, "fingerprint": fingerprint}, indent=2, sort_keys=True,
                              default=str)


def build_once(folder: str, fingerprint: dict, build: Callable[[str], Any], load: Callable[[str], Any],
               what: str, stale_after: float = 120.0) -> Any:
    """``load(folder)`` when ``folder`` is a complete cache of ``fingerprint``; else, holding
    ``folder.lock``, ``build(tmp)`` into a private folder that is renamed to ``folder``.

    A folder whose recorded fingerprint differs (a hash clash of the name, or a hand-edited
    cache) is rebuilt with a log line naming it. Returns what ``load`` or ``build`` returned.
    """
    if read_fingerprint(folder) == fingerprint:
        return load(folder)
    try:
        Path(folder).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot create the {what} cache folder {Path(folder).parent} ({e.strerror or e}); point "
                         "data.cache_dir at a writable folder") from e
    with BuildLock(folder + ".lock", stale_after=stale_after):
        found = read_fingerprint(folder)
        if found == fingerprint:  # another process built it while we waited
            return load(folder)
        if os.path.exists(folder):
            why = "its fingerprint differs: " + "; ".join(describe_change(found, fingerprint)[:6]) if found \
                else "it is incomplete (no fingerprint.json)"
            log.warning("rebuilding the %s cache %s: %s", what, folder, why)
        tmp = f"{folder}.tmp-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            out = build(tmp)
            write_json_atomic(os.path.join(tmp, FINGERPRINT_FILE), fingerprint, indent=2, sort_keys=True, default=str)
            if os.path.exists(folder):
                shutil.rmtree(folder)
            os.rename(tmp, folder)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CacheError(f"cannot write the {what} cache {folder} ({e.strerror or e}"
                             f"{': ' + e.filename if getattr(e, 'filename', None) else ''}); free space or point "
                             "data.cache_dir at a writable folder") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out


class CacheError(DataError):
    """A cache that cannot be built (its folder cannot be written); the message names it and the fix."""


class CacheLockTimeout(TimeoutError):
    """A build lock was not released (nor went stale) within the waiting time."""


class BuildLock:
    """An exclusive-create lock file (``O_CREAT | O_EXCL``) with a heartbeat, held for a block.

    Why not ``flock``: caches live under ``data.cache_dir``, by default in the home directory,
    which on clusters is an NFS/Lustre/GPFS mount shared by the nodes of a job and of other
    jobs; ``flock`` there is node-local or unsupported depending on the mount options, so two
    nodes could both build. Exclusive create is atomic on those file systems.

    The holder writes ``host``, ``pid``, ``started`` and a unique token into the file and touches
    it every ``heartbeat`` seconds. A waiter takes a lock over when its holder is a dead process
    on this host, or when the file's mtime has not moved for ``stale_after`` seconds of the
    waiter's own clock (no cross-host clock comparison), and logs whose lock it was. Two waiters
    judging one lock stale at the same instant could both build; every build here writes a
    private folder renamed into place, so that costs time, never correctness.
    """

    def __init__(self, path: str, stale_after: float = 120.0, heartbeat: float | None = None,
                 poll: float = 0.2, timeout: float | None = None) -> None:
        self.path = path
        self.stale_after = float(stale_after)
        self.heartbeat = heartbeat if heartbeat is not None else max(0.05, self.stale_after / 6)
        self.poll = poll
        self.timeout = timeout
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:  # a read-only or foreign folder: say which, not a bare traceback
            raise CacheError(f"{self.path}: cannot create the lock file ({e.strerror or e}); the folder must be "
                             "writable (for the trainer's caches: point data.cache_dir at a writable folder)") from e
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": self.token}
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        return True

    def _dead_here(self, holder: dict | None) -> bool:
        if not holder or holder.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError, OverflowError):
            return False
        return False

    def acquire(self) -> None:
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"{self.path}: cannot create its folder ({e.strerror or e}); the folder must be "
                             "writable") from e
        start = time.monotonic()
        seen: tuple | None = None  # (mtime_ns, when we first saw it) of the current holder's file
        announced = False
        while not self._try_create():
            try:
                mtime = os.stat(self.path).st_mtime_ns
            except FileNotFoundError:
                continue  # released between our create and stat: try again at once
            now = time.monotonic()
            if seen is None or seen[0] != mtime:
                seen = (mtime, now)
            holder = self.holder()
            if holder is None and now - seen[1] < max(1.0, self.poll * 5):
                time.sleep(self.poll)  # being written right now
                continue
            if self._dead_here(holder) or now - seen[1] >= self.stale_after:
                reason = "its process is gone" if self._dead_here(holder) else (
                    f"no heartbeat for {now - seen[1]:.0f} s")
                log.warning("taking over the lock %s held by %s (%s)", self.path, _who(holder), reason)
                current = self.holder()
                if current == holder:  # still the lock we judged stale (see the class docstring)
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path)
                seen = None
                continue
            if not announced:
                log.info("waiting for %s, held by %s", self.path, _who(holder))
                announced = True
            if self.timeout is not None and now - start > self.timeout:
                raise CacheLockTimeout(
                    f"{self.path}: still held by {_who(holder)} after {self.timeout:.0f} s; if that "
                    "process is gone, delete the file"
                )
            time.sleep(self.poll)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat {self.path}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        else:
            log.warning("the lock %s was taken over while held (by %s)", self.path, _who(holder))

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _who(holder: dict | None) -> str:
    if not holder:
        return "an unknown process"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {when}"


@contextlib.contextmanager
def held(path: str, stale_after: float = 120.0) -> Iterator[BuildLock]:
    """``with held(path):`` -- a ``BuildLock`` on ``path`` for the block."""
    with BuildLock(path, stale_after=stale_after) as lock:
        yield lock
