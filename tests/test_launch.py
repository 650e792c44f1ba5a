"""Launch scripts: syntax, usage errors, and the Slurm preemption -> requeue path (with stubs)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
SCRIPTS = ["torchrun.sh", "slurm.sbatch", "deepspeed.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_explain_usage(script):
    assert subprocess.run(["bash", "-n", str(LAUNCH / script)]).returncode == 0
    proc = subprocess.run(["bash", str(LAUNCH / script)], capture_output=True, text=True)
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
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
    }
    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), "tiny_cpu"],
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
