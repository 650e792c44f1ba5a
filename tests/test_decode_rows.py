"""ops/decode_rows.py, the static decode step's attention, on both implementations against
``reference.attention_naive`` (the Triton one under the interpreter; also run under triton 3.6 by
``make test-triton36``: it needs torch and triton only)."""

from __future__ import annotations

import pytest
import torch

from orthros_train.ops.decode_rows import decode_rows_torch, decode_rows_triton
from orthros_train.ops.reference import UNBOUNDED, attention_naive


def rows_case(lengths: list[int], capacity: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    q = torch.randn(groups * b, 4, 16, generator=g)
    k = torch.randn(b * capacity, 2, 16, generator=g)
    v = torch.randn(b * capacity, 2, 16, generator=g)
    return q, k, v, torch.tensor(lengths)


def naive_rows(q, k, v, lengths, capacity, windows, sinks):
    """The same queries through the definition: one document of ``capacity`` keys per row."""
    b = lengths.numel()
    q_index = (torch.arange(b) * capacity + lengths).repeat(len(windows))
    q_window = torch.tensor(windows).repeat_interleave(b)
    cu = torch.arange(b + 1) * capacity
    return attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sinks)[0]


@pytest.mark.parametrize("op", [decode_rows_torch, decode_rows_triton], ids=["torch", "triton"])
@pytest.mark.parametrize(
    "windows,sinks", [((5, UNBOUNDED), 0), ((5, UNBOUNDED), 3), ((UNBOUNDED,), 0), ((5,), 2), ((1,), 3)]
)
def test_decode_rows_equal_the_definition(op, windows, sinks):
    # lengths: at 0 (only its own key), inside the sinks, just past the window, and the last slot
    lengths, capacity = [0, 2, 7, 23], 24
    q, k, v, lens = rows_case(lengths, capacity, len(windows))
    got = op(q, k, v, lens, capacity, windows, sinks)
    want = naive_rows(q, k, v, lens, capacity, windows, sinks)
    assert (got - want).abs().max() < 2e-5


def test_decode_rows_ignore_slots_past_each_length():
    q, k, v, lens = rows_case([3, 9], 16, 2)
    before = decode_rows_torch(q, k, v, lens, 16, (4, UNBOUNDED), 1)
    k2, v2 = k.clone(), v.clone()
    for row, length in enumerate([3, 9]):  # what a frozen row leaves there: finite, but anything
        k2[row * 16 + length + 1 : (row + 1) * 16] = 1e4
        v2[row * 16 + length + 1 : (row + 1) * 16] = -1e4
    for op in (decode_rows_torch, decode_rows_triton):
        assert torch.equal(op(q, k2, v2, lens, 16, (4, UNBOUNDED), 1), op(q, k, v, lens, 16, (4, UNBOUNDED), 1))
    assert (decode_rows_torch(q, k2, v2, lens, 16, (4, UNBOUNDED), 1) - before).abs().max() == 0


def test_decode_rows_refuse_a_query_count_that_is_not_groups_of_rows():
    q, k, v, lens = rows_case([3, 9], 16, 2)
    with pytest.raises(ValueError, match="4 queries for 1 groups of 2 rows"):
        decode_rows_torch(q, k, v, lens, 16, (4,))
