"""Writing and hashing files: one atomic write, one durability rule, one sha256, one umask rule.

The rule every writer of the project follows (``write_atomic``): the bytes go to a private
temporary file in the target's directory, named per host, process and call
(``.{name}.{host}.{pid}.{random}.tmp``), are flushed and fsynced, and the file is then renamed
onto the target with ``os.replace``; with ``durable`` (the default) the directory is fsynced too.

Why each step: a reader (or a crash, a full disk, a power loss) sees the old file or the new one,
never half of one. Without the fsync before the rename, a power loss can leave the *new name*
pointing at an empty or partial file (delayed allocation); without the directory fsync, the
rename itself can be lost and the old content come back after a reboot. The temporary name is
unique because run directories and data caches sit on file systems shared by many nodes: a
fixed ``name.tmp`` lets two writers on two hosts (or two threads) write into one temporary file
and publish a torn mix of both.

``durable=False`` skips only the directory fsync: for files rewritten often whose last version
may be lost to a power cut without harm (a report rewritten after every item). The file itself
is always fsynced.

Files get the mode a plain ``open(path, "w")`` would give them under the user's umask
(``mkstemp`` creates 0600); ``honour_umask`` does the same for files that libraries such as
safetensors' ``save_file`` create with a fixed mode, so weights in a shared run directory (umask
002, a group that reads them) stay readable by the group.

Imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

HASH_CHUNK = 1 << 22  # 4 MiB reads for sha256_file


def current_umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only be read by setting it,
    which would race with writer threads); falls back to that where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | Path) -> None:
    """Give a regular file written by a library the mode a plain ``open(path, "w")`` would have."""
    os.chmod(path, 0o666 & ~current_umask())


def honour_umask_tree(directory: str | Path) -> None:
    """``honour_umask`` on every regular file under ``directory``."""
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            honour_umask(path)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory: the rename is as durable as they make it
    finally:
        os.close(fd)


def temp_name(path: str | Path, hidden: bool = True) -> str:
    """The start of a private temporary name for ``path``: ``.{name}.{host}.{pid}.`` (the caller
    adds a random part and ``.tmp``), unique per host and process on a shared file system. Just
    the name, without the directory; ``hidden=False`` drops the leading dot (for large files a
    crash may leave behind, which the user should see)."""
    dot = "." if hidden else ""
    return f"{dot}{Path(path).name[:120]}.{socket.gethostname()}.{os.getpid()}."  # short of NAME_MAX


def replace_durably(tmp: str | Path, path: str | Path, *, durable: bool = True) -> Path:
    """Publish a complete temporary file that something else wrote (a library's writer) under the
    same rule as ``write_atomic``: fsync it, ``os.replace`` it onto ``path``, fsync the directory
    when ``durable``. ``tmp`` must be in ``path``'s directory and named per host and process."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(Path(path).parent)
    return Path(path)


def write_atomic(path: str | Path, data: str | bytes, *, durable: bool = True, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``data`` so that nobody ever sees a partial file (the module docstring
    gives the rule). ``str`` is written encoded with ``encoding``. The directory must exist. On any
    failure, Ctrl-C included, the temporary file is removed and ``path`` keeps its old content.
    Returns ``path`` as a ``Path``."""
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(prefix=temp_name(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | Path, obj: Any, *, durable: bool = True, **json_kwargs: Any) -> Path:
    """``write_atomic`` of ``json.dumps(obj, **json_kwargs)`` (no trailing newline added)."""
    return write_atomic(path, json.dumps(obj, **json_kwargs), durable=durable)


def sha256_file(path: str | Path, chunk: int = HASH_CHUNK) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk``-byte blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
