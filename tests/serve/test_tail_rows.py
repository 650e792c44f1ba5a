"""Which base rows of a vLLM step are global (orthros_train/serve/tail_rows.py), without an engine:
the same tokens ``keys.prompt_tail_flags`` marks for the package's prefill and decode, however the
scheduler splits a prompt into chunks or reads a prefix from the cache."""

from __future__ import annotations

import torch

from orthros_train.ops.keys import prompt_tail_flags
from orthros_train.serve.output_rows import every_row
from orthros_train.serve.tail_rows import plan_tail_rows, tail_row_keys


def random_step(g, n_req):
    """Per request: prompt length, tokens already cached, tokens scheduled now (a chunk of the prompt,
    the rest of it, or decode / verification rows past it)."""
    prompt, cached, new = [], [], []
    for _ in range(n_req):
        p = int(torch.randint(1, 60, (1,), generator=g))
        c = int(torch.randint(0, p + 8, (1,), generator=g))  # past p: generated tokens in the cache
        q = int(torch.randint(1, 30, (1,), generator=g))
        if c < p:
            q = min(q, p - c)  # a prefill chunk never runs past its prompt
        prompt.append(p)
        cached.append(c)
        new.append(q)
    return prompt, cached, new


def expected_flags(prompt, cached, new, tail):
    """The package's own rule, row by row: the flags of each request's scheduled positions."""
    return torch.cat([prompt_tail_flags(q, c, p, tail) for p, c, q in zip(prompt, cached, new)])


def test_host_plan_marks_the_rows_the_package_marks():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n_req = int(torch.randint(1, 6, (1,), generator=g))
        tail = int(torch.randint(1, 40, (1,), generator=g))
        prompt, cached, new = random_step(g, n_req)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([c + q for c, q in zip(cached, new)], dtype=torch.int32)
        want = expected_flags(prompt, cached, new, tail)
        plan = plan_tail_rows(qsl, seq, torch.tensor(prompt), tail)
        got = torch.zeros(int(qsl[-1]), dtype=torch.bool)
        if plan is None:
            assert not want.any(), trial
            continue
        got[plan.rows] = True
        assert torch.equal(got, want), (trial, prompt, cached, new, tail)
        # A suffix of each request's rows, aligned to its end: what the suffix attention takes.
        counts = plan.query_start_loc[1:] - plan.query_start_loc[:-1]
        assert counts.tolist() == [int(want[int(a):int(b)].sum()) for a, b in zip(qsl[:-1], qsl[1:])]
        assert plan.count == int(want.sum()) and plan.max_query_len == int(counts.max())
        # Each global row sees every key of its request up to its own (row_requests' key count).
        request, keys = plan.row_requests(seq)
        positions = torch.cat([torch.arange(c, c + q) for c, q in zip(cached, new)])
        assert torch.equal(keys.long(), positions[plan.rows] + 1)
        assert request.tolist() == [r for r, n in enumerate(counts.tolist()) for _ in range(n)]


def test_device_keys_mark_the_rows_the_package_marks_and_padding_reads_nothing():
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        n_req = int(torch.randint(1, 6, (1,), generator=g))
        tail = int(torch.randint(1, 40, (1,), generator=g))
        prompt, cached, new = random_step(g, n_req)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([c + q for c, q in zip(cached, new)], dtype=torch.int32)
        n = int(qsl[-1])
        request, keys = every_row(qsl, n + 3, n, max(new)).row_requests(seq)  # three padding rows
        lengths = torch.tensor(prompt + [1000], dtype=torch.int32)  # a stale entry past the batch
        got = tail_row_keys(request, keys, lengths, tail)
        want = expected_flags(prompt, cached, new, tail)
        assert torch.equal(got[:n] > 0, want)
        assert torch.equal(got[:n][want], keys[:n][want])
        assert torch.count_nonzero(got[n:]) == 0


def test_chunked_prompt_gets_the_same_global_rows_as_one_read():
    """R larger than the prompt's last chunk: the chunk before it has global rows too."""
    prompt, tail = 100, 30
    whole = plan_tail_rows(torch.tensor([0, prompt], dtype=torch.int32), torch.tensor([prompt]),
                           torch.tensor([prompt]), tail)
    assert whole.rows.tolist() == list(range(70, 100))
    chunks = [(0, 64), (64, 16), (80, 20)]  # (cached, new): the last chunk is shorter than R
    rows = []
    for cached, new in chunks:
        plan = plan_tail_rows(torch.tensor([0, new], dtype=torch.int32), torch.tensor([cached + new]),
                              torch.tensor([prompt]), tail)
        rows += [] if plan is None else [cached + int(r) for r in plan.rows]
    assert rows == list(range(70, 100))
    # A decode step: the generated token is global; R = 0 is never planned (the paper's layer).
    decode = plan_tail_rows(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([101]), torch.tensor([prompt]), tail)
    assert decode.rows.tolist() == [0]
    early = plan_tail_rows(torch.tensor([0, 32], dtype=torch.int32), torch.tensor([32]), torch.tensor([prompt]), tail)
    assert early is None
