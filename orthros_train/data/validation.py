"""Which validation samples a data-parallel rank reads: the same fixed batches every call."""

from __future__ import annotations


def rank_micro_batches(
    num_samples: int, n: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
) -> list[list[int]]:
    """This rank's sample indices of the first ``n`` micro batches of a fixed set, dealt
    round-robin as ``ResumableSampler`` deals a global batch (rank ``r`` takes ``j * dp_size + r``
    of each batch); the last batch may be short, and none is returned past the end of the set."""
    out = []
    for b in range(n):
        first = b * micro_batch_size * dp_size + dp_rank
        idx = [i for i in range(first, first + micro_batch_size * dp_size, dp_size) if i < num_samples]
        if not idx:
            break
        out.append(idx)
    return out
