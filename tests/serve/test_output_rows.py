"""Which rows of a step get an output token (orthros_train/serve/output_rows.py), without an engine:
every row the runner reads must be one, and a captured graph's row count must be its token count."""

from __future__ import annotations

import pytest
import torch

from orthros_train.serve.output_rows import plan_output_rows


def qsl_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def plan(lengths, **kwargs):
    qsl = qsl_of(lengths)
    n = int(qsl[-1])
    return plan_output_rows(qsl, kwargs.pop("num_tokens", n), n, max(lengths), **kwargs)


def test_one_output_token_per_request_at_its_last_row():
    p = plan([5, 1, 3])
    assert p.rows.tolist() == [4, 5, 8] and p.query_start_loc.tolist() == [0, 1, 2, 3]
    assert p.count == 3 and p.max_query_len == 1 and not p.every_row


def test_a_pure_decode_step_is_the_batch_itself():
    p = plan([1, 1, 1, 1])
    assert p.every_row and p.rows.tolist() == [0, 1, 2, 3] and p.count == 4


def test_speculative_verification_covers_every_draft_position():
    """vLLM reads the target logits of a request with d drafts at its last 1 + d rows
    (``_calc_spec_decode_metadata``); the plan's rows hold them for any d <= k, beside prefills."""
    k = 3
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n_req = int(torch.randint(1, 6, (1,), generator=g))
        drafts = torch.randint(0, k + 1, (n_req,), generator=g)
        prefill = torch.rand(n_req, generator=g) < 0.3
        lengths = [int(torch.randint(k + 2, 40, (1,), generator=g)) if pf else 1 + int(d)
                   for pf, d in zip(prefill, drafts)]
        sampled = [1 if pf else 1 + int(d) for pf, d in zip(prefill, drafts)]
        ends = qsl_of(lengths)[1:]
        read = [int(e) - s + i for e, s in zip(ends, sampled) for i in range(s)]
        p = plan(lengths, suffix=1 + k)
        assert set(read) <= set(p.rows.tolist()), (lengths, sampled)
        if max(lengths) > 1 + k:  # a prefill in the step: only the last 1 + k rows of each request
            assert p.rows.tolist() == [int(e) - min(n, 1 + k) + i for e, n in zip(ends, lengths)
                                       for i in range(min(n, 1 + k))]
        else:
            assert p.every_row


def test_prompt_logprob_requests_get_every_row():
    p = plan([6, 4, 3], full_requests={0, 2})
    assert p.rows.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert p.query_start_loc.tolist() == [0, 6, 7, 10] and p.count == 10 and p.max_query_len == 6


def test_padded_requests_have_no_output_rows():
    """Model Runner V2 pads the batch by repeating the last offset: such requests get none."""
    qsl = torch.tensor([0, 6, 9, 9, 9], dtype=torch.int32)
    p = plan_output_rows(qsl, 9, 9, 6, suffix=2)
    assert p.rows.tolist() == [4, 5, 7, 8] and p.query_start_loc.tolist() == [0, 2, 4, 4, 4]


def test_a_padded_request_writes_a_scratch_row_not_a_real_one_twice():
    """One output token per request: a request padded with no rows (Model Runner V2 repeats the
    last offset, here also at the front) reads a real row but writes the scratch row past the step's
    rows, so every real row is written once, by its own request."""
    qsl = torch.tensor([0, 0, 6, 9, 9, 9], dtype=torch.int32)
    p = plan_output_rows(qsl, 12, 9, 6)
    assert p.rows.tolist() == [0, 5, 8, 8, 8]
    assert p.destinations().tolist() == [12, 5, 8, 12, 12]
    real = [d for d in p.destinations().tolist() if d < 12]
    assert len(real) == len(set(real))
    # What the model does with them: the real rows keep their own request's values.
    y = torch.arange(5.0)[:, None]
    hidden = torch.full((13, 1), float("nan"))
    hidden[p.destinations()] = y
    assert hidden[5].item() == 1.0 and hidden[8].item() == 2.0


def test_a_captured_graph_gets_every_row_from_one_buffer():
    """A graph captured for N tokens replays with N output rows read at a fixed address: every row
    (padding included) from a persistent arange; only the scheduled rows count."""
    buffer = torch.arange(64)
    qsl = qsl_of([3, 1, 5])
    p = plan_output_rows(qsl, 16, 9, 5, graph=True, arange=buffer)
    assert p.every_row and p.rows.tolist() == list(range(16)) and p.count == 9
    assert p.rows.data_ptr() == buffer.data_ptr()
    request, keys = p.row_requests(torch.tensor([10, 4, 5], dtype=torch.int32))
    assert request[:9].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert keys.tolist() == [8, 9, 10, 4, 1, 2, 3, 4, 5] + [0] * 7


def test_bad_suffix_is_refused():
    with pytest.raises(ValueError, match="suffix must be >= 1"):
        plan([3], suffix=0)
