"""What a training step optimises, given the step's micro batches.

Every data source yields ``OrthrosLayout`` batches; an ``Objective`` turns one step's micro
batches into the layouts the model's loss runs on, ``sum(w * CE) / normaliser`` (the same loss
for every phase, ``train/global_loss.py``). Cross entropy (pretraining, SFT) trains on the
batches as they are; GRPO (``train/rl/objective.py``) rewrites their weights so that the same
loss has the GRPO gradient. The step itself (``train/step.py``) knows nothing else of either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from orthros_train.phase.layout import OrthrosLayout


@dataclass
class PreparedStep:
    """One step's micro batches as the model trains on them.

    layouts  what each micro batch's forward and backward run on
    values   each micro batch's share of the step's objective value, where the objective
             computes it itself (GRPO's loss is not the layout loss); None: the layout loss is it
    stats    the step's diagnostics (global over the data-parallel group), logged with the step
    """

    layouts: list[OrthrosLayout]
    values: list[float] | None = None
    stats: dict[str, float] = field(default_factory=dict)


class Objective(Protocol):
    # whether a loss far above its running mean deserves a warning (not for GRPO, whose loss
    # hovers around 0 with either sign)
    watch_loss_spikes: bool

    def prepare(self, batches: Sequence[OrthrosLayout], units: int) -> PreparedStep:
        """``batches``: the step's micro batches on this rank (on the training device); ``units``:
        the step's loss units over all micro batches and data-parallel ranks."""
        ...


class CrossEntropy:
    """Pretraining and SFT: the weighted cross entropy of the batches' labels."""

    watch_loss_spikes = True

    def prepare(self, batches: Sequence[OrthrosLayout], units: int) -> PreparedStep:
        return PreparedStep(list(batches))


__all__ = ["CrossEntropy", "Objective", "PreparedStep"]
