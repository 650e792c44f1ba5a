"""Process groups and the parallel layout: torch.distributed + megatron-core parallel state."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from orthros_train.errors import UserError
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
    # Regional torch.compile of the token-wise parts of every layer (norms, RoPE, SwiGLU's
    # activation; parallel/compile.py): same weights and names, fewer passes over the activations.
    compile: bool = False
    # The processes the layout is planned for: a dry run plans for it (the memory estimate, the
    # accumulation steps); a launch uses the launcher's count. None: data_parallel (or 1) x TP x CP.
    world_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "context_parallel", "expert_parallel", "data_parallel", "world_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"parallel.{name} must be >= 1, got {value}")
        self.recompute = Recompute.parse(self.recompute, "parallel.recompute")
        self.backend = CommBackend.parse(self.backend, "parallel.backend")
        if self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise UserError("parallel.offload_optimizer needs parallel.zero_stage >= 1")


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
    problems += _expert_layout_problems(pcfg, model, world_size)
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
        raise UserError("impossible parallel layout: " + "; ".join(problems))


def _expert_layout_problems(pcfg: ParallelConfig, model: OrthrosConfig, world_size: int | None) -> list[str]:
    """What expert parallelism (megatron-core's layout with expert tensor parallel = 1: whole experts
    on a rank, ``expert_parallel`` consecutive ranks share a layer's experts) cannot run."""
    ep, tp, cp = pcfg.expert_parallel, pcfg.tensor_parallel, pcfg.context_parallel
    if not model.num_experts:
        if ep > 1:
            return [
                f"parallel.expert_parallel={ep} but the model is dense (model.num_experts=0): set "
                "parallel.expert_parallel=1, or give the model experts"
            ]
        return []
    problems = []
    if model.num_experts % ep:
        problems.append(
            f"model.num_experts={model.num_experts} is not divisible by parallel.expert_parallel={ep} (every "
            "expert-parallel rank holds the same number of whole experts)"
        )
    world = world_size or pcfg.world_size
    if world is None and pcfg.data_parallel is not None:
        world = pcfg.data_parallel * tp * cp
    if world is not None and world % ep:
        problems.append(
            f"world size {world} is not divisible by parallel.expert_parallel={ep} (megatron-core's expert layout: "
            "world = expert_parallel x expert-data-parallel ranks); launch a multiple of it (a dry run: set "
            "parallel.world_size to one)"
        )
    if tp > 1 and not pcfg.sequence_parallel:
        # Each token must be routed once: without SP every TP rank holds every token and would send
        # it to the experts again (megatron-core requires SP with MoE and TP for the same reason).
        problems.append(
            f"a mixture of experts with parallel.tensor_parallel={tp} needs parallel.sequence_parallel=true "
            "(each TP rank routes its own slice of the tokens)"
        )
    distinct_experts = ep > 1 or tp > 1  # experts whose gradients reduce over their own group
    if distinct_experts and pcfg.zero_stage == 3:
        problems.append(
            f"parallel.zero_stage=3 with experts split over ranks (parallel.expert_parallel={ep}, "
            f"parallel.tensor_parallel={tp}) is not supported: DeepSpeed's ZeRO-3 partitions every parameter over "
            "the data-parallel group, which does not hold the same experts; use parallel.zero_stage=1 or 2"
        )
    if ep > 1 and cp > 1:
        problems.append(
            f"parallel.expert_parallel={ep} with parallel.context_parallel={cp} is not supported (untested "
            "layout); use parallel.context_parallel=1, or parallel.expert_parallel=1"
        )
    return problems


def expert_precision_problem(pcfg: ParallelConfig, sparse: bool, bf16: bool) -> str | None:
    """Why bf16 cannot run with this layout's experts, or None."""
    split = sparse and (pcfg.expert_parallel > 1 or pcfg.tensor_parallel > 1)
    if not (split and bf16 and pcfg.zero_stage == 0):
        return None
    return (
        "trainer.precision=bf16 with parallel.zero_stage=0 and experts split over ranks (parallel.expert_parallel="
        f"{pcfg.expert_parallel}, parallel.tensor_parallel={pcfg.tensor_parallel}) is not supported: DeepSpeed's "
        "stage-0 bf16 optimizer clips with a norm that counts each rank's experts as if they were replicas; use "
        "parallel.zero_stage=1 or 2"
    )


def check_expert_layout(pcfg: ParallelConfig, model: OrthrosConfig, world_size: int | None = None) -> None:
    """The expert-parallel part of ``check_parallel_layout`` (what a recipe's config already
    decides, before any process group exists)."""
    problems = _expert_layout_problems(pcfg, model, world_size)
    if problems:
        raise UserError("impossible parallel layout: " + "; ".join(problems))


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
        # Experts follow megatron-core's MoE layout with expert tensor parallel = 1: whole experts on
        # a rank, expert_parallel consecutive ranks (inside the TP group first) split a layer's
        # experts, the world / expert_parallel ranks holding the same experts form the
        # expert-data-parallel group (what the memory model assumes).
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=pcfg.tensor_parallel,
            context_parallel_size=pcfg.context_parallel,
            expert_model_parallel_size=pcfg.expert_parallel,
            expert_tensor_parallel_size=1,
        )
    return torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
