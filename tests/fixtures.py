"""What the tests share: the tiny model (its config and seeded weights), recipes composed and
resolved the way ``orthros-train`` resolves them, trainers built from them, and the command line
run in subprocesses (one process or torchrun) with the metrics its runs write.

Test modules import these names directly (``from fixtures import tiny_model``: pytest puts tests/
on ``sys.path``). The scripts in tests/parallel_scripts/ import them too: ``torchrun`` below starts
them as modules of the ``parallel_scripts`` package with tests/ on ``PYTHONPATH``. Pytest fixtures
(tokenizers, ``make_trainer``) live in conftest.py and are built from these factories.

The project is imported inside the functions: conftest.py imports this module before it sets
TRITON_INTERPRET, which the kernels read when they are imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.parallel.setup import DistributedEnv
    from orthros_train.train.config import RunConfig
    from orthros_train.train.trainer import Trainer

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
RECIPES_DIR = REPO / "recipes"
LAUNCH_DIR = REPO / "launch"

# -- the tiny model ---------------------------------------------------------------------------------

# The shape most model-level tests use: big enough for GQA (4 query heads on 2 KV heads) and two
# layers (the last one runs the output stream only), small enough for float64 reference math.
TINY_SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
}

# How the output stream's query affine (gamma, beta) is set after the seeded init:
#   "init"      as initialised (gamma 1, beta 0),
#   "resampled" gamma ~ N(1, 0.3), beta ~ N(0, 0.3): a clearly non-trivial affine,
#   "nudged"    gamma and beta moved by 0.1 N(0, 1): the streams differ, the init stays close.
OUTPUT_AFFINES = ("init", "resampled", "nudged")


def tiny_config(vocab_size: int = 64, **overrides) -> OrthrosConfig:
    """``TINY_SHAPE`` with this vocabulary; ``overrides`` set any other field (or change the shape
    where a test needs another one on purpose)."""
    from orthros_train.model import OrthrosConfig

    return OrthrosConfig(**{"vocab_size": vocab_size, **TINY_SHAPE, **overrides})


def tiny_model(
    vocab_size: int = 64, *, seed: int | None = 0, output_affine: str = "init", **overrides
) -> OrthrosForCausalLM:
    """``seeded_model`` of ``tiny_config(vocab_size, **overrides)``."""
    return seeded_model(tiny_config(vocab_size, **overrides), seed=seed, output_affine=output_affine)


def seeded_model(cfg: OrthrosConfig, *, seed: int | None = 0, output_affine: str = "init") -> OrthrosForCausalLM:
    """A model of ``cfg`` initialised after ``torch.manual_seed(seed)`` (``None``: from the
    generator's current state), its output-stream affine set by ``output_affine`` (see
    ``OUTPUT_AFFINES``) from the same generator."""
    from orthros_train.model import OrthrosForCausalLM

    if output_affine not in OUTPUT_AFFINES:
        raise ValueError(f"output_affine={output_affine!r}: one of {OUTPUT_AFFINES}")
    if seed is not None:
        torch.manual_seed(seed)
    model = OrthrosForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            if output_affine == "resampled":
                attn.gamma.normal_(1.0, 0.3)
                attn.beta.normal_(0.0, 0.3)
            elif output_affine == "nudged":
                attn.gamma.add_(0.1 * torch.randn_like(attn.gamma))
                attn.beta.add_(0.1 * torch.randn_like(attn.beta))
    return model


# The Hugging Face (Llama / Qwen) models the conversion tests start from: GQA 4 on 2, two layers,
# weights spread enough (initializer 0.15) that a mismatch shows in the logits.
TINY_HF_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.15,
}


def spread_hf_norms(model, *, biases: bool = False):
    """Norm weights ~ N(1, 0.2) and, with ``biases``, biases ~ N(0, 0.2) (in parameter order, from
    the global generator), so a dropped or misplaced tensor changes the logits; returns the model
    in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif biases and name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model.eval()


# -- recipes, as the command line composes them -------------------------------------------------------

# Recipe values Hydra fills from its own runtime config (``${hydra:job.config_name}``), which
# compose() outside ``hydra.main`` does not have: they take the recipe's name, as on the command line.
_HYDRA_JOB_NAME = "${hydra:job.config_name}"


def _name_hydra_job(node: object, name: str) -> object:
    if isinstance(node, dict):
        return {k: _name_hydra_job(v, name) for k, v in node.items()}
    if isinstance(node, list):
        return [_name_hydra_job(v, name) for v in node]
    if isinstance(node, str):
        return node.replace(_HYDRA_JOB_NAME, name)
    return node


def resolved_recipe(name: str, *overrides: str) -> dict:
    """Recipe ``name`` with command-line ``overrides`` (``key=value``, ``+key=value``), composed
    by Hydra and resolved to plain values, without the ``hydra`` section (what ``orthros_train.train.cli.run``
    turns into a RunConfig)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides))
    unresolved = _name_hydra_job(OmegaConf.to_container(cfg, resolve=False), name)
    resolved = OmegaConf.to_container(OmegaConf.create(unresolved), resolve=True)
    resolved.pop("hydra", None)
    return resolved


def compose_recipe(name: str, *overrides: str, world_size: int | None = None) -> "RunConfig":
    """The typed config of ``resolved_recipe(name, *overrides)`` (``world_size``: what the batch
    geometry is derived for; ``None`` plans for the recipe's ``parallel.world_size``)."""
    from orthros_train.train.config import run_config_from_dict

    return run_config_from_dict(resolved_recipe(name, *overrides), world_size=world_size)


def trainer_for(resolved: dict, env: "DistributedEnv | None" = None) -> "Trainer":
    """An in-process Trainer of a resolved recipe (``env``: the launcher's, for a torchrun rank)."""
    from orthros_train.train.config import run_config_from_dict
    from orthros_train.train.trainer import Trainer

    return Trainer(run_config_from_dict(resolved), resolved, env)


# tiny_cpu at test size: 2 layers of 64, micro batches of 2 sequences of 64 tokens, the batch
# geometry not derived (one micro batch per rank and step); only the training steps run (no eval,
# no sample at the end).
SMALL_TINY_CPU = (
    "model.hidden_size=64", "model.num_hidden_layers=2", "trainer.seq_len=64", "trainer.micro_batch_size=2",
    "trainer.global_batch_size=null", "trainer.eval_every=0", "trainer.sample_prompt=null",
)  # fmt: skip
# A run that prints and logs nothing beyond its errors and summary (no progress bar, no wandb, no
# log lines): what tests read is metrics.jsonl.
QUIET_RUN = ("trainer.progress=false", "trainer.wandb.enabled=false", "trainer.log_every=0")
# Three steps of the tensor- and context-parallel runs: windows (16) and documents cross the CP
# chunks (32 tokens at CP = 2).
PARALLEL_TEST_RUN = (*SMALL_TINY_CPU, "trainer.max_steps=3", "model.sliding_window=16")
# The tiny_cpu run of the checkpoint, resume and fault tests, in-process (conftest's make_trainer)
# and on the command line (start_tiny_run): test size, quiet, 2 warmup steps.
TINY_TEST_RUN = (*SMALL_TINY_CPU, *QUIET_RUN, "optim.warmup_steps=2")

# Tests that read one expensive fixture (a reference run, a launch) go to one xdist worker, so it is
# computed once (conftest.py's pytest_xdist_make_scheduler): node id without parameters, or a
# module -> group. xdist's own xdist_group marks cannot do this here: they rename node ids, which
# pytest 9 no longer lets a plugin do, and would be ignored. test_fixtures.py checks that every
# entry names a test that exists.
SHARED_FIXTURE_GROUPS = {
    "tests/test_resume.py::test_kill_9_two_process_run_resumes_bitwise": "uninterrupted_two_rank_run",
    "tests/test_parallel.py::test_trainer_tp2_sp_and_cp2_losses_equal_tp1": "tp2_sp_launch",
    "tests/test_quiet.py::test_two_rank_tp2_run_prints_a_handful_of_lines": "tp2_sp_launch",
    "tests/test_global_loss.py": "global_loss_splits",
    "tests/test_parallel_moe.py": "expert_parallel_runs",  # one_rank_run, ep2_run, ep2_zero1_run
}


def shared_fixture_group(nodeid: str) -> str | None:
    """The ``SHARED_FIXTURE_GROUPS`` group of a test's node id, if any."""
    test = nodeid.split("[", 1)[0]
    return SHARED_FIXTURE_GROUPS.get(test) or SHARED_FIXTURE_GROUPS.get(test.split("::", 1)[0])


# -- the command line in subprocesses ------------------------------------------------------------------


# What an in-process trainer leaves in os.environ (DeepSpeed wants a launcher's variables): a
# command started from a test must not inherit them, as a user's shell has none (a stale
# MASTER_PORT would pin launch/torchrun.sh's rendezvous to a port another run may hold).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli_env(*, drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """The environment of a command-line subprocess: offline Hugging Face and wandb, one OpenMP
    thread (two xdist workers already share the two cores), no launcher variables, ``values`` set
    and ``drop`` removed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1", **values}  # fmt: skip
    for key in (*LAUNCHER_VARIABLES, *drop):
        env.pop(key, None)
    return env


TRAIN_CLI = (sys.executable, "-m", "orthros_train.train.cli")


def train_command(*args: str, nproc: int = 1, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """``orthros-train ARGS`` as one process, or as ``nproc`` ranks under torchrun (``--standalone``)."""
    if nproc == 1:
        return [*TRAIN_CLI, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
            *torchrun_args, "-m", "orthros_train.train.cli", *args]  # fmt: skip


def start_train(
    *args: str, cwd: Path, nproc: int = 1, torchrun_args: tuple[str, ...] = (), env: dict | None = None
) -> subprocess.Popen:
    """``train_command`` started in the background, stdout and stderr piped as text."""
    return subprocess.Popen(
        train_command(*args, nproc=nproc, torchrun_args=torchrun_args), cwd=cwd, env=env or cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def start_tiny_run(
    *overrides: str, cwd: Path, nproc: int = 1, torchrun_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    """``orthros-train --config-name tiny_cpu`` with ``TINY_TEST_RUN`` and ``overrides``, started."""
    return start_train("--config-name", "tiny_cpu", *TINY_TEST_RUN, *overrides, cwd=cwd, nproc=nproc,
                       torchrun_args=torchrun_args)  # fmt: skip


def run_train(*args: str, cwd: Path, nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """``train_command`` run to its end (15 minutes at most), output captured as text."""
    return subprocess.run(train_command(*args, nproc=nproc), cwd=cwd, env=env or cli_env(), capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: int = 900) -> tuple[int, str, str]:
    """Wait for a started process: (exit code, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def torchrun(module: str, *args: str, nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    """``module`` of tests/parallel_scripts/ (``"tp_equivalence"``) on ``nproc`` ranks of torchrun,
    run from the repository with tests/ on PYTHONPATH (the scripts import ``fixtures`` and
    ``parallel_scripts.common``)."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           "-m", f"parallel_scripts.{module}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=cli_env(PYTHONPATH=path))  # fmt: skip


def result_of(proc: subprocess.CompletedProcess) -> dict:
    """The ``RESULT <json>`` line a parallel script prints on rank 0 (it must have exited 0)."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def assert_variants_close(results: dict, expected: int, tol: float = 1e-5) -> None:
    """A parallel script's ``RESULT``: ``expected`` variants, each difference within ``tol``."""
    assert len(results) == expected, sorted(results)
    for variant, errs in results.items():
        for what, err in errs.items():
            assert err <= tol, (variant, what, err)


# -- what a run wrote, and runs in flight ------------------------------------------------------------


def metrics(run_dir: Path) -> list[dict]:
    """Every record of ``<run_dir>/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def by_step(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """``key`` of every step; a resumed run logs the steps after its checkpoint again, and the
    later record wins."""
    return {r["step"]: r[key] for r in metrics(run_dir)}


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (torchrun puts ranks in sessions of their own,
    so a process group signal would miss them)."""
    import psutil

    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def wait_until(done: Callable[[], bool], proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``done`` until it holds; fail with the run's stderr if the process ends first, or with
    ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if done():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{what} in {timeout}s")


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait until the run in ``run_dir`` has logged ``step`` (or a later one)."""
    path = Path(run_dir) / "metrics.jsonl"
    wait_until(
        lambda: path.is_file() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines()),
        proc,
        timeout,
        f"step {step} not reached",
    )
