"""Which samples a rank reads next: a pure function of (seed, consumed samples, rank, world).

The global stream is sample 0, 1, 2, ... of a dataset of ``num_samples`` (already shuffled by
the dataset itself, e.g. megatron's shuffle index). A global batch of ``micro_batch_size *
dp_size`` consecutive stream positions is dealt round-robin: rank ``r`` takes positions
``consumed + j * dp_size + r`` for ``j < micro_batch_size``, so ranks are disjoint and together
cover the batch, and each rank touches only its own samples. Past the end of the dataset the
stream wraps into a new epoch, permuted by ``(seed, epoch)`` so epochs differ.

The state is one integer (global consumed samples) plus the seed as a guard; saving it with a
checkpoint and loading it resumes the exact sample sequence, also with another ``dp_size``.
"""

from __future__ import annotations

import numpy as np

from orthros_train.errors import UserError


class ResumableSampler:
    def __init__(self, num_samples: int, micro_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        if num_samples < 1:
            raise UserError("the dataset has no samples")
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise UserError(f"bad sampler shape: micro_batch_size={micro_batch_size}, rank {dp_rank} of {dp_size}")
        self.num_samples = int(num_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.consumed_samples = 0  # global, over all data-parallel ranks
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def dataset_index(self, position: int) -> int:
        """Dataset sample at global stream position ``position``."""
        epoch, offset = divmod(int(position), self.num_samples)
        if epoch == 0:
            return offset
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def positions(self, consumed: int | None = None) -> list[int]:
        base = self.consumed_samples if consumed is None else consumed
        return [base + j * self.dp_size + self.dp_rank for j in range(self.micro_batch_size)]

    def next_indices(self) -> list[int]:
        """This rank's dataset indices for the next micro batch; advances the global counter."""
        out = [self.dataset_index(p) for p in self.positions()]
        self.consumed_samples += self.global_batch
        return out

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if "seed" in state and int(state["seed"]) != self.seed:
            raise UserError(f"data state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.consumed_samples = int(state["consumed_samples"])
