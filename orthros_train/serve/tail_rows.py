"""Which base rows of a vLLM step see their whole request: the global tail (torch only, tested without vLLM).

With ``base_global_tail = R > 0`` (``ops/keys.py``) the base query of a request's prompt token at
position ``p`` is global when ``p >= prompt_length - R`` (the prompt's last ``R`` tokens), and so is
every generated token's (its position is at least the prompt length): ``keys.prompt_tail_flags``,
which the package's ``generate`` uses. A request's rows in a step are consecutive positions ending
at its cached length ``seq_len - 1`` (chunked prefill, a prefix read from the cache, a decode step,
verified drafts: always), so its global rows are a *suffix* of its scheduled rows, of length

    g = clamp(seq_len - (prompt_length - R), 0, q)      (q: the request's rows in the step)

which is the same shape as the output stream's rows (``output_rows.py``): queries aligned to the
end of the request's keys, causal, no window. So the attention the output stream already runs
serves the global rows too, with their own ``query_start_loc`` (cumulative ``g``), and the
position of the prompt's end is all a step needs beyond vLLM's metadata. That is why a chunk that
does not end its prompt still gets global rows when ``R`` exceeds the prompt's last chunk: the
count is measured from the prompt's end, not the chunk's.

Two forms, as for the output rows: ``plan_tail_rows`` from host copies (the CPU backend, whose ops
take host-planned queries), and ``tail_row_keys`` on the device from the per-row request and key
count the kernels take (GPU: no host sync, so a captured CUDA graph recomputes it at replay).
"""

from __future__ import annotations

import torch

from orthros_train.serve.output_rows import OutputRows

__all__ = ["plan_tail_rows", "tail_counts", "tail_row_keys"]


def tail_counts(q_lens: torch.Tensor, seq_lens: torch.Tensor, prompt_lengths: torch.Tensor,
                global_tail: int) -> torch.Tensor:
    """Global rows at the end of each request's ``q_lens`` rows (``g`` above), int64."""
    first_global = prompt_lengths.long() - global_tail
    return (seq_lens.long() - first_global).clamp(min=0).minimum(q_lens.long())


def plan_tail_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, prompt_lengths: torch.Tensor,
                   global_tail: int, device: torch.device | str | None = None) -> OutputRows | None:
    """The step's global base rows as a suffix plan (``OutputRows``: ``rows`` into the step's
    tokens, ``query_start_loc`` cumulative per request), from host tensors; ``None`` when no row of
    the step is global (nothing to run). ``prompt_lengths [R]``: each request's prompt length, in
    batch order."""
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    counts = tail_counts(q_lens, seq_lens[: q_lens.shape[0]], prompt_lengths[: q_lens.shape[0]], global_tail)
    total = int(counts.sum())
    if total == 0:
        return None
    ends = qsl[1:]
    rows = torch.cat([torch.arange(int(e) - int(g), int(e)) for e, g in zip(ends, counts)])
    cumulative = torch.zeros(counts.shape[0] + 1, dtype=torch.int32)
    cumulative[1:] = torch.cumsum(counts, 0)
    device = device if device is not None else query_start_loc.device
    return OutputRows(rows=rows.to(device), query_start_loc=cumulative.to(device), count=total,
                      max_query_len=int(counts.max()), every_row=False)


def tail_row_keys(row_request: torch.Tensor, row_keys: torch.Tensor, prompt_lengths: torch.Tensor,
                  global_tail: int) -> torch.Tensor:
    """Per base row, on the device: its key count (its own key included) where the row is global,
    else 0 (the paged kernel reads no key for it and leaves it zero). ``row_request``/``row_keys``:
    ``OutputRows.row_requests`` of every row of the step; ``prompt_lengths``: per batch index."""
    position = row_keys.long() - 1  # a row's own key is its position
    first_global = prompt_lengths.long()[row_request.long()] - global_tail
    return torch.where((position >= first_global) & (row_keys > 0), row_keys, torch.zeros_like(row_keys))
