"""DeepSpeed ZeRO over the data-parallel group, with megatron-core's parallel state as ``mpu``.

DeepSpeed owns: data-parallel gradient averaging, ZeRO partitioning of optimizer states /
gradients / parameters (stages 1-3), optional optimizer offload to CPU, bf16 master weights,
gradient clipping with a global norm that counts tensor-parallel shards once, and gradient
accumulation boundaries. The optimizer itself is a plain ``torch.optim.AdamW`` (fused on CUDA):
DeepSpeed's FusedAdam/CPUAdam would first JIT-compile C++/CUDA extensions (minutes).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state

from orthros_train.parallel.setup import ParallelConfig


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
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=deepspeed_config(pcfg, micro_batch_size, grad_accum_steps, bf16, grad_clip),
        mpu=MegatronMPU,
        dist_init_required=False,
    )
    return engine
