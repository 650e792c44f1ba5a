"""A refused serving configuration is one line, not vLLM's traceback around it.

``config.py`` refuses what an Orthros model cannot serve when vLLM builds its configuration. vLLM
builds it inside a pydantic dataclass, so the refusal reaches the top of ``vllm serve`` wrapped in
a ``pydantic.ValidationError`` and is printed as fifty lines of vLLM and pydantic frames with the
message last. vLLM's command line has no hook for a plugin's user errors, so ``plugin.register``
installs ``one_line_refusals`` as the process's ``sys.excepthook`` (chained to the one before it):
an uncaught exception that is or wraps an ``OrthrosServeError`` is printed as its message alone
(exit status 1, as for any uncaught exception); every other exception keeps its traceback.

Imports neither vLLM nor pydantic, so the main environment tests it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import TracebackType

from orthros_train.errors import UserError, first_line


class OrthrosServeError(UserError):
    """A configuration the Orthros vLLM model cannot serve (the message says what to change)."""


def served_refusal(exc: BaseException | None) -> OrthrosServeError | None:
    """The ``OrthrosServeError`` that ``exc`` is or wraps: through ``__cause__``/``__context__``
    and through a pydantic ``ValidationError``'s errors (whose ``ctx["error"]`` is the exception a
    validator raised)."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OrthrosServeError):
            return e
        stack += [e.__cause__, e.__context__]
        if type(e).__name__ == "ValidationError" and callable(getattr(e, "errors", None)):
            try:
                items = e.errors()
            except Exception:  # an error list that cannot be rendered: nothing to unwrap
                items = []
            stack += [(item.get("ctx") or {}).get("error") for item in items if isinstance(item, dict)]
    return None


def one_line_refusals() -> None:
    """Install the hook described above once per process."""
    previous = sys.excepthook
    if getattr(previous, "orthros_one_line_refusals", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        refusal = served_refusal(exc)
        if refusal is None:
            previous(kind, exc, tb)
            return
        print(f"{Path(sys.argv[0] or 'vllm').name}: {first_line(refusal)}", file=sys.stderr, flush=True)

    hook.orthros_one_line_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook
