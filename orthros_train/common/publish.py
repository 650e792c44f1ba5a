"""Publishing a folder: the one way the project replaces a directory of files.

``write_atomic`` (files.py) makes one file appear whole or not at all; a checkpoint, an exported
model, a converted model or a data cache is a folder of files, and replacing it by deleting the old
files and writing new ones loses the old model to a crash or a full disk half-way. The rule every
folder writer follows instead:

1. **Build aside.** The new content is written into a hidden sibling
   (``.{name}.{host}.{pid}.{random}.new``), never into the target itself.
2. **Make it durable.** Every file and folder of the build is fsynced, then the parent folder
   (``fsync_tree``), so that what is swapped in is what a power loss leaves behind.
3. **Swap.** The build and the target are exchanged in one ``renameat2(RENAME_EXCHANGE)`` (Linux
   local file systems): there is no instant at which the target name is missing. Where the kernel
   or the file system cannot exchange (NFS, other systems) the old folder is renamed to
   ``.{name}....old`` and the build renamed onto the name; a crash between those two renames leaves
   the ``.old`` folder, which the next publish of the same target (``recover``) renames back.
4. **Retire.** Only after the swap is the old folder renamed ``.retired`` and deleted.

A crash (kill -9, power loss) or a full disk at any moment therefore leaves the old folder or the
whole new one under the target's name, never neither, and never a folder that looks complete but
is not: a build is only ever seen under a hidden name. Leftovers of a writer that died are cleaned
(or restored) by the next publish of the same target.

``carry`` keeps entries of the previous folder that the new one does not write (a converted
model's destination may hold the user's own notes or adapters): they are hard-linked into the
build (copied where links are not possible) before the swap, so they survive untouched.

A target that is a symbolic link, or that holds a symbolic link to a folder, is refused
(``UnsafeFolderError``): replacing it would write, or delete, outside the folder the user named.

One writer per target at a time: callers serialise writers of the same folder (the run lock, the
data cache's build lock; a conversion is one command). Leftovers of a live writer on this host are
left alone; those of a dead one, or of another host, are taken as abandoned.

Imports nothing of the project but ``errors`` and ``common``: every layer may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from orthros_train.common.files import fsync_dir, honour_umask_tree, temp_name
from orthros_train.common.lock import pid_alive
from orthros_train.errors import UserError

log = logging.getLogger(__name__)

BUILD, OLD, RETIRED = "new", "old", "retired"  # the suffixes of a target's hidden siblings
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}

T = TypeVar("T")


class UnsafeFolderError(UserError):
    """A folder to be replaced is a symbolic link or holds one to a folder: replacing it would
    write or delete outside the folder the user named."""


class FolderTakenError(UserError):
    """A target that was new (missing or empty) when its build began was filled by another writer
    before the swap; the build is not published over it."""


# -- refusals -----------------------------------------------------------------------------------------


def check_no_symlinks(target: str | Path, what: str = "the destination") -> None:
    """Refuse (``UnsafeFolderError``) a ``target`` that is a symbolic link or holds a symbolic link
    to a folder anywhere below it. Links in the path *above* ``target`` (a scratch mount) are fine:
    only what would be replaced or deleted matters."""
    target = Path(target)
    if target.is_symlink():
        raise UnsafeFolderError(
            f"{what} {target} is a symbolic link (to {os.readlink(target)}): refusing to replace a folder through a "
            "link, which would write outside it; pass the real folder's path or another destination"
        )
    if not target.is_dir():
        return
    for folder, dirs, files in os.walk(target):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink() and path.is_dir():
                raise UnsafeFolderError(
                    f"{path} is a symbolic link to a folder (to {os.readlink(path)}): refusing to replace {what} "
                    f"{target}, which would delete or write through the link; remove the link or choose another "
                    "destination"
                )


# -- durability and the swap --------------------------------------------------------------------------


def fsync_tree(root: str | Path) -> None:
    """fsync every regular file and folder under ``root`` (``root`` included) and ``root``'s parent."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)
    fsync_dir(Path(root).parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the system cannot (then nothing
    changed). Python's ``os`` has no ``renameat2``, hence ctypes."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28, not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


def sibling(target: Path, kind: str) -> Path:
    """A new hidden name beside ``target`` (``.{name}.{host}.{pid}.{random}.{kind}``) for a build,
    a swapped-out folder or a retired one."""
    return target.parent / f"{temp_name(target)}{uuid.uuid4().hex[:8]}.{kind}"


def _retire(old: Path, target: Path) -> None:
    """Delete a replaced folder, renamed ``.retired`` first so that nothing restores half of it."""
    retired = sibling(target, RETIRED)
    with contextlib.suppress(OSError):
        os.rename(old, retired)
        old = retired
    shutil.rmtree(old, ignore_errors=True)


def swap_into_place(built: str | Path, target: str | Path, replace: bool = True) -> Path:
    """Publish the complete folder ``built`` (a sibling of ``target``) as ``target``: fsync it,
    swap it in (module docstring, steps 2-4) and delete the previous ``target``. Raises OSError
    with ``target`` unchanged when the swap fails.

    ``replace=False``: ``target`` was missing or empty when the build began and must still be; a
    folder another writer published there meanwhile (two conversions into one new folder) is left
    as it is and ``FolderTakenError`` raised, instead of being silently swapped out."""
    built, target = Path(built), Path(target)
    recover(target)
    honour_umask_tree(built)  # safetensors and mkstemp create 0600 files whatever the umask
    fsync_tree(built)
    if not replace:
        _publish_new(built, target)
        return target
    if not target.exists():
        os.rename(built, target)
        fsync_dir(target.parent)
        return target
    if _exchange(built, target):  # ``built`` now names the previous folder
        fsync_dir(target.parent)
        _retire(built, target)
        return target
    old = sibling(target, OLD)
    os.rename(target, old)
    try:
        os.rename(built, target)
    except OSError:
        os.rename(old, target)  # the previous folder goes back under its name
        raise
    fsync_dir(target.parent)
    _retire(old, target)
    return target


def _publish_new(built: Path, target: Path) -> None:
    """Rename ``built`` onto a missing or empty ``target``. rename(2) itself refuses a non-empty
    folder (ENOTEMPTY/EEXIST) in the same call that would replace it, so no check-then-rename race
    lets this build replace another writer's."""
    try:
        os.rename(built, target)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FolderTakenError(f"{target} was filled by another writer while this one built it; this build "
                                   "was not published over it") from err
        raise
    fsync_dir(target.parent)


# -- leftovers of writers that died -------------------------------------------------------------------


def _parse(leftover: Path, target: Path) -> tuple[str, str, str] | None:
    """``(host, pid, kind)`` of a hidden sibling made for ``target`` by ``sibling``, else None."""
    prefix = f".{target.name[:120]}."
    if not leftover.name.startswith(prefix):
        return None
    parts = leftover.name[len(prefix) :].rsplit(".", 3)  # host (may hold dots), pid, random, kind
    if len(parts) != 4 or parts[3] not in (BUILD, OLD, RETIRED) or not parts[1].isdigit():
        return None
    return parts[0], parts[1], parts[3]


def leftovers(target: Path) -> dict[Path, str]:
    """Hidden siblings of ``target`` left by publishes that did not finish, with their kind. A live
    writer's on this host are left out; another host's, or a dead writer's, are abandoned (writers
    of one target are serialised by their callers)."""
    if not target.parent.is_dir():
        return {}
    found = {}
    for path in target.parent.iterdir():
        parsed = _parse(path, target)
        if parsed is None:
            continue
        host, pid, kind = parsed
        if host == socket.gethostname() and pid_alive(pid):  # this process's own builds included
            continue
        found[path] = kind
    return found


def recover(target: str | Path) -> None:
    """Finish what a writer that died left beside ``target``: a previous folder swapped out but not
    replaced (the rename fallback) is renamed back; builds and retired folders are deleted."""
    target = Path(target)
    found = leftovers(target)
    olds = sorted((p for p, kind in found.items() if kind == OLD), key=lambda p: p.stat().st_mtime)
    if olds and not target.exists() and not target.is_symlink():
        os.rename(olds[-1], target)
        log.warning("restored %s from %s (a writer died while replacing it)", target, olds[-1].name)
        fsync_dir(target.parent)
        olds.pop()
    for stale in [p for p, kind in found.items() if kind != OLD] + olds:
        shutil.rmtree(stale, ignore_errors=True)


# -- building -----------------------------------------------------------------------------------------


def begin(target: str | Path) -> Path:
    """Recover ``target``'s leftovers, create its parent and an empty private build folder beside
    it; returns the build folder. Raises OSError when the parent is not writable."""
    target = Path(target)
    check_no_symlinks(target)
    recover(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    built = sibling(target, BUILD)
    built.mkdir()
    return built


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, dest, follow_symlinks=False)


def carry_over(previous: Path, built: Path, names: Iterable[str]) -> list[str]:
    """Hard-link (or copy) the entries ``names`` of ``previous`` into ``built`` where ``built`` has
    no entry of that name; returns the names carried. Links stay links."""
    carried = []
    for name in names:
        source, dest = previous / name, built / name
        if os.path.lexists(dest) or not os.path.lexists(source):
            continue
        if source.is_symlink():
            os.symlink(os.readlink(source), dest)
        elif source.is_dir():
            shutil.copytree(source, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(dest))
        carried.append(name)
    return carried


def discard(built: str | Path) -> None:
    """Delete a build that will not be published."""
    shutil.rmtree(built, ignore_errors=True)


@contextlib.contextmanager
def building(target: str | Path, carry: Iterable[str] = ()) -> Iterator[Path]:
    """``with building(target) as folder:`` write the new content into ``folder``; when the block
    ends without an exception the entries ``carry`` of the previous ``target`` are carried over and
    the folder is swapped in (``swap_into_place``); on any exception (Ctrl-C included) the build is
    deleted and ``target`` is untouched."""
    target = Path(target)
    built = begin(target)
    try:
        yield built
        carry_over(target, built, carry)
        swap_into_place(built, target)
    except BaseException:
        discard(built)
        raise


def publish_folder(target: str | Path, write: Callable[[Path], T], carry: Iterable[str] = ()) -> T:
    """``write(folder)`` into a private folder beside ``target``, then publish it as ``target``
    (``building``); returns what ``write`` returned."""
    with building(target, carry) as folder:
        result = write(folder)
    return result
