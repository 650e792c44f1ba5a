"""Building a run's parts, in the order a run needs them: processes and device, the run
directory's lock, data, model, objective, engine. Each function fails with a message naming the
recipe key to change, before anything slower is built.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from orthros_train.common.safetensors_io import NoSafetensorsError, SafetensorsFileError, SafetensorsReader
from orthros_train.data.schedule import build_scheduled_data
from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.model import OrthrosForCausalLM
from orthros_train.options import CommBackend, DataSource, Device
from orthros_train.parallel import collectives
from orthros_train.parallel.model import build_parallel_model
from orthros_train.parallel.setup import DistributedEnv, init_parallel
from orthros_train.parallel.state_dict import load_reference_shards
from orthros_train.train.config import RunConfig
from orthros_train.train.distill import Distillation, build_teacher
from orthros_train.train.memory import GIB, memory_fit_problem, memory_summary
from orthros_train.train.objective import CrossEntropy, Objective
from orthros_train.train.rl import GRPOObjective, Policy, build_rollout_data
from orthros_train.train.run_lock import RunLock

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class _SwitchUsers:
    """The users of a process-wide switch and the state it had before the first of them."""

    users: int = 0
    before: tuple = ()


# The trainers of this process that asked for reproducible kernels: torch's switch is one per
# process, so it goes back to what it was when the last of them closes.
_DETERMINISM = _SwitchUsers()


def set_determinism(deterministic: bool) -> Callable[[], None]:
    """``trainer.deterministic``: reproducible kernels from here on (as torchtitan's and
    Megatron-LM's deterministic modes do). An op torch has no reproducible kernel for warns,
    naming itself, on first use (``warn_only``: torch lists NLLLoss and float cumsum on CUDA among
    them, so a strict switch could stop a run at its first step); torch's own FlashAttention
    backward also stays atomic under ``warn_only``, so the attention route sends such a run to
    flash-attn (told ``deterministic=True``) or to our kernels (``ops/route.py``). Returns what
    releases the switch (the trainer's ``close``, at most once: a test or notebook goes on in the
    same process); the previous setting comes back when no trainer that asked for it is open."""
    if not deterministic:
        return lambda: None
    if _DETERMINISM.users == 0:
        _DETERMINISM.before = (torch.are_deterministic_algorithms_enabled(),
                               torch.is_deterministic_algorithms_warn_only_enabled(),
                               torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)  # fmt: skip
        # cuBLAS reads its workspace setting when this process creates its first handle (its first
        # GEMM on the GPU, after this); a value the launcher set is kept.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Triton's autotuners keep their choice in memory unless told to use the on-disk cache: a
        # resumed process would tune afresh and may pick other tiles (other last bits). Read when
        # an autotuner is built, at the kernels' first use (after this); TRITON_CACHE_DIR says where.
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        log.info("deterministic kernels (trainer.deterministic=true): reproducible steps, slower")
    _DETERMINISM.users += 1
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        _DETERMINISM.users -= 1
        if _DETERMINISM.users == 0:
            enabled, warn_only, cudnn_deterministic, cudnn_benchmark = _DETERMINISM.before
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
    return release


def start_processes(cfg: RunConfig, env: DistributedEnv) -> torch.device:
    """torch.distributed and megatron's parallel groups; returns this rank's device."""
    t, p = cfg.trainer, cfg.parallel
    if t.device == Device.cuda and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if t.device == Device.cpu and p.backend == CommBackend.auto:
        p.backend = CommBackend.gloo
    device = init_parallel(p, cfg.model, env)
    return torch.device("cpu") if t.device == Device.cpu else device


def host_memory_gib() -> float | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory_fit(cfg: RunConfig) -> None:
    """A CPU run whose weights, gradients and optimizer state alone exceed this machine's memory
    (a typo such as model.vocab_size=2**40) is refused naming the sizes, instead of dying in the
    allocator or the OOM killer. Activations are left out: the GPU memory model sizes them for
    kernels a CPU run does not use, so only the state that certainly has to fit is compared."""
    total = host_memory_gib()
    if total is None:
        return
    stage = memory_summary(cfg)["stages"][0]
    state = stage["weights"] + stage["grads"] + stage["optimizer"] + stage.get("teacher", 0.0)  # one process's
    if state > total:
        m = cfg.model
        raise UserError(
            f"the model's weights, gradients and optimizer state need ~{state:,.1f} GiB per process, and this "
            f"machine has {total:,.1f} GiB: check the model's size "
            f"(vocab_size={m.vocab_size}, hidden_size={m.hidden_size}, num_hidden_layers={m.num_hidden_layers}, "
            f"intermediate_size={m.intermediate_size}) or train on GPUs"
        )


def check_memory_fit(cfg: RunConfig, device: torch.device) -> None:
    """Refuse, before anything is allocated, a layout the memory model says overflows this GPU
    (an out-of-memory error would come minutes later, after the model and data are built); on
    CPU, a model whose state cannot fit the machine at all."""
    if device.type != "cuda":
        check_host_memory_fit(cfg)
        return
    device_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    peak = memory_summary(cfg)["peak_gib"]
    problem = memory_fit_problem(peak, device_gib, torch.cuda.get_device_name(device))
    if problem is None:
        return
    if not cfg.trainer.allow_memory_overflow:
        raise UserError(f"{problem}; trainer.allow_memory_overflow=true starts anyway")
    log.warning("WARNING: %s (starting anyway: trainer.allow_memory_overflow=true)", problem, extra=RANK_ZERO)


def lock_run_dir(run_dir: Path, job_id: str | None) -> RunLock | None:
    """Rank 0 takes the run directory's lock (released at exit); every rank learns the outcome,
    so a refused launch stops on all of them with rank 0's message (collective)."""
    lock, problem = None, ""
    if dist.get_rank() == 0:
        lock = RunLock(run_dir, job_id=job_id)
        try:
            lock.acquire()
            atexit.register(lock.release)  # any normal exit, an error included, frees the directory
        except UserError as exc:
            lock, problem = None, str(exc)
    problem = collectives.broadcast_object(problem, src=0)
    if problem:
        raise UserError(problem)
    return lock


def build_data(cfg: RunConfig, policy: Policy | None) -> Any:
    """This data-parallel rank's data: the recipe's corpus through the sequence-length schedule,
    or, for RL, the task's rollouts sampled with ``policy``."""
    t = cfg.trainer
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if cfg.rl is not None:
        data = build_rollout_data(
            cfg.rl, cfg.task, cfg.data, vocab_size=cfg.model.vocab_size, init_from=cfg.init.init_from, seed=t.seed,
            max_steps=t.max_steps, micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps,
            policy=policy, dp_rank=dp_rank, dp_size=dp_size,
        )  # fmt: skip
    else:
        data = build_scheduled_data(  # build_data itself unless trainer.seq_len_schedule is set
            cfg.data, t.seq_len, t.micro_batch_size, t.seq_len_schedule, t.grad_accum_steps, t.seed,
            dp_rank=dp_rank, dp_size=dp_size,
        )  # fmt: skip
    if data.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"the data's tokenizer has {data.vocab_size} tokens ({_data_vocab_key(cfg)}) but "
            f"model.vocab_size is {cfg.model.vocab_size}: its ids would index past the embedding; set "
            f"model.vocab_size={data.vocab_size} or more, or use the recipe the data was made for"
        )
    return data


def _data_vocab_key(cfg: RunConfig) -> str:
    """The recipe key that fixed the data's vocabulary, for the mismatch message."""
    if cfg.rl is not None:
        return "model.init_from / data.tokenizer"
    if cfg.data.source == DataSource.embedded:
        return f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size}"
    named = f", data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer else ""
    return f"the tokenizer recorded with data.paths{named}"


def build_model(cfg: RunConfig, device: torch.device) -> OrthrosForCausalLM:
    """This rank's shard of the model, built directly: random weights drawn from
    ``trainer.seed`` (the same at every TP size) or, with ``init.init_from``, a checkpoint's
    read tensor by tensor."""
    if not cfg.init.init_from:
        return build_parallel_model(cfg.model, cfg.parallel, seed=cfg.trainer.seed).to(device)
    try:
        weights = SafetensorsReader(cfg.init.init_from)  # opened first: a bad path fails before any build
    except NoSafetensorsError as exc:
        where = "it does not exist" if not Path(cfg.init.init_from).exists() else str(exc)
        raise UserError(
            f"model.init_from={cfg.init.init_from} holds no *.safetensors weights ({where}):"
            " run the job that writes it first (a recipe's comment names it; e.g. sft_tiny_cpu starts"
            " from `orthros-train --config-name tiny_cpu`), point it at a checkpoint's model/ or"
            " final/ directory, or set model.init_from=null to start from random weights"
        ) from exc
    except SafetensorsFileError as exc:  # a truncated or corrupt weights file, named with its size
        raise UserError(f"model.init_from={cfg.init.init_from}: {exc}") from exc
    model = build_parallel_model(cfg.model, cfg.parallel, seed=None)  # every weight is loaded next
    try:
        load_reference_shards(model, weights, cfg.model)
    except UserError as exc:  # tensors of another shape or name: name the model.* keys that differ
        differ = _config_difference(cfg)
        if not differ:  # a tensor missing, extra or not finite: say which weights
            raise UserError(f"model.init_from={cfg.init.init_from}: {exc}") from exc
        raise UserError(
            f"model.init_from={cfg.init.init_from} holds another model than the recipe's: {'; '.join(differ)}. "
            f"Set these model.* keys to the checkpoint's values (or start from a checkpoint of this shape) ({exc})"
        ) from exc
    for line in _config_difference(cfg, ATTENTION_SHAPE):
        # Same weights, another attention: legitimate (a study's arm, a context extension), but a
        # recipe that forgot the converted checkpoint's sinks or window trains another model than
        # the one converted, so it is said once, loudly.
        log.warning("model.init_from: %s; the run trains the recipe's setting", line)
    return model.to(device)


# Fields that change which keys a query attends but not the weights.
ATTENTION_SHAPE = ("sliding_window", "sink_tokens", "base_global_tail", "attention_type")


def _config_difference(cfg: RunConfig, only: tuple[str, ...] | None = None) -> list[str]:
    """``model.KEY=recipe value, X in init_from/config.json`` for every field that differs (of
    ``only``, when given)."""
    import json

    try:
        saved = json.loads((Path(cfg.init.init_from) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    ours = cfg.model.to_dict()
    # no effect on the weights
    ignored = {"attention_backend", "fused_tokenwise", "init_from", "max_position_embeddings", "extra"}
    return [
        f"model.{k}={ours[k]} in the recipe, {saved[k]} in {Path(cfg.init.init_from) / 'config.json'}"
        for k in sorted(set(saved) & set(ours))
        if k not in ignored and (only is None or k in only) and saved[k] != ours[k]
    ][:6]


def build_objective(
    cfg: RunConfig, model: torch.nn.Module, policy: Policy | None, device: torch.device, tokenizer: Any = None
) -> Objective:
    """Cross entropy, distillation from the dense teacher (``distill.enabled``; ``tokenizer``: the
    data's, which the teacher's must equal), or GRPO on ``policy``. With a KL term the frozen
    reference is a copy of the initial policy, sharded like it (taken before DeepSpeed partitions
    or steps it)."""
    if cfg.distill.enabled:
        teacher = build_teacher(cfg, device, tokenizer, _data_vocab_key(cfg))
        return Distillation(cfg, model, teacher, device)
    if cfg.rl is None:
        return CrossEntropy()
    reference = None
    if cfg.rl.kl_coef > 0:
        frozen = build_model(cfg, device)
        frozen.load_state_dict(model.state_dict())
        reference = Policy(device, module=frozen.eval().requires_grad_(False))
    return GRPOObjective(cfg.rl, cfg.data.loss_average, policy, reference, parallel_state.get_data_parallel_group())


__all__ = [
    "build_data",
    "build_model",
    "build_objective",
    "check_memory_fit",
    "lock_run_dir",
    "seed_everything",
    "set_determinism",
    "start_processes",
]
