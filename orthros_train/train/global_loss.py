"""One loss per optimizer step: the mean over the whole global batch.

A step's batch is spread over ``grad_accum_steps`` micro-batches on each of ``dp`` data-parallel
ranks (context-parallel ranks share their DP rank's micro-batches). Averaging each micro-batch by
itself and letting DeepSpeed average those averages weighs a token by how many others happen to
share its micro-batch, so the gradient of a step would depend on how samples fall into
micro-batches and ranks. Instead the trainer counts the step's *loss units* first (labelled
tokens, or with ``data.loss_average=sequence`` sequences) over every micro-batch and DP rank, and
each micro-batch's loss is ``sum(w * CE) / (units / (grad_accum_steps * dp))``. DeepSpeed divides
every backward by ``grad_accum_steps`` and averages gradients over its data-parallel group, so
the step's gradient is that of ``sum over the global batch of w * CE / units``: the same for any
split of the batch.

In sequence mode the data's loss weights already hold ``1 / n_d`` for a token of a sequence with
``n_d`` labelled tokens (``orthros_train.data.sft.average_per_sequence``), so dividing by the
number of sequences gives the mean over sequences of their mean token loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from orthros_train.options import LossAverage
from orthros_train.parallel import collectives
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout


def loss_units(layout: OrthrosLayout, loss_average: LossAverage | str) -> int:
    """What the loss of ``layout`` averages over: labelled output tokens (``token``) or documents
    with at least one labelled token (``sequence``)."""
    loss_average = LossAverage.parse(loss_average, "loss_average")
    valid = layout.labels != IGNORE_INDEX
    if loss_average == LossAverage.token:
        return int(valid.sum())
    doc = layout.document_ids()[layout.output_index][valid]
    return int(torch.unique(doc).numel())


def global_loss_units(
    layouts: Sequence[OrthrosLayout], loss_average: LossAverage | str, group: dist.ProcessGroup | None = None
) -> int:
    """Loss units of a whole step: this rank's micro-batches summed over the data-parallel
    ``group`` (one collective per step)."""
    local = float(sum(loss_units(x, loss_average) for x in layouts))
    if group is None:
        return int(local)
    return int(collectives.reduce_floats([local], group=group)[0])


def micro_batch_normalizer(units: int, grad_accum_steps: int, data_parallel: int) -> float:
    """What each micro-batch divides ``sum(w * CE)`` by, so that DeepSpeed's ``1 /
    grad_accum_steps`` scaling and its mean over ``data_parallel`` ranks leave ``1 / units``."""
    return max(units, 1) / (grad_accum_steps * data_parallel)


__all__ = ["global_loss_units", "loss_units", "micro_batch_normalizer"]
