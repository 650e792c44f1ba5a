"""Test environment: set before anything imports torch/triton/transformers/wandb."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two xdist workers on two cores: one thread each (and in the subprocesses they start). Tiny
# tensors run many times slower when OpenMP threads oversubscribe the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from data_helpers import make_tokenizer  # noqa: E402
from fixtures import (  # noqa: E402
    LAUNCH_DIR,
    PARALLEL_TEST_RUN,
    TINY_TEST_RUN,
    cli_env,
    resolved_recipe,
    shared_fixture_group,
    trainer_for,
)

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
    config.addinivalue_line(
        "markers",
        "fp16_compile_report: the float16 sm_90 compile report; under triton 3.9 it gives bfloat16's verdicts "
        "(same configs, spills, shared memory and dot replication), so `make test` leaves it to `make test-triton36`",
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: every test on its own, handed to whichever worker is free, except the
    groups of ``fixtures.SHARED_FIXTURE_GROUPS``, each sent whole to one worker (before the single
    tests)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_fixture_group(nodeid) or nodeid

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slow tests (seconds to minutes each, mostly subprocesses) first: xdist hands tests out in
    # this order, and a long one handed out last would run alone while the other worker idles.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
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
def _one_thread_and_seed_zero():
    # One intra-op thread for every test, whatever an earlier one set (orthros-eval and the study
    # set their own): tiny tensors on a busy 2-core machine only lose to OpenMP barrier spins.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield


# -- tokenizers: byte-level BPEs trained on the essays (about a second each), built once per worker --


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory) -> Callable[..., str]:
    """``bpe_tokenizer_dir(vocab_size=1024, chat_template=True)``: the folder of
    ``data_helpers.make_tokenizer`` with these settings, built on first use. Tests only read it."""
    built: dict[tuple[int, bool], str] = {}

    def folder(vocab_size: int = 1024, chat_template: bool = True) -> str:
        key = (vocab_size, chat_template)
        if key not in built:
            built[key] = str(make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size, chat_template))
        return built[key]

    return folder


@pytest.fixture(scope="session")
def chat_tokenizer_dir(bpe_tokenizer_dir) -> str:
    """The 1024-token BPE with the ChatML template (SFT/RL data)."""
    return bpe_tokenizer_dir()


@pytest.fixture(scope="session")
def plain_tokenizer_dir(bpe_tokenizer_dir) -> str:
    """The 1024-token BPE without a chat template."""
    return bpe_tokenizer_dir(chat_template=False)


@pytest.fixture(scope="session")
def chat_tokenizer(chat_tokenizer_dir):
    """``chat_tokenizer_dir`` loaded by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer_dir)


# -- in-process trainers ------------------------------------------------------------------------------


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(*overrides)``: a one-process Trainer of tiny_cpu with ``TINY_TEST_RUN`` in
    ``<tmp_path>/run``, the test's overrides on top. torch.distributed is torn down before the next
    one is built and after the test, and each one's run lock released."""
    from orthros_train.parallel.setup import destroy_parallel

    made = []

    def make(*overrides: str):
        resolved = resolved_recipe("tiny_cpu", *TINY_TEST_RUN, f"trainer.run_dir={tmp_path / 'run'}", *overrides)
        if made:
            made[-1].close()  # its run lock, released here and not by a finaliser after the test
            destroy_parallel()
        trainer = trainer_for(resolved)
        made.append(trainer)
        return trainer

    yield make
    if made:
        made[-1].close()
    destroy_parallel()


# -- command-line runs that several tests read ----------------------------------------------------------


@pytest.fixture(scope="session")
def tp2_sp_launch(tmp_path_factory):
    """``launch/torchrun.sh 2 tiny_cpu`` with TP = 2 and sequence parallelism (``PARALLEL_TEST_RUN``),
    the progress bar, log lines and wandb (offline) on as a user has them: test_parallel compares
    its losses with one process, test_quiet counts the lines it prints (one worker runs both:
    ``fixtures.SHARED_FIXTURE_GROUPS``). Returns (the finished process, its run directory)."""
    import subprocess
    import sys

    run_dir = tmp_path_factory.mktemp("tp2_sp") / "run"
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "2", "tiny_cpu", *PARALLEL_TEST_RUN, "parallel.tensor_parallel=2",
         "parallel.sequence_parallel=true", f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=900, cwd=run_dir.parent, env=cli_env(PYTHON=sys.executable),
    )  # fmt: skip
    return proc, run_dir


@pytest.fixture(autouse=True)
def _fresh_study_children():
    """The study's process-wide record of its children (stopping/aborting) starts clean in every
    test: a test that stops or aborts a study must not refuse the next test's runs in this worker."""
    import sys

    runs = sys.modules.get("orthros_train.study.runs")
    if runs is not None:
        runs.CHILDREN.reset()
    yield
