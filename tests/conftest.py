"""Test environment: set before anything imports torch/triton/transformers/wandb."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers on two cores: one thread each (and in the subprocesses they start). Tiny
# tensors run many times slower when OpenMP threads oversubscribe the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def _gpu_session(config: pytest.Config) -> bool:
    """``pytest -m gpu`` on a machine with CUDA: the GPU tests alone, compiled for real."""
    return torch.cuda.is_available() and (config.option.markexpr or "").strip() == "gpu"


def pytest_configure(config: pytest.Config) -> None:
    # Before collection imports the kernels (they read TRITON_INTERPRET at import). The
    # interpreter runs Triton kernels on CPU tensors; on CUDA tensors it copies storage to the
    # host, so a GPU test must never run under it: a `-m gpu` session on a CUDA machine leaves it
    # off, every other session turns it on (CPU tests pass CPU tensors to the kernels).
    if not _gpu_session(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        reason = "needs CUDA"
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        reason = "needs compiled Triton: run the GPU tests alone, `pytest -m gpu` (TRITON_INTERPRET unset)"
    else:
        return
    skip_gpu = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
