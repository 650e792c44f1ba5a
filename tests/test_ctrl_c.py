"""errors.exit_on_ctrl_c: a Ctrl-C during a command's start-up is one line and exit 130, also when
a library turned the interrupt into another exception, and a process that ignores SIGINT keeps
ignoring it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from orthros_train.errors import caused_by_ctrl_c


def _mangled() -> AttributeError:
    """What omegaconf raised when a Ctrl-C landed inside its flag context."""
    try:
        try:
            raise KeyboardInterrupt
        finally:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
    except AttributeError as exc:
        return exc


def test_an_exception_raised_while_a_ctrl_c_propagated_counts_as_the_ctrl_c():
    assert caused_by_ctrl_c(KeyboardInterrupt()) and caused_by_ctrl_c(_mangled())
    try:
        try:
            raise _mangled()
        except AttributeError:
            sys.exit(1)  # Hydra's run_and_report after printing
    except SystemExit as exit_:
        assert caused_by_ctrl_c(exit_)
    assert not caused_by_ctrl_c(ValueError("a bug")) and not caused_by_ctrl_c(None)


def _run(body: str, ignore_sigint: bool = False) -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        import os, signal, sys, time
        from orthros_train.errors import exit_on_ctrl_c
        if {ignore}:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        with exit_on_ctrl_c("prog", "while testing"):
    """).format(ignore=ignore_sigint) + textwrap.indent(textwrap.dedent(body), "    ")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_ctrl_c_a_library_turned_into_another_exception_is_one_line_and_130():
    proc = _run("""
        try:
            raise KeyboardInterrupt
        finally:
            raise AttributeError("half-restored state")
    """)
    assert proc.returncode == 130 and proc.stderr == "prog: interrupted (Ctrl-C) while testing\n", proc.stderr


def test_sigint_inside_the_block_leaves_at_once_and_an_unrelated_error_keeps_its_traceback():
    proc = _run("os.kill(os.getpid(), signal.SIGINT); time.sleep(30); print('not reached')")
    assert proc.returncode == 130 and proc.stderr == "prog: interrupted (Ctrl-C) while testing\n"
    assert proc.stdout == ""
    proc = _run("raise ValueError('a bug')")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ValueError: a bug" in proc.stderr


def test_a_process_that_ignores_sigint_keeps_ignoring_it():
    proc = _run("os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); print('still here')", ignore_sigint=True)
    assert proc.returncode == 0 and proc.stdout == "still here\n"
