"""Phase layouts: which positions get an output token (``docs/architecture.md``).

| phase    | output tokens                                         | loss weight        |
| pretrain | every position                                        | 1                  |
| sft      | positions whose next token lies in an answer span     | 1                  |
| rl       | positions whose next token lies in a response span    | per-token weight   |
| prefill  | the last position of each row                         | no loss            |
| decode   | the new token of each row (one base+output pair)      | no loss            |

Output token ``p`` predicts token ``p + 1``. Rows may have different lengths; each row is split
into documents (by explicit document ids or by an end-of-document token) and positions restart
at 0 in every document, so a packed document behaves exactly as if it ran alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orthros_train.ops.keys import prompt_tail_flags
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout, concat_layouts

Rows = torch.Tensor | Sequence[torch.Tensor]
Span = tuple[int, int]


def _as_rows(input_ids: Rows) -> list[torch.Tensor]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            return [input_ids]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [T] or [B, T], got shape {tuple(input_ids.shape)}")
        return list(input_ids.unbind(0))
    rows = [torch.as_tensor(r) for r in input_ids]
    if not rows:
        raise ValueError("empty layout: no rows given")
    return rows


def _row_documents(ids: torch.Tensor, document_ids: torch.Tensor | None, eod_token_id: int | None) -> torch.Tensor:
    """Per-token document index inside one row (0, 0, 1, 1, 1, ...)."""
    t = ids.numel()
    if t == 0:
        raise ValueError("empty layout: a row has no tokens")
    if document_ids is not None:
        document_ids = torch.as_tensor(document_ids)
        if document_ids.shape != ids.shape:
            raise ValueError(f"document_ids shape {tuple(document_ids.shape)} != input_ids shape {tuple(ids.shape)}")
        change = torch.zeros(t, dtype=torch.long, device=ids.device)
        change[1:] = (document_ids[1:] != document_ids[:-1]).long()
        return torch.cumsum(change, 0)
    if eod_token_id is not None:
        # A document ends with its EOD token; the next one starts right after it.
        starts = torch.zeros(t, dtype=torch.long, device=ids.device)
        starts[1:] = (ids[:-1] == eod_token_id).long()
        return torch.cumsum(starts, 0)
    return torch.zeros(t, dtype=torch.long, device=ids.device)


def _positions_and_cu(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = doc.numel()
    boundaries = torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1
    cu = torch.cat([doc.new_zeros(1), boundaries, doc.new_full((1,), t)])
    # Start of each token's document: a running max over document starts. (repeat_interleave
    # does the same but stalls for milliseconds per call when torch runs several threads.)
    marks = torch.zeros(t, dtype=torch.long, device=doc.device)
    marks[cu[:-1]] = cu[:-1]
    starts = torch.cummax(marks, 0).values
    return torch.arange(t, device=doc.device) - starts, cu.to(torch.int32)


def _row_layout(
    ids: torch.Tensor,
    doc: torch.Tensor,
    output_index: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
) -> OrthrosLayout:
    positions, cu = _positions_and_cu(doc)
    return OrthrosLayout(
        input_ids=ids.long(),
        positions=positions,
        cu_seqlens=cu,
        output_index=output_index.long(),
        labels=labels.long(),
        loss_weights=weights.float(),
        row_of_output=torch.zeros(output_index.numel(), dtype=torch.long, device=ids.device),
        num_rows=1,
    )


def _next_token_labels(ids: torch.Tensor, doc: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Label of output token p is token p+1 of the same document, else IGNORE_INDEX."""
    t = ids.numel()
    nxt = (index + 1).clamp(max=t - 1)
    ok = (index + 1 < t) & (doc[nxt] == doc[index])
    return torch.where(ok, ids[nxt], torch.full_like(ids[nxt], IGNORE_INDEX))


def pretrain_layout(
    input_ids: Rows,
    labels: Rows | None = None,
    document_ids: Rows | None = None,
    eod_token_id: int | None = None,
) -> OrthrosLayout:
    """Output token at every position; loss on every next token of the same document.

    ``labels`` (same shape as ``input_ids``) gives the target of each position explicitly (the
    usual ``tokens[1:]`` of a ``T+1`` sample); targets that cross into another document and
    targets of EOD positions are masked (Megatron's ``eod_mask_loss``).
    """
    rows = _as_rows(input_ids)
    label_rows = _as_rows(labels) if labels is not None else [None] * len(rows)
    doc_rows = _as_rows(document_ids) if document_ids is not None else [None] * len(rows)
    if len(label_rows) != len(rows) or len(doc_rows) != len(rows):
        raise ValueError("labels/document_ids must have as many rows as input_ids")
    out = []
    for ids, lab, docs in zip(rows, label_rows, doc_rows):
        doc = _row_documents(ids, docs, eod_token_id)
        index = torch.arange(ids.numel(), device=ids.device)
        if lab is None:
            target = _next_token_labels(ids, doc, index)
        else:
            if lab.shape != ids.shape:
                raise ValueError(f"labels shape {tuple(lab.shape)} != input_ids shape {tuple(ids.shape)}")
            target = lab.clone().long()
            crosses = torch.zeros_like(target, dtype=torch.bool)
            crosses[:-1] = doc[1:] != doc[:-1]
            target[crosses] = IGNORE_INDEX
        if eod_token_id is not None:
            target[ids == eod_token_id] = IGNORE_INDEX
        weights = torch.ones(ids.numel(), device=ids.device)
        out.append(_row_layout(ids, doc, index, target, weights))
    return concat_layouts(out)


def _span_targets(t: int, spans: Sequence[Span], what: str) -> torch.Tensor:
    """Sorted target-token indices covered by ``[start, end)`` spans of a row of length t."""
    targets = []
    for span in spans:
        start, end = int(span[0]), int(span[1])
        if not (0 <= start < end <= t):
            raise ValueError(f"{what} span {(start, end)} lies outside the sequence of length {t}")
        if start == 0:
            raise ValueError(f"{what} span {(start, end)} starts at token 0, which nothing predicts")
        targets.append(torch.arange(start, end))
    if not targets:
        return torch.zeros(0, dtype=torch.long)
    merged = torch.unique(torch.cat(targets))  # sorted; overlapping spans counted once
    return merged


def sft_layout(
    input_ids: Rows,
    answer_spans: Sequence[Sequence[Span]],
    document_ids: Rows | None = None,
    eod_token_id: int | None = None,
) -> OrthrosLayout:
    """Output tokens only where the next token lies in an answer span ``[start, end)``. A model
    with a global tail gives each span's last prompt tokens and its generated tokens global base
    queries (``OrthrosLayout.answers``, ``keys.answer_tail_flags``), as ``generate`` gives them."""
    return rl_layout(input_ids, answer_spans, None, document_ids, eod_token_id, what="answer")


def rl_layout(
    input_ids: Rows,
    response_spans: Sequence[Sequence[Span]],
    token_weights: Rows | None = None,
    document_ids: Rows | None = None,
    eod_token_id: int | None = None,
    what: str = "response",
) -> OrthrosLayout:
    """Output tokens where the next token lies in a response span, weighted per target token.

    ``token_weights[b][j]`` is the weight (e.g. advantage) of predicting token ``j`` of row b.
    The outputs are answers a generation produces (``OrthrosLayout.answers``): see ``sft_layout``.
    """
    rows = _as_rows(input_ids)
    if len(response_spans) != len(rows):
        raise ValueError(f"{len(response_spans)} span lists given for {len(rows)} rows")
    weight_rows = _as_rows(token_weights) if token_weights is not None else [None] * len(rows)
    doc_rows = _as_rows(document_ids) if document_ids is not None else [None] * len(rows)
    out = []
    for ids, spans, w, docs in zip(rows, response_spans, weight_rows, doc_rows):
        doc = _row_documents(ids, docs, eod_token_id)
        targets = _span_targets(ids.numel(), spans, what).to(ids.device)
        index = targets - 1
        if bool((doc[index] != doc[targets]).any()):
            raise ValueError(f"an {what} span starts at a document boundary; its first token has no context")
        labels = ids[targets]
        if w is None:
            weights = torch.ones(targets.numel(), device=ids.device)
        else:
            w = torch.as_tensor(w, dtype=torch.float32, device=ids.device)
            if w.shape != ids.shape:
                raise ValueError(f"token_weights shape {tuple(w.shape)} != row shape {tuple(ids.shape)}")
            weights = w[targets]
        lay = _row_layout(ids, doc, index, labels, weights)
        lay.answers = True
        out.append(lay)
    if sum(lay.num_outputs for lay in out) == 0:
        raise ValueError(f"empty layout: no {what} tokens in any row")
    return concat_layouts(out)


def prefill_layout(
    input_ids: Rows,
    start_positions: Sequence[int] | torch.Tensor | None = None,
    global_tail: int = 0,
    prompt_lengths: Sequence[int] | None = None,
) -> OrthrosLayout:
    """One output token at the last position of each row (the token that predicts the answer).

    ``start_positions[b]`` is the RoPE position of row b's first token: 0 for a fresh prompt,
    the cached length when the row continues a KV cache (chunked prefill, decode).
    ``global_tail`` (the model's ``base_global_tail``): the base queries of the last
    ``global_tail`` tokens of each row's prompt are global (``keys.prompt_tail_flags``); the prompt
    ends where this row ends unless ``prompt_lengths[b]`` (the position the prompt ends at: a
    chunked prefill's later chunks) says otherwise.
    """
    rows = _as_rows(input_ids)
    starts = [0] * len(rows) if start_positions is None else [int(s) for s in start_positions]
    if len(starts) != len(rows):
        raise ValueError(f"{len(starts)} start positions given for {len(rows)} rows")
    ends = [s + r.numel() for s, r in zip(starts, rows)] if prompt_lengths is None else [int(n) for n in prompt_lengths]
    if len(ends) != len(rows):
        raise ValueError(f"{len(ends)} prompt lengths given for {len(rows)} rows")
    out = []
    for ids, start, end in zip(rows, starts, ends):
        doc = _row_documents(ids, None, None)
        last = torch.tensor([ids.numel() - 1], device=ids.device)
        lay = _row_layout(ids, doc, last, torch.full((1,), IGNORE_INDEX, device=ids.device), torch.zeros(1))
        lay.positions = lay.positions + start
        lay.base_global = prompt_tail_flags(ids.numel(), start, end, global_tail, device=ids.device)
        out.append(lay)  # the packed layout validates (and counts) the flags
    return concat_layouts(out)


def decode_layout(
    next_ids: torch.Tensor, cache_lengths: Sequence[int] | torch.Tensor, global_tail: int = 0
) -> OrthrosLayout:
    """One base+output pair per row: the new token at position ``cache_lengths[b]``. With a global
    tail (``global_tail > 0``) every generated token's base query is global."""
    return prefill_layout(torch.as_tensor(next_ids).reshape(-1, 1), cache_lengths, global_tail)


def positions_layout(
    input_ids: torch.Tensor,
    output_positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> OrthrosLayout:
    """Layout for ``OrthrosForCausalLM.forward``: output tokens at explicit positions.

    ``output_positions`` is ``[N]`` (same for every row) or ``[B, N]``; ``labels`` is ``[B, N]``,
    the target of each output token (IGNORE_INDEX for none).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    b, t = input_ids.shape
    if output_positions is None:
        output_positions = torch.arange(t, device=input_ids.device)
    output_positions = torch.as_tensor(output_positions, device=input_ids.device).long()
    if output_positions.dim() == 1:
        output_positions = output_positions[None].expand(b, -1)
    if output_positions.shape[0] != b:
        raise ValueError(f"output_positions has {output_positions.shape[0]} rows, input_ids has {b}")
    n = output_positions.shape[1]
    if labels is None:
        labels = torch.full((b, n), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    elif tuple(labels.shape) != (b, n):
        raise ValueError(f"labels must be [batch, n_output] = {(b, n)}, got {tuple(labels.shape)}")
    doc_rows = _as_rows(document_ids) if document_ids is not None else [None] * b
    out = []
    for ids, pos, lab, docs in zip(input_ids.unbind(0), output_positions.unbind(0), labels.unbind(0), doc_rows):
        doc = _row_documents(ids, docs, None)
        if n and (int(pos.min()) < 0 or int(pos.max()) >= t):
            raise ValueError(f"output_positions must lie in [0, {t})")
        out.append(_row_layout(ids, doc, pos, lab, torch.ones(n, device=ids.device)))
    return concat_layouts(out)
