"""The vLLM tests run only where vLLM is installed (the serving environment: `make test-serve`)."""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the serving tests need vLLM: `make serve-env`, then `make test-serve`")

# The engine core in this process: a few seconds per engine instead of a spawned process each.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parent))
