"""The vLLM tests run only where vLLM is installed (the serving environment: `make test-serve`).

Without vLLM (the main venv, `make test`) this directory is not collected at all.
"""

import importlib.util
import os
import sys
from pathlib import Path

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
else:
    # The engine core in this process: a few seconds per engine instead of a spawned process each.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).parent))
