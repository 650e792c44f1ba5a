"""DeepSpeed ZeRO over the data-parallel group, with megatron-core's parallel state as ``mpu``.

DeepSpeed owns: data-parallel gradient averaging, ZeRO partitioning of optimizer states /
gradients / parameters (stages 1-3), optional optimizer offload to CPU, bf16 master weights,
gradient clipping with a global norm that counts tensor-parallel shards once, and gradient
accumulation boundaries. The optimizer itself is a plain ``torch.optim.AdamW`` (fused on CUDA):
DeepSpeed's FusedAdam/CPUAdam would first JIT-compile C++/CUDA extensions (minutes).

Experts that are not the same on every data-parallel rank (expert parallelism, or TP under SP:
``parallel/moe.py``) use DeepSpeed's MoE support: their parameters are DeepSpeed MoE parameters,
the optimizer holds them in MoE param groups (``train/optim.py``), and DeepSpeed sums their
gradients over the expert-data-parallel group, divided by the data-parallel size (megatron's
``expert_gradient_scaling_factor``), and ZeRO partitions them over that group. The groups are
megatron's (``register_expert_groups``), so DeepSpeed reduces over exactly the ranks megatron's
dispatcher sends the experts' tokens from.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state

from orthros_train.errors import UserError
from orthros_train.parallel import collectives
from orthros_train.parallel.setup import ParallelConfig, expert_precision_problem


class MegatronMPU:
    """megatron-core's parallel state under the names DeepSpeed's ``mpu`` protocol uses.

    Without pipeline parallelism the model-parallel group is the tensor-parallel group. No
    ``get_sequence_parallel_*``: to DeepSpeed that means Ulysses, not megatron's SP, which lives
    inside the model and is invisible to the optimizer.

    DeepSpeed's data-parallel group is megatron's data x context parallel group: context-parallel
    ranks hold the same weights and each computes part of every sequence's gradient, so the
    gradients are averaged (and ZeRO partitions its states) over DP x CP ranks, as megatron's own
    distributed optimizer does (``with_context_parallel=True``).
    """

    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_data_parallel_group = staticmethod(partial(parallel_state.get_data_parallel_group, with_context_parallel=True))
    get_data_parallel_rank = staticmethod(partial(parallel_state.get_data_parallel_rank, with_context_parallel=True))
    get_data_parallel_world_size = staticmethod(
        partial(parallel_state.get_data_parallel_world_size, with_context_parallel=True)
    )
    get_pipeline_model_parallel_group = staticmethod(parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(parallel_state.get_pipeline_model_parallel_world_size)


def deepspeed_config(
    pcfg: ParallelConfig, micro_batch_size: int, grad_accum_steps: int, bf16: bool, grad_clip: float
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": pcfg.zero_stage}
    if pcfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if pcfg.zero_stage >= 2:
        zero.update({"overlap_comm": torch.cuda.is_available(), "contiguous_gradients": True})
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        # DeepSpeed checks this against its data-parallel world size, which counts CP ranks too
        # (see MegatronMPU); the CP ranks of one DP rank share the same micro batches.
        "train_batch_size": micro_batch_size * grad_accum_steps * pcfg.data_parallel * pcfg.context_parallel,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "gradient_clipping": grad_clip if grad_clip > 0 else 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # offload with a torch optimizer: no CPUAdam compile
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def is_expert_parameter(p: torch.Tensor) -> bool:
    """A DeepSpeed MoE parameter (``deepspeed.moe.utils.is_moe_param``): reduced over its
    expert-data-parallel group, not the data-parallel group."""
    return getattr(p, "allreduce", True) is False


def register_expert_groups(model: torch.nn.Module) -> bool:
    """File megatron's expert-parallel and expert-data-parallel groups under the ``group_name`` of
    the model's expert parameters in DeepSpeed's group registry; returns whether there are any.

    DeepSpeed would otherwise build its own expert groups (``deepspeed.utils.groups``), laid out
    inside the data-parallel group, which cannot express megatron's layout (experts split over TP
    ranks too, expert tensor parallel 1). Its registry is a module-level dict DeepSpeed reads by
    name; the pinned DeepSpeed range (``train/deepspeed_state.py``) is what this was verified with.
    """
    names = {p.group_name for p in model.parameters() if is_expert_parameter(p)}
    if not names:
        return False
    from deepspeed.utils import groups

    for name in names:
        groups._EXPERT_PARALLEL_GROUP[name] = parallel_state.get_expert_model_parallel_group()
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = parallel_state.get_expert_data_parallel_group()
    return True


def global_grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradients (DeepSpeed reports it only when ZeRO is on): TP-sharded
    tensors' shards summed over TP, replicated tensors once, routed experts once — every EP rank
    holds other experts (expert tensor parallel 1), whose gradients are equal across the
    expert-data-parallel ranks once reduced."""
    # Summed where the gradients are (no host copy per parameter); the cross-rank sums are reduced
    # on the device each group's backend needs (CUDA under NCCL).
    tp_group = parallel_state.get_tensor_model_parallel_group()
    sums: dict[str, list[torch.Tensor]] = {"tp": [], "replicated": [], "expert": []}
    for p in model.parameters():
        if p.grad is None:
            continue
        if is_expert_parameter(p):
            kind = "expert"
        else:
            kind = "tp" if getattr(p, "tensor_model_parallel", False) else "replicated"
        sums[kind].append(p.grad.detach().double().pow(2).sum())
    device = collectives.comm_device(tp_group)

    def total(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).sum().to(device) if parts else torch.zeros((), dtype=torch.float64, device=device)

    sharded, replicated, experts = total(sums["tp"]), total(sums["replicated"]), total(sums["expert"])
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        collectives.all_reduce(sharded, group=tp_group)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        collectives.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    return float((sharded + replicated + experts).sqrt())


def clip_grads_by_global_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (DeepSpeed's rule) with the norm
    of ``global_grad_norm``; returns the norm."""
    norm = global_grad_norm(model)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def build_engine(
    model: torch.nn.Module,
    pcfg: ParallelConfig,
    optimizer: torch.optim.Optimizer,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    bf16: bool = False,
    grad_clip: float = 0.0,
):
    """Wrap ``model`` and its ``optimizer`` in a DeepSpeed engine (``engine.optimizer`` inside).
    ``grad_clip <= 0`` disables clipping. The caller (the trainer) builds the optimizer, so this
    layer knows nothing of the recipe's ``optim``/``trainer`` groups."""
    import deepspeed

    # DeepSpeed's engine reads LOCAL_RANK from the environment and asserts it is there; torchrun
    # sets it, and a process started without a launcher is rank 0 of its node.
    os.environ.setdefault("LOCAL_RANK", "0")
    experts = register_expert_groups(model)
    problem = expert_precision_problem(pcfg, experts, bf16)  # a recipe's config refuses it first
    if problem:
        raise UserError(problem)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=deepspeed_config(pcfg, micro_batch_size, grad_accum_steps, bf16, grad_clip),
        mpu=MegatronMPU,
        dist_init_required=False,
    )
    if experts and pcfg.zero_stage == 0 and grad_clip > 0:
        # DeepSpeed's fp32 stage-0 clipping (runtime/utils.py: clip_grad_norm_) averages each
        # rank's norm over the data-parallel group, which under EP mixes norms of different
        # experts; this engine clips with the norm that counts every expert once. (ZeRO 1/2 count
        # them right: MoE param groups are partitioned over the expert-data-parallel group.)
        engine.clip_fp32_gradients = partial(clip_grads_by_global_norm, engine.module, grad_clip)
    return engine
