"""The two streams under sequence parallelism: which rows of ``[base; output]`` a TP rank holds.

Shared by the attention, the MLPs and the mixture of experts (``parallel/model.py``,
``parallel/moe.py``).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

from orthros_train.model.orthros import AttentionPlan


class StreamShards:
    """Token-dimension bookkeeping of the two streams under sequence parallelism.

    Base and output streams are padded separately to multiples of ``shards`` (the TP size under
    SP, else 1); rank r holds ``[x_r; y_r]``. Gathering yields ``[x_0; y_0; x_1; y_1; ...]``,
    which ``split`` reorders into the full ``x`` and ``y``; ``join`` is the inverse order, so a
    reduce-scatter hands every rank its own ``[x_r; y_r]`` back.
    """

    def __init__(self, plan: AttentionPlan, shards: int) -> None:
        self._set(plan.num_base, plan.num_outputs, shards)

    @classmethod
    def of_rows(cls, n_base: int, n_out: int, shards: int) -> "StreamShards":
        """The shards of ``n_base`` base rows followed by ``n_out`` output rows (an MLP call's)."""
        shards_ = cls.__new__(cls)
        shards_._set(n_base, n_out, shards)
        return shards_

    def _set(self, n_base: int, n_out: int, shards: int) -> None:
        self.shards = shards
        self.n_base, self.n_out = n_base, n_out
        self.base_local = -(-n_base // shards)
        self.out_local = -(-n_out // shards)

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows ``[x_r; y_r]`` (padding included) of a full ``[x; y]`` tensor."""
        x, y = full[: self.n_base], full[self.n_base :]
        per_rank = self.join(x, y).view(self.shards, self.base_local + self.out_local, *full.shape[1:])
        return per_rank[rank]

    def pad(self, x: torch.Tensor, n_local: int) -> torch.Tensor:
        missing = n_local * self.shards - x.shape[0]
        return torch.cat([x, x.new_zeros((missing, *x.shape[1:]))]) if missing else x

    def split(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered ``[x_0; y_0; x_1; y_1; ...]`` -> ``x``, ``y`` (padding removed)."""
        per_rank = full.view(self.shards, self.base_local + self.out_local, *full.shape[1:])
        x = per_rank[:, : self.base_local].reshape(-1, *full.shape[1:])
        y = per_rank[:, self.base_local :].reshape(-1, *full.shape[1:])
        return x[: self.n_base], y[: self.n_out]

    def join(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.pad(x, self.base_local).view(self.shards, self.base_local, *x.shape[1:])
        y = self.pad(y, self.out_local).view(self.shards, self.out_local, *y.shape[1:])
        return torch.cat([x, y], dim=1).reshape(-1, *x.shape[2:])


def gather_tokens(h: torch.Tensor, sequence_parallel: bool, output_grad_partial: bool = True) -> torch.Tensor:
    """This rank's tokens -> every rank's (SP), or the same tensor with its gradient summed over
    the TP group (TP alone: each rank's column-parallel linears see part of the heads)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(h[:, None], tensor_parallel_output_grad=output_grad_partial)[:, 0]
    return copy_to_tensor_model_parallel_region(h) if output_grad_partial else h
