"""Derived caches that know their inputs: fingerprints, build-once folders and a build lock.

Every cache this package derives from data (megatron's sample/shuffle indices, the tokenized
embedded corpora, their tokenizers) is keyed by a *fingerprint* of what it was built from, not
only by names: re-tokenizing into the same prefix (``orthros-data tokenize --overwrite``) keeps
the paths but changes the files, and a cache keyed by path would silently serve indices of the
old data (samples cut at the wrong offsets, then a crash deep inside megatron). A folder per
fingerprint means a changed input gets a fresh cache and a stale one is never read; a small
record per *name* (the inputs' paths and the build parameters) remembers which fingerprint was
built last, so a rebuild says in the log which cache went stale and why.

A folder is built under a private name and swapped into place once complete with its
``fingerprint.json`` inside (``common.publish``), so a reader never sees half a cache and a crash
leaves only a hidden build beside it that the next build of that folder deletes. Concurrent
builders take turns through ``BuildLock`` (the project's one lock, ``common.lock``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orthros_train.common.files import sha256_file, write_json_atomic
from orthros_train.common.lock import HeartbeatLock, LockOwner
from orthros_train.common.publish import publish_folder
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

        def write(tmp: Path) -> Any:
            out = build(str(tmp))
            write_json_atomic(tmp / FINGERPRINT_FILE, fingerprint, indent=2, sort_keys=True, default=str)
            return out

        try:  # built aside, swapped in whole (common/publish.py); a failed build leaves the old folder
            return publish_folder(folder, write)
        except OSError as e:
            raise CacheError(f"cannot write the {what} cache {folder} ({e.strerror or e}"
                             f"{': ' + e.filename if getattr(e, 'filename', None) else ''}); free space or point "
                             "data.cache_dir at a writable folder") from e


class CacheError(DataError):
    """A cache that cannot be built (its folder cannot be written); the message names it and the fix."""


class CacheLockTimeout(TimeoutError):
    """A build lock was not released (nor went stale) within the waiting time."""


class BuildLock(HeartbeatLock):
    """``common.lock.HeartbeatLock`` on ``path``, waited for: builders of one cache take turns.

    Caches live under ``data.cache_dir``, by default in the home directory, which on clusters is an
    NFS/Lustre/GPFS mount shared by the nodes of a job and of other jobs; the lock works there
    (``flock`` would be node-local). A waiter takes a lock over when its holder is a dead process
    on this host or its heartbeat stood still for ``stale_after`` seconds, and logs whose lock it
    was; ``timeout`` (None: wait as long as the holder lives) ends the wait with
    ``CacheLockTimeout``. Every build here writes a private folder renamed into place, so even a
    wrong takeover would cost time, never correctness.
    """

    holder_noun = "build"

    def __init__(self, path: str, stale_after: float = 120.0, heartbeat: float | None = None,
                 poll: float = 0.2, timeout: float | None = None) -> None:
        super().__init__(path, stale_after=stale_after, heartbeat=heartbeat, poll=poll, timeout=timeout, log=log)

    def busy(self, holder: LockOwner | None, waited: float) -> Exception:
        who = holder.describe() if holder else "an unreadable lock file"
        return CacheLockTimeout(f"{self.path}: still held by {who} after {waited:.0f} s; if that process is gone, "
                                "delete the file")

    def cannot_write(self, exc: OSError) -> Exception:
        # a read-only or foreign folder: say which, not a bare traceback
        what = "the lock file" if self.path.parent.is_dir() else "its folder"
        return CacheError(f"{self.path}: cannot create {what} ({exc.strerror or exc}); the folder must be writable "
                          "(for the trainer's caches: point data.cache_dir at a writable folder)")


@contextlib.contextmanager
def held(path: str, stale_after: float = 120.0) -> Iterator[BuildLock]:
    """``with held(path):`` -- a ``BuildLock`` on ``path`` for the block."""
    with BuildLock(path, stale_after=stale_after) as lock:
        yield lock
