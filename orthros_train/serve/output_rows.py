"""Which rows of a vLLM step carry an output-stream token (torch only: planned and tested without vLLM).

vLLM hands the model a flat batch of scheduled tokens, ``query_start_loc`` (row offsets per
request) marking each request's rows. The runner reads hidden states at some of those rows:

* the last row of every request (``query_start_loc[1:] - 1``): the next-token logits;
* under speculative decoding, the last ``1 + d`` rows of a request verifying ``d`` draft tokens
  (``d <= num_speculative_tokens``): the target logits of every draft position and the bonus one;
* for a request that asks for prompt logprobs, every row of each of its prefill chunks.

Only the output stream predicts, so each of those rows needs an output token. A request's output
rows are always a *suffix* of its scheduled rows: the last ``m_r`` of its ``q_r`` rows, so the
output attention is plain causal attention with queries aligned to the end of the request's
cached keys (query ``i`` of ``m_r`` sees ``seq_len - m_r + 1 + i`` keys), which every paged
attention kernel takes with an output ``query_start_loc`` of cumulative ``m_r``. Output tokens
are independent of each other (none attends another), so a row given an output token that nobody
reads changes no other row: covering more rows than needed is only extra work.

``plan_output_rows`` picks ``m_r``:

* every row (``m_r = q_r``) when the step runs a captured CUDA graph (the graph is keyed by the
  token count alone, so the output row count must be that count too, padding rows included) and
  when no request has more rows than ``suffix`` (a pure decode step, or a pure verification step
  under speculative decoding): then the output stream is the batch itself, in order;
* ``m_r = min(q_r, suffix)`` otherwise, with ``suffix = 1 + num_speculative_tokens`` (1 without
  speculation: one output token per request), and ``m_r = q_r`` for the requests that asked for
  prompt logprobs (the pretraining layout for that request only).

Without speculation and prompt logprobs the plan is computed on the device (no host sync);
otherwise from the host copy of ``query_start_loc`` (free on CPU, one copy on GPU in such steps).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass
class OutputRows:
    """The output tokens of one step."""

    rows: torch.Tensor  # [M] long: the token row each output token starts from (its input and position)
    query_start_loc: torch.Tensor  # [R + 1] int32: output tokens per request, cumulative (the queries)
    count: int  # real output tokens: rows[count:] are padding (their attention output is zero)
    max_query_len: int  # most output tokens of one request
    every_row: bool  # rows is arange(num_tokens): the output stream is the batch, in order
    # [M] long: the row of the step's hidden states each output token is written to; ``None``: ``rows``.
    # A request padded with no rows (Model Runner V2) writes to the scratch row ``num_tokens`` past
    # the step's rows: its ``rows`` entry repeats a real request's row, and two writes to one row
    # leave either (a GPU scatter does not order them).
    dest: torch.Tensor | None = None

    def destinations(self) -> torch.Tensor:
        """Where each output token's hidden state goes (``dest``, or ``rows``)."""
        return self.rows if self.dest is None else self.dest

    def row_requests(self, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request, keys)`` of every output row, on the device with no host sync: the request whose
        cache the row reads and how many of its keys it sees (causal, aligned to the request's end;
        0 for padding rows). What a kernel with one query per program needs."""
        n = self.rows.shape[0]
        qsl = self.query_start_loc.long()
        idx = torch.arange(n, device=qsl.device)
        n_req = qsl.shape[0] - 1
        request = torch.searchsorted(qsl[1:], idx, right=True).clamp(max=max(n_req - 1, 0))
        from_end = qsl[request + 1] - 1 - idx  # output tokens of the same request after this one
        keys = seq_lens.long()[request] - from_end
        keys = torch.where(idx < qsl[-1], keys, torch.zeros_like(keys)).clamp(min=0)
        return request.to(torch.int32), keys.to(torch.int32)


def every_row(query_start_loc: torch.Tensor, num_tokens: int, num_actual_tokens: int, max_query_len: int,
              arange: torch.Tensor | None = None) -> OutputRows:
    """An output token at every row of the step (padding rows included). ``arange`` is a persistent
    ``arange`` buffer to slice the rows from: a captured graph reads its inputs at fixed addresses."""
    if arange is not None and arange.shape[0] >= num_tokens:
        rows = arange[:num_tokens]
    else:
        rows = torch.arange(num_tokens, device=query_start_loc.device)
    return OutputRows(rows=rows, query_start_loc=query_start_loc, count=min(num_actual_tokens, num_tokens),
                      max_query_len=max_query_len, every_row=True)


def plan_output_rows(
    query_start_loc: torch.Tensor,
    num_tokens: int,
    num_actual_tokens: int,
    max_query_len: int,
    suffix: int = 1,
    full_requests: Collection[int] = (),
    graph: bool = False,
    arange: torch.Tensor | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
) -> OutputRows:
    """The output tokens of a step (see the module docstring).

    ``query_start_loc`` [R + 1]: the step's row offsets per request; ``num_tokens``: rows of the
    model's input (padding included), ``num_actual_tokens`` of them scheduled; ``suffix``: output
    tokens at the end of every request (``1 + num_speculative_tokens``); ``full_requests``: batch
    indices of requests that get one at every row (prompt logprobs); ``graph``: the step replays
    a CUDA graph captured for ``num_tokens`` rows.
    """
    if suffix < 1:
        raise ValueError(f"suffix must be >= 1 (the last row of every request predicts), got {suffix}")
    if graph or max_query_len <= suffix:
        return every_row(query_start_loc, num_tokens, num_actual_tokens, max_query_len, arange)
    n_req = query_start_loc.shape[0] - 1
    full = [r for r in full_requests if 0 <= r < n_req]
    if suffix == 1 and not full:
        # One output token per request, at its last row. Requests padded with no rows (Model
        # Runner V2 repeats the last offset) read a real row (the attention masks them) and write
        # to the scratch row past the step's rows (on the device: no host sync).
        ends = query_start_loc[1:].long()
        rows = (ends - 1).clamp(min=0)
        padded = ends == query_start_loc[:-1].long()
        dest = torch.where(padded, torch.full_like(rows, num_tokens), rows)
        qsl = torch.arange(n_req + 1, dtype=query_start_loc.dtype, device=query_start_loc.device)
        return OutputRows(rows=rows, query_start_loc=qsl, count=n_req, max_query_len=1, every_row=False, dest=dest)
    host = (query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.cpu()).long()
    q_lens = host[1:] - host[:-1]
    m = q_lens.clamp(max=suffix)
    if full:
        m[full] = q_lens[full]
    ends = host[1:]
    starts = ends - m
    rows = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends)]) if n_req else \
        torch.zeros(0, dtype=torch.long)
    qsl = torch.zeros(n_req + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(m, 0)
    device = query_start_loc.device
    return OutputRows(rows=rows.to(device, non_blocking=True), query_start_loc=qsl.to(device, non_blocking=True),
                      count=int(qsl[-1]), max_query_len=int(m.max()) if n_req else 0, every_row=False)
