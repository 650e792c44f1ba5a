"""How the command-line entry points show the package's log, and how the library marks a message
that every rank would log alike.

The library logs through ``logging`` only (``logging.getLogger(__name__)``) and never prints.
``configure_logging(rank)``, called once by an entry point, sends the package's INFO lines to
stdout and its warnings and errors to stderr, message only. It filters by rank: rank 0 shows
everything; other ranks show warnings and errors only, and not those logged with
``extra=RANK_ZERO`` (what every rank reports alike, such as a failed collective save).
The libraries in ``QUIET_LIBRARIES`` show their warnings and errors only.

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

import logging
import sys

PACKAGE = "orthros_train"
RANK_ZERO = {"rank_zero": True}  # logger.x(..., extra=RANK_ZERO): rank 0 alone shows it
# Libraries whose INFO lines say nothing a user acts on (megatron-core announces which FSDP and
# Transformer-Engine paths it picked, per rank, when first imported; it is imported lazily, after
# Hydra has put the root logger at INFO). Their warnings and errors still show.
QUIET_LIBRARIES = ("megatron",)


class RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank == 0:
            return True
        return record.levelno >= logging.WARNING and not getattr(record, "rank_zero", False)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def configure_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """The package's log on the console (idempotent: a second call replaces the handlers). The
    root logger's file handlers (Hydra's ``<job>.log`` in the run directory) get it too."""
    logger = logging.getLogger(PACKAGE)
    for handler in [h for h in logger.handlers if getattr(h, "_orthros_console", False)]:
        logger.removeHandler(handler)
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_Below(logging.WARNING))
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(RankFilter(rank))
        handler._orthros_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler not in logger.handlers:
            logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the console handlers above replace the root's (no line twice)
    for library in QUIET_LIBRARIES:
        logging.getLogger(library).setLevel(max(level, logging.WARNING))


__all__ = ["QUIET_LIBRARIES", "RANK_ZERO", "RankFilter", "configure_logging"]
