"""Files the project writes get the permissions the user's umask asks for.

safetensors' ``save_file`` creates its file with mode 0600 whatever the umask, so weights in a
shared run directory (umask 002, a group that reads them) were unreadable to the group while
everything beside them was not. Writers call ``honour_umask`` on what ``save_file`` wrote.

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

import os
from pathlib import Path


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
