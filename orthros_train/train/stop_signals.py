"""Stopping a run cleanly: SIGTERM/SIGUSR1 (schedulers, preemption) and SIGINT (Ctrl-C) stop it
after the current step with a checkpoint; a second Ctrl-C leaves at once.

A save in progress lives in a hidden temporary directory until its atomic rename, so leaving in
the middle of one keeps every published checkpoint intact.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from orthros_train.parallel import collectives

# Signals that stop a run after the current step with a checkpoint: SIGTERM/SIGUSR1 (exit 0, so
# the job can be requeued) and SIGINT (Ctrl-C; the command line exits 130 after the save).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED_EXIT_CODE = 130  # the shell's convention for a process ended by SIGINT (128 + 2)


class StopSignals:
    """While entered, the stop signals set ``received`` instead of killing the process; the
    previous handlers come back on exit. ``before_exit`` runs before a second Ctrl-C ends the
    process (it releases the run directory)."""

    def __init__(self, step: Callable[[], int], is_main: bool, before_exit: Callable[[], None]) -> None:
        self.step = step
        self.is_main = is_main
        self.before_exit = before_exit
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A signal handler writes with os-level calls, never through logging: it may interrupt
        # a thread holding the logging lock.
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:
                sys.stderr.write("orthros-train: second Ctrl-C: exiting at once without saving\n")
                sys.stderr.flush()
                self.before_exit()
                os._exit(INTERRUPTED_EXIT_CODE)
            if self.is_main:
                sys.stderr.write(
                    f"orthros-train: Ctrl-C: finishing step {self.step() + 1}, saving a checkpoint, then exiting "
                    "(Ctrl-C again exits at once without saving)\n"
                )
                sys.stderr.flush()
        self.received = signum  # acted on at the end of the current step

    def requested(self) -> bool:
        """Collective: one preempted rank stops them all."""
        return collectives.any_flag(bool(self.received))

    def name(self) -> str:
        return "Ctrl-C" if self.received == signal.SIGINT else f"signal {self.received}"


__all__ = ["INTERRUPTED_EXIT_CODE", "STOP_SIGNALS", "StopSignals"]
