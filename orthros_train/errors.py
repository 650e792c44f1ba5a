"""User errors vs bugs: the one exception type for "the user asked for something wrong".

A command line prints a ``UserError`` as one line naming the problem and the fix, and exits
with its usage status. Every other exception - a ValueError raised inside torch or numpy, an
assertion, a bug of ours - keeps its traceback and says where to report it: a one-line message
would hide where it came from.

Imports nothing of the project, so every layer may raise it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# Where a traceback that is not the user's fault should be reported.
REPORT_TO = "the orthros-train issue tracker (attach the command, this traceback and `pip freeze`)"


class UserError(Exception):
    """A bad recipe key, flag, file or folder: the message names it and the fix.

    Deliberately not a ValueError: torch, numpy and every other library raise ValueError for
    their own broken contracts, and a command line that caught ValueError as "the user's fault"
    turned those bugs into one misleading line. Only this family is printed as one line."""


def report_bug(prog: str, exc: BaseException) -> None:
    """Print ``exc`` with its traceback and where to report it (an unexpected error, not the user's)."""
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(
        f"{prog}: internal error ({type(exc).__name__}): this is a bug, not a problem with your input; "
        f"please report it to {REPORT_TO}",
        file=sys.stderr,
        flush=True,
    )


def first_line(exc: BaseException) -> str:
    """The message of a user error as one line (a multi-line message keeps its first line's meaning)."""
    text = str(exc).strip() or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def caused_by_ctrl_c(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a KeyboardInterrupt or was raised while one propagated. A Ctrl-C that
    lands inside a library can come out as another exception: omegaconf, interrupted inside its
    flag context, raises an AttributeError from its half-restored state, with the
    KeyboardInterrupt as its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def exit_on_ctrl_c(prog: str, what: str = "while starting up; nothing was done") -> Iterator[None]:
    """Ctrl-C inside the block (a command's seconds of imports) exits 130 with one line instead
    of a KeyboardInterrupt traceback through the import machinery, also when a library turned
    the interrupt into another exception (``caused_by_ctrl_c``)."""
    def leave(*_: object) -> None:
        print(f"{prog}: interrupted (Ctrl-C) {what}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # os._exit, not SystemExit: a Ctrl-C that landed inside a C extension's import (code it
        # runs through PyRun_String) marks the interpreter "interrupted", and a normal exit then
        # re-raises SIGINT on itself (exit status -2 instead of 130). Nothing is held yet.
        os._exit(INTERRUPTED_EXIT_CODE)

    # The block's SIGINT leaves at once instead of raising KeyboardInterrupt into whatever library
    # code runs (Hydra's config handling turned one into an AttributeError traceback). Only where
    # Python's own handler is in place: a process started with SIGINT ignored keeps ignoring it, and
    # a handler installed inside the block (the trainer's stop signals) takes over until it leaves.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    install = previous is signal.default_int_handler
    if install:
        signal.signal(signal.SIGINT, leave)
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - anything a Ctrl-C became; the rest is re-raised
        if not caused_by_ctrl_c(exc):
            raise
        leave()
    finally:
        if install:
            signal.signal(signal.SIGINT, previous)

