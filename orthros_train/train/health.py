"""The run's health policy: non-finite steps are skipped (and too many stop the run), loss spikes
are flagged. Everything about NaN/Inf lives here.

A micro batch whose loss is NaN/Inf on a rank contributes zero gradients there: a gradient hook
on every trainable parameter replaces its gradient by zeros when the micro batch's flag (a device
tensor, never read on the host) says so. That keeps NaN out of everything the backward feeds,
DeepSpeed's ZeRO partitions and Adam's moments included, without a host sync per micro batch.
At the step's accumulation boundary one reduction over all ranks decides the step: if any micro
batch on any rank, or the gradient norm, was non-finite, the update is taken with lr = 0 and
zero gradients (the weights stay exactly as they were; Adam's moments decay by one step) and the
step is counted as skipped. ``max_nonfinite_steps`` skipped steps in a row stop the run.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from orthros_train.parallel import collectives

# The running mean a loss spike is measured against: an exponential moving average of the
# step losses with this weight on the past (about the last 20 steps).
SPIKE_EMA_DECAY = 0.95


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive NaN/Inf steps."""


class NonFiniteGuard:
    """Per micro batch: ``admit(loss)`` before its backward. Per step: ``step_is_finite`` at the
    accumulation boundary (collective), then ``count`` once the step's outcome is known."""

    def __init__(self, module: torch.nn.Module, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.skipped = 0  # skipped steps of the whole run (checkpointed with the counters)
        self.in_a_row = 0
        self._finite: torch.Tensor | None = None  # this micro batch's flag, read by the hooks
        self._seen_nonfinite: torch.Tensor | None = None  # any micro batch of this step, this rank
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self._mask)

    def _mask(self, grad: torch.Tensor) -> torch.Tensor:
        if self._finite is None:  # a backward outside the trainer's step (a test, a probe)
            return grad
        return torch.where(self._finite.to(grad.device), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def admit(self, loss: torch.Tensor) -> torch.Tensor:
        """This micro batch's flag (a device bool); its gradients are zeroed when it is False."""
        finite = torch.isfinite(loss.detach())
        self._finite = finite
        bad = ~finite
        self._seen_nonfinite = bad if self._seen_nonfinite is None else self._seen_nonfinite | bad
        return finite

    def step_is_finite(self) -> bool:
        """Collective over all ranks, once per step: did every micro batch of the step have a
        finite loss on every rank? Resets the step's flags."""
        seen = self._seen_nonfinite
        self._seen_nonfinite, self._finite = None, None
        return not collectives.any_flag(seen if seen is not None else False)

    def count(self, finite: bool, step: int, consumed_samples: int) -> None:
        """Record the step's outcome; raise ``NonFiniteTrainingError`` after too many in a row."""
        if finite:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteTrainingError(
                f"{self.in_a_row} consecutive steps with a NaN/Inf loss or gradient norm (last at step {step}); "
                f"stopping. Lower optim.lr, check the data near sample {consumed_samples}, or resume from an "
                "earlier checkpoint."
            )


def skip_update(optimizer: Any, module: torch.nn.Module) -> None:
    """Make the coming optimizer step leave the weights as they are: lr 0, zero gradients."""
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in module.parameters():
        if p.grad is not None:
            p.grad.zero_()


class LossSpikeDetector:
    """Flags a step whose loss exceeds ``factor`` x the running mean of the finite losses before
    it (``factor <= 0`` disables it)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.running: float | None = None

    def observe(self, loss: float) -> float | None:
        """The running mean ``loss`` is a spike against, or None when it is not one."""
        before = self.running
        self.running = loss if before is None else SPIKE_EMA_DECAY * before + (1 - SPIKE_EMA_DECAY) * loss
        if before is not None and self.factor > 0 and math.isfinite(loss) and loss > self.factor * before:
            return before
        return None


__all__ = ["LossSpikeDetector", "NonFiniteGuard", "NonFiniteTrainingError", "SPIKE_EMA_DECAY", "skip_update"]
