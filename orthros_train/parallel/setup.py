"""Process groups and the parallel layout: torch.distributed + megatron-core parallel state."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from orthros_train.model.config import OrthrosConfig
from orthros_train.options import CommBackend, Recompute
from orthros_train.parallel.cpu_shims import apply_cpu_shims


@dataclass
class ParallelConfig:
    """The ``parallel/`` recipe group."""

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1  # ranks one packed sequence is split across (long context)
    # ranks a sparse layer's experts are split across (megatron-core's expert parallelism)
    expert_parallel: int = 1
    # None: follows the world size, world_size / (tensor_parallel x context_parallel); a number is
    # checked against it (orthros_train/train/config.py resolves the batch geometry)
    data_parallel: int | None = None
    zero_stage: int = 1  # DeepSpeed ZeRO stage over the data-parallel group (0-3)
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU memory
    backend: CommBackend = CommBackend.auto
    timeout_minutes: int = 30
    # Activation recompute: "none"; "selective" (attention core recomputed in the backward:
    # its inputs are kept, its softmax intermediates are not); "full" (each layer recomputed
    # from its input, megatron's recompute_granularity=full/uniform).
    recompute: Recompute = Recompute.none
    # The processes the layout is planned for: a dry run plans for it (the memory estimate, the
    # accumulation steps); a launch uses the launcher's count. None: data_parallel (or 1) x TP x CP.
    world_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "context_parallel", "expert_parallel", "data_parallel", "world_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {value}")
        self.recompute = Recompute.parse(self.recompute, "parallel.recompute")
        self.backend = CommBackend.parse(self.backend, "parallel.backend")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("parallel.offload_optimizer needs parallel.zero_stage >= 1")


def check_parallel_layout(pcfg: ParallelConfig, model: OrthrosConfig, world_size: int | None = None) -> None:
    """Fail fast with the numbers that do not divide (before any model is built). With
    ``world_size``, a layout without ``data_parallel`` takes world_size / (TP x CP) as its own."""
    problems = []
    tp = pcfg.tensor_parallel
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(model, name)
        if value % tp:
            problems.append(f"model.{name}={value} is not divisible by parallel.tensor_parallel={tp}")
    cp = pcfg.context_parallel
    if world_size is not None:
        model_ranks = tp * cp
        if world_size % model_ranks:
            problems.append(
                f"world size {world_size} is not divisible by parallel.tensor_parallel={tp} x "
                f"parallel.context_parallel={cp} = {model_ranks}"
            )
        elif pcfg.data_parallel is None:
            pcfg.data_parallel = world_size // model_ranks
        elif world_size // model_ranks != pcfg.data_parallel:
            dp = world_size // model_ranks
            problems.append(
                f"world size {world_size} / (parallel.tensor_parallel={tp} x parallel.context_parallel={cp}) = "
                f"{dp} data-parallel ranks, but parallel.data_parallel={pcfg.data_parallel}; launch "
                f"{pcfg.data_parallel * model_ranks} processes, or leave parallel.data_parallel unset (null) "
                "so that it follows the world size"
            )
    if problems:
        raise ValueError("impossible parallel layout: " + "; ".join(problems))


DEFAULT_MASTER_PORT = 29500  # torchrun's default rendezvous port


@dataclass
class DistributedEnv:
    """What the launcher (torchrun / Slurm) told this process; read at the entry point only."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # True under torchrun/srun/deepspeed: rendezvous at master_addr:master_port
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    restart_count: int = 0  # torchrun --max-restarts: which attempt this is
    agent_store: bool = False  # torchrun's agent already serves the store at master_port


def init_parallel(pcfg: ParallelConfig, model: OrthrosConfig, env: DistributedEnv) -> torch.device:
    """Start torch.distributed (a private 1-process group when not launched) and megatron's
    tensor/data-parallel groups; returns this process's device."""
    check_parallel_layout(pcfg, model, env.world_size)
    apply_cpu_shims()
    use_cuda = torch.cuda.is_available()
    backend = pcfg.backend if pcfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if use_cuda:
        # Before any group exists: NCCL's object collectives and barriers run on the current
        # CUDA device, which must be this rank's own (not cuda:0 on every rank of a node).
        torch.cuda.set_device(env.local_rank)
    # NCCL groups bound to this rank's device (barriers and object collectives use it, and
    # torch stops guessing it); gloo takes no device.
    bind = {"device_id": torch.device("cuda", env.local_rank)} if use_cuda and backend == "nccl" else {}
    if not dist.is_initialized():
        timeout = timedelta(minutes=pcfg.timeout_minutes)
        if env.launched:
            # Keys in the rendezvous store are namespaced by restart attempt: after a rank dies
            # and torchrun restarts everyone, the new groups must not read the dead attempt's
            # addresses (gloo/nccl would try to connect to ports nobody listens on).
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=env.rank == 0 and not env.agent_store,
                timeout=timeout,
            )
            store = dist.PrefixStore(f"orthros/attempt_{env.restart_count}", store)
            dist.init_process_group(
                backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **bind
            )
        else:
            # One process, no launcher: an in-memory store, so no port can be taken by another
            # process between choosing it and binding it.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bind)
    from megatron.core import parallel_state  # here: configs and dry runs need no megatron (~6 s to import)

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=pcfg.tensor_parallel, context_parallel_size=pcfg.context_parallel
        )
    return torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
