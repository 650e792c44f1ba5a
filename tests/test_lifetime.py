"""common/lifetime.py: a study's trainer ends with the study, also when the study is killed with
SIGKILL (the orphans an adversarial replay found kept training)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from orthros_train.common.lifetime import PARENT_ENV, child_environment, die_with_parent

# The child: arms itself from the environment, says so, and sleeps far longer than the test waits.
CHILD = textwrap.dedent("""
    import os, sys, time
    from orthros_train.common.lifetime import PARENT_ENV, die_with_parent
    print(die_with_parent(os.environ.get(PARENT_ENV)), flush=True)
    time.sleep(120)
""")
# The parent: starts the child as a study does, prints the child's pid, then waits to be killed.
PARENT = textwrap.dedent(f"""
    import os, subprocess, sys, time
    from orthros_train.common.lifetime import child_environment
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=child_environment(dict(os.environ)),
                             stdout=sys.stdout, process_group=0)
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init later) counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_killed_by_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "True"  # armed
        assert _alive(child)
        assert _gone_with_sigkilled(parent, child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()


def _gone_with_sigkilled(parent: subprocess.Popen, child: int, wait_s: float = 20) -> bool:
    """SIGKILL ``parent``; whether ``child`` is gone within ``wait_s``."""
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + wait_s
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(child)


def test_only_a_child_of_the_named_parent_is_tied():
    assert die_with_parent(None) is False and die_with_parent("") is False and die_with_parent("x") is False
    assert die_with_parent(str(os.getpid())) is False  # this process is not its own parent
    assert child_environment({"A": "1"}) == {"A": "1", PARENT_ENV: str(os.getpid())}


def test_study_children_are_named_and_the_trainer_entry_point_arms_itself(tmp_path, monkeypatch):
    import orthros_train.study.runs as runs
    import orthros_train.train.cli as cli

    children = runs._Children()
    with open(tmp_path / "log", "w") as log:
        proc = children.start([sys.executable, "-c", f"import os; print(os.environ[{PARENT_ENV!r}])"], log, {})
        proc.wait()
    assert (tmp_path / "log").read_text().strip() == str(os.getpid())
    armed = []
    monkeypatch.setattr("orthros_train.common.lifetime.die_with_parent", lambda pid: armed.append(pid))
    monkeypatch.setenv(PARENT_ENV, "12345")
    monkeypatch.setattr(sys, "argv", ["orthros-train", "--config-name", "tiny_cpu", "trainer.max_stepz=1"])
    with pytest.raises(SystemExit):
        cli.main()  # refused (a typo) after arming
    assert armed == ["12345"]


# A parent that starts a program not its own (torchrun's place) through the lifetime module.
EXEC_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from orthros_train.common.lifetime import child_environment
    child = subprocess.Popen([sys.executable, "-m", "orthros_train.common.lifetime", "sleep", "120"],
                             env=child_environment(dict(os.environ)), process_group=0)
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_program_started_through_the_module_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", EXEC_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.time() + 20  # the exec has happened once the process is sleep
        while time.time() < deadline and open(f"/proc/{child}/comm").read().strip() != "sleep":
            time.sleep(0.05)
        assert open(f"/proc/{child}/comm").read().strip() == "sleep"  # the same pid, now the program
        assert _gone_with_sigkilled(parent, child), "the program outlived its SIGKILLed parent"
    finally:
        parent.kill()


def test_the_module_names_a_program_it_cannot_run():
    proc = subprocess.run([sys.executable, "-m", "orthros_train.common.lifetime", "no-such-program-x"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "no-such-program-x: cannot run it" in proc.stderr
