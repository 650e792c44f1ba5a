"""A child process that ends with the process that started it.

A study starts its training runs as child processes. Ctrl-C and SIGTERM reach the study, which
stops them itself (``study/runs.py``). A study killed with SIGKILL, or by the out-of-memory
killer, cannot do that, and its trainers would go on training as orphans. On Linux the kernel can
signal a process when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The study names itself in
``PARENT_ENV``, and the trainer's entry point asks for SIGTERM at its parent's death, so the
trainer saves a checkpoint and stops as it does for a scheduler's SIGTERM. Neither Python nor
subprocess exposes the call (``preexec_fn`` could, but it is unsafe in a program with threads),
hence ctypes.

A program that is not ours (``torchrun``, which then stops its workers on the SIGTERM) is tied the
same way by starting it through ``python -m orthros_train.common.lifetime CMD ...``: the request
is made there and survives the ``exec`` of CMD, which keeps the process id.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PARENT_ENV = "ORTHROS_TRAIN_PARENT_PID"  # set by a parent that wants its children to die with it
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: str | None) -> bool:
    """Ask for SIGTERM when ``parent_pid`` (the value of ``PARENT_ENV``) dies; True when armed.

    Only when that process is this one's parent: a process started through something else (a
    launcher in between, an inherited environment) is not tied to it. If the parent died before
    the request took effect, this process gets its SIGTERM at once."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(ValueError):
        expected = int(parent_pid)
        if os.getppid() != expected:
            return False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                return False
        except (OSError, AttributeError):
            return False
        if os.getppid() != expected:  # the parent is already gone: reparented before the request
            os.kill(os.getpid(), signal.SIGTERM)
        return True
    return False


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that should end with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def exec_tied_to_parent(argv: list[str]) -> None:
    """Become ``argv`` (exec, same process id) after asking for SIGTERM at the death of the parent
    named in ``PARENT_ENV``."""
    if not argv or not argv[0]:
        sys.exit("usage: python -m orthros_train.common.lifetime CMD [ARG ...]")
    die_with_parent(os.environ.get(PARENT_ENV))
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.exit(f"{argv[0]}: cannot run it ({exc.strerror or exc})")


__all__ = ["PARENT_ENV", "child_environment", "die_with_parent", "exec_tied_to_parent"]

if __name__ == "__main__":
    exec_tied_to_parent(sys.argv[1:])
