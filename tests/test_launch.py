"""Launch scripts: syntax, usage errors, and the Slurm preemption -> requeue path (with stubs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import LAUNCH_DIR, QUIET_RUN, cli_env, metrics

SCRIPTS = ["torchrun.sh", "slurm.sbatch", "deepspeed.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_explain_usage(script):
    assert subprocess.run(["bash", "-n", str(LAUNCH_DIR / script)]).returncode == 0
    proc = subprocess.run(["bash", str(LAUNCH_DIR / script)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_slurm_script_forwards_preemption_and_requeues(tmp_path):
    """USR1 from Slurm reaches the training processes; a clean exit then requeues the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [[ $1 == show ]]; then echo node1; else echo "$@" >> {log}; fi\n'
    )
    # Stands in for srun + torchrun + trainer: on USR1 it "saves" and exits 0.
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\ntrap 'echo trainer-got-usr1 >> {log}; exit 0' USR1\necho started >> {log}\n"
        "for i in $(seq 300); do sleep 0.1; done\nexit 1\n"
    )
    # The script's one-process check of the recipe (ORTHROS_PRECHECK_WORLD_SIZE) passes at once
    # here: this test is about the signals, and the real check takes seconds of imports.
    (bin_dir / "python").write_text(
        f'#!/bin/bash\nif [[ -n ${{ORTHROS_PRECHECK_WORLD_SIZE:-}} ]]; then echo precheck >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(bin_dir / "python"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
    }
    proc = subprocess.Popen(
        ["bash", str(LAUNCH_DIR / "slurm.sbatch"), "tiny_cpu"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 20
    while not (log.exists() and "started" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = log.read_text().splitlines()
    assert "trainer-got-usr1" in lines and "requeue 4242" in lines
    assert lines[0] == "precheck"  # the recipe was checked once before srun started the ranks


def _fake_python(folder: Path, name: str = "python") -> Path:
    """An interpreter stand-in that records it was chosen, then runs the real one."""
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    fake = folder / name
    fake.write_text(f'#!/bin/bash\necho "chosen {fake}" >&2\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_torchrun_launcher_finds_the_project_python_without_an_active_venv(tmp_path):
    """No venv active and no python on PATH: the launcher takes the .venv next to the repository
    and gets as far as the trainer's own usage error."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    env["PATH"] = "/usr/bin:/bin"  # a bare shell: no venv's python first on PATH
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "1", "no_such_recipe"], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert "No module named" not in proc.stderr, proc.stderr[-2000:]
    assert "no_such_recipe" in proc.stderr  # hydra ran: torch and orthros_train imported


def test_launchers_honour_python_and_refuse_one_without_the_project(tmp_path):
    fake = _fake_python(tmp_path / "bin")
    env = {**os.environ, "PYTHON": str(fake)}
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "1", "no_such_recipe"], env=env, capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert f"chosen {fake}" in proc.stderr
    bare = tmp_path / "bare"
    bare.write_text("#!/bin/bash\nexit 1\n")  # an interpreter without torch
    bare.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "1", "tiny_cpu"], env={**os.environ, "PYTHON": str(bare)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "no Python with torch and orthros_train" in proc.stderr
    assert "make install" in proc.stderr


def _train(nproc: int, recipe: str, run_dir: Path, *overrides: str) -> list[float]:
    """Per-step losses of ``launch/torchrun.sh NPROC RECIPE`` (no parallel overrides)."""
    import json

    quiet = [*QUIET_RUN, "trainer.sample_prompt=null", f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), str(nproc), recipe, *quiet, *overrides],
        env=cli_env(), capture_output=True, text=True, timeout=900, cwd=run_dir.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe_json = json.loads((run_dir / "recipe.json").read_text())
    assert recipe_json["parallel"]["data_parallel"] == nproc  # derived from the world size
    return [r["loss"] for r in metrics(run_dir)]


@pytest.mark.slow
def test_tiny_cpu_trains_the_same_losses_on_one_and_two_ranks(tmp_path):
    small = ["trainer.max_steps=4", "trainer.seq_len=64", "trainer.eval_every=0", "model.hidden_size=64"]
    one = _train(1, "tiny_cpu", tmp_path / "one", *small)
    two = _train(2, "tiny_cpu", tmp_path / "two", *small)
    assert len(one) == len(two) == 4
    # The same 8 sequences per step: 2 accumulated micro batches of 4 on one rank, 1 on each of two.
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)


@pytest.mark.slow
def test_rl_tiny_cpu_runs_on_two_ranks_without_parallel_overrides(tmp_path):
    losses = _train(2, "rl_tiny_cpu", tmp_path / "rl", "trainer.max_steps=2")
    assert len(losses) == 2
