"""One optimizer step over ``grad_accum_steps`` micro batches.

The loss is the mean over the step's whole global batch (every micro batch, DP and CP rank;
``train/global_loss.py``), so neither the gradient nor the logged loss depends on how the batch
is split. The objective (``train/objective.py``) turns the step's batches into the layouts the
loss runs on; the NaN/Inf policy is ``train/health.py``'s. Nothing here reads a value back to the
host per micro batch: the loss units and FLOPs are counted on the host copies of the batches
before they move, the losses are summed on the device, and one reduction at the end carries
the step's statistics (one more decides a non-finite step, before the optimizer update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import parallel_state

from orthros_train.data import DataConfig
from orthros_train.model.config import OrthrosConfig
from orthros_train.parallel import collectives
from orthros_train.parallel.engine import global_grad_norm
from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.global_loss import global_loss_units, micro_batch_normalizer
from orthros_train.train.health import NonFiniteGuard, skip_update
from orthros_train.train.metrics import layout_flops
from orthros_train.train.objective import Objective


@dataclass
class StepStats:
    """What one optimizer step reports (global over the data-parallel group)."""

    loss: float
    lr: float
    grad_norm: float
    tokens: int
    flops: float  # model FLOPs of the step (every TP rank of a DP group computes the same layout: counted once)
    nonfinite: bool  # the update was skipped (or, under ZeRO, its gradient norm came out non-finite)
    objective: dict[str, float] = field(default_factory=dict)  # the objective's diagnostics (RL: rewards, KL)
    # MoE: the router losses' share of ``loss`` (load balancing + z-loss, weighted), None for dense models
    router_loss: float | None = None


def zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """A loss of 0 that reaches every trainable parameter: a micro batch with no labelled token
    still runs a backward, so that every rank joins DeepSpeed's gradient collectives."""
    return sum((p * 0).sum() for p in module.parameters() if p.requires_grad)


def tensor_parallel_grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradients, counting TP-sharded tensors' shards, replicated tensors
    and routed experts once each (DeepSpeed reports it only when ZeRO is on)."""
    return global_grad_norm(model)


class TrainStep:
    """The step a run takes ``max_steps`` times: ``__call__(batches, lr)``."""

    def __init__(
        self,
        engine: Any,
        objective: Objective,
        guard: NonFiniteGuard,
        model_config: OrthrosConfig,
        data_config: DataConfig,
        zero_stage: int,
        device: torch.device,
    ) -> None:
        self.engine = engine
        self.objective = objective
        self.guard = guard
        self.model_config = model_config
        self.data_config = data_config  # its loss_average: what the step's loss averages over
        self.zero_stage = zero_stage
        self.device = device

    def __call__(self, batches: list[OrthrosLayout], lr: float, step: int = 0) -> StepStats:
        """``step``: how many optimizer steps the run has taken before this one (an objective
        with stages, distillation's alignment, reads it)."""
        engine = self.engine
        engine.train()
        dp, dp_group = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_group()
        accum = len(batches)
        # Optional objective hooks (train/distill.py): the step's start on the host batches, a
        # micro batch's forward of its own, diagnostics known only after the forwards.
        begin = getattr(self.objective, "begin_step", None)
        forward = getattr(self.objective, "forward", None)
        finish = getattr(self.objective, "step_stats", None)
        if begin is not None:
            begin(step, batches)
        # Counted on the host copies: on the device each count would wait for the GPU.
        units = global_loss_units(batches, self.data_config.loss_average, dp_group)
        flops = sum(layout_flops(self.model_config, b) for b in batches)
        extra_flops = getattr(self.objective, "extra_flops", None)  # work beside the model's (a teacher's forward)
        if extra_flops is not None:
            flops += sum(extra_flops(b) for b in batches)
        tokens = sum(b.num_tokens for b in batches)
        prepared = self.objective.prepare([b.to(self.device) for b in batches], units)
        normalizer = micro_batch_normalizer(units, accum, dp)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        router_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        has_router = False
        grad_norm = math.nan
        finite = True
        for layout in prepared.layouts:
            out = engine(layout, loss_normalizer=normalizer) if forward is None else forward(engine, layout, normalizer)
            loss = out.loss
            if out.router_loss is not None:
                has_router = True
                router_sum += out.router_loss.double()
            if loss is None:  # no labelled token in this micro batch: it adds nothing
                loss = zero_loss(engine.module)
            ok = self.guard.admit(loss)
            engine.backward(loss)  # DeepSpeed scales by 1 / grad_accum_steps
            loss_sum += torch.where(ok, loss.detach().double(), 0.0)
            if engine.is_gradient_accumulation_boundary():
                finite = self.guard.step_is_finite()  # collective: the one host read before the update
                if finite and self.zero_stage == 0:
                    grad_norm = tensor_parallel_grad_norm(engine.module)
                    finite = math.isfinite(grad_norm)
                for group in engine.optimizer.param_groups:
                    group["lr"] = lr
                if not finite:
                    skip_update(engine.optimizer, engine.module)
            engine.step()  # steps the optimizer at the accumulation boundary only
        zero_norm = engine.get_global_grad_norm()  # None without ZeRO: the norm above
        if zero_norm is not None:
            grad_norm = float(zero_norm)
            # under ZeRO the norm is known only after the update: count it, stop if it repeats
            finite = finite and math.isfinite(grad_norm)
        # Every DP rank holds its share of the global mean: their sum is the step's loss.
        if prepared.values is not None:  # the objective's own value (GRPO)
            loss_sum = loss_sum.new_tensor(sum(prepared.values))
        else:
            loss_sum = loss_sum / (accum * dp)
        stats = collectives.reduce_floats([loss_sum, float(tokens), flops, router_sum / (accum * dp)], group=dp_group)
        objective_stats = {**prepared.stats, **(finish() if finish is not None else {})}
        return StepStats(
            loss=float(stats[0]) if finite else math.nan,
            lr=lr,
            grad_norm=grad_norm,
            tokens=int(stats[1]),
            flops=float(stats[2]),
            nonfinite=not finite,
            objective=objective_stats,
            router_loss=float(stats[3]) if has_router else None,
        )


__all__ = ["StepStats", "TrainStep", "tensor_parallel_grad_norm", "zero_loss"]
