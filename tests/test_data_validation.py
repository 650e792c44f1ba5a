"""The validation batches of each data-parallel rank (``data/validation.py``), which the
pretraining and SFT data objects both read through."""

from __future__ import annotations

from orthros_train.data.validation import rank_micro_batches


def test_ranks_split_each_validation_batch_like_the_sampler():
    # 2 ranks, micro batch 3: batch b covers samples 6b..6b+5, rank r takes every other one
    assert rank_micro_batches(100, 2, 3, 0, 2) == [[0, 2, 4], [6, 8, 10]]
    assert rank_micro_batches(100, 2, 3, 1, 2) == [[1, 3, 5], [7, 9, 11]]
    assert rank_micro_batches(100, 2, 3) == [[0, 1, 2], [3, 4, 5]]


def test_the_end_of_the_set_shortens_then_stops():
    assert rank_micro_batches(8, 5, 3, 1, 2) == [[1, 3, 5], [7]]
    assert rank_micro_batches(7, 5, 3, 1, 2) == [[1, 3, 5]]  # rank 1's second batch would start at 7
    assert rank_micro_batches(0, 3, 2) == []
    # every sample of the covered batches is read once over the ranks
    seen = sorted(i for r in range(4) for b in rank_micro_batches(50, 3, 2, r, 4) for i in b)
    assert seen == list(range(24))
