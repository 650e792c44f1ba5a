"""Which keys a query sees: the one definition every executor takes its key ranges from.

A query is described by the token it belongs to (``q_index``, an index into the key dimension),
the number of keys its window holds counting its own (``q_window``), and the document boundaries
``cu_seqlens``. Three things decide its keys, all in this module:

* **the window**: key ``j`` of the same document with ``q_index - q_window < j <= q_index``. Base
  queries get ``W`` (``sliding_window``); output queries get ``UNBOUNDED`` (their whole document up
  to their position);
* **sink tokens** ``S`` (``KeyRule.sink_tokens``): a windowed query also sees the first ``S`` keys
  of its document that lie before it (each key once where they overlap its window). A query whose
  window already reaches its document start gains nothing;
* **the global tail** ``R`` (``KeyRule.global_tail``): the base queries of a prompt's last ``R``
  tokens, and of every generated token, see their whole document (``UNBOUNDED``), as output
  queries do. The tail is a choice of window per query, so executors that take per-query windows
  need nothing else; which base queries are global is decided here: ``prompt_tail_flags`` (a
  prompt being read, a generated token; carried by the layout as ``OrthrosLayout.base_global``)
  and ``answer_tail_flags`` (a training layout whose outputs are answers, ``OrthrosLayout.answers``).

With ``S = 0`` and ``R = 0`` a base query sees exactly the paper's window. Keys a query sees are
one contiguous *window range* ``[key_start, q_index]`` plus, with sinks, a *sink range*
``[doc_start, min(doc_start + S, key_start))`` that is empty when the window already reaches them.
``allowed_keys`` builds the dense ``[Nq, Nk]`` mask straight from the definition: the ground truth
the tests hold every executor to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orthros_train.errors import UserError

# Larger than any sequence we will ever pack; int32-safe so kernels can take it as is.
UNBOUNDED = 2**31 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sink_tokens(sink_tokens: object) -> None:
    if not _is_int(sink_tokens) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")


@dataclass(frozen=True)
class KeyRule:
    """The base stream's key rule of one model: window ``W``, sinks ``S``, global tail ``R``.

    ``window = UNBOUNDED`` is the dense baseline (every query sees its document; sinks and tail
    are then meaningless and must be 0). Validation lives here and nowhere else: the model config,
    the converter, the exported config and the serving config all build one ``KeyRule``.
    """

    window: int
    sink_tokens: int = 0
    global_tail: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.window) or self.window < 1:
            raise UserError(f"sliding_window must be an integer >= 1, got {self.window!r}")
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise UserError(
                f"sink_tokens must be an integer >= 0 (0: the paper's layer, 4: a converted model's usual "
                f"choice), got {self.sink_tokens!r}"
            )
        if not _is_int(self.global_tail) or self.global_tail < 0:
            raise UserError(
                f"base_global_tail must be an integer >= 0 (0: the paper's layer; 32 restores a converted "
                f"model's retrieval beyond the window), got {self.global_tail!r}"
            )
        if self.window >= UNBOUNDED:
            return
        if self.sink_tokens and self.sink_tokens >= self.window:
            raise UserError(
                f"sink_tokens ({self.sink_tokens}) must be smaller than sliding_window ({self.window}): the sinks "
                "are the first tokens of a document a base query sees beyond its window; lower sink_tokens"
            )

    @property
    def windowed(self) -> bool:
        """Whether base queries have a window at all (not the dense baseline)."""
        return self.window < UNBOUNDED

    def base_windows(self, base_global: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """Per base query window: ``W``, or ``UNBOUNDED`` where ``base_global`` marks a global query.

        ``like``: a tensor whose shape and device the result takes (the base queries' key index).
        ``base_global`` None (no tail in this pass) gives ``W`` everywhere, bitwise the paper's layer.
        """
        windows = torch.full_like(like, self.window)
        if base_global is None or not self.windowed:
            return windows
        return windows.masked_fill(base_global.to(device=like.device, dtype=torch.bool), UNBOUNDED)

    @property
    def decode_window(self) -> int:
        """The window of a decode step's base query: the whole row with a global tail (a generated
        token is global), else ``W``."""
        return UNBOUNDED if self.global_tail else self.window

    def sink_tokens_of_pass(self) -> int:
        """Sinks the executors apply (0 for the dense baseline, whose window already holds them)."""
        return self.sink_tokens if self.windowed else 0


def prompt_tail_flags(
    num_tokens: int, start: int, prompt_length: int, global_tail: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Which of ``num_tokens`` base tokens at positions ``start, start+1, ...`` of one row are global.

    A row's prompt has ``prompt_length`` tokens; the tail is its last ``global_tail`` positions and
    every position after the prompt (generated tokens). A chunked prefill passes the chunk's start
    and the whole prompt's length, so the same tokens are global whether the prompt is read in one
    forward or many. ``None`` when ``global_tail`` is 0 (the paper's layer: no token is global).
    """
    if not global_tail:
        return None
    first_global = prompt_length - global_tail
    positions = torch.arange(start, start + num_tokens, device=device)
    return positions >= first_global


def answer_tail_flags(output_index: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int,
                      global_tail: int) -> torch.Tensor | None:
    """Global base tokens of a training layout whose output tokens are answer spans (SFT, RL).

    A run of consecutive output positions ``[a, b]`` is one answer: its outputs predict tokens
    ``a+1 .. b+1``. Generating it, a model reads the prompt up to ``a`` (its last ``global_tail``
    tokens are the tail) and feeds back the generated tokens ``a+1 .. b`` (the last one, ``b+1``,
    is sampled, never fed). So the global tokens are ``[a + 1 - global_tail, b]``, cut at the
    document start, and a layout trained with them sees the keys ``generate`` gives the same tokens,
    turn after turn with the cache kept (train == prefill == decode). Computed on the layout's
    device without a host sync. ``None`` when ``global_tail`` is 0.
    """
    if not global_tail:
        return None
    device = output_index.device
    index = torch.arange(num_tokens, device=device)
    never = num_tokens + global_tail  # farther than any tail reaches
    out_at = torch.full((num_tokens,), never, dtype=torch.long, device=device)
    out_at[output_index.long()] = output_index.long()
    # the nearest output position at or after each token: a reversed running minimum
    nearest = torch.flip(torch.cummin(torch.flip(out_at, (0,)), 0).values, (0,))
    cu = cu_seqlens.long().to(device)
    doc_end = cu[torch.searchsorted(cu, index, right=True)]  # exclusive end of each token's document
    return (nearest < doc_end) & (nearest - index < global_tail)


def document_starts(q_index: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Key index of the first key of every query's document (int64)."""
    cu = cu_seqlens.long()
    return cu[torch.searchsorted(cu, q_index.long(), right=True) - 1]


def key_ranges(
    q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive window range ``[start, end]`` of every query (int64)."""
    q_index = q_index.long()
    start = torch.maximum(document_starts(q_index, cu_seqlens), q_index - q_window.long() + 1)
    return start, q_index


def sink_queries(
    q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor, sink_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sink partial's queries: ``(rows, index, window)``.

    ``rows`` are the queries whose sink range ``[doc_start, min(doc_start + S, key_start))`` is not
    empty; each is re-expressed in the op's own contract as a query at key index ``index`` (the
    last sink key it lacks) with window ``window`` (the sink keys it lacks), so any backend can
    run the partial. One host sync (the number of rows); callers of a hot path compute it once
    per forward (``prepare_attention``).
    """
    check_sink_tokens(sink_tokens)
    doc_start = document_starts(q_index, cu_seqlens)
    start, _ = key_ranges(q_index, q_window, cu_seqlens)
    sink_end = torch.minimum(doc_start + sink_tokens, start)  # exclusive
    rows = torch.nonzero(sink_end > doc_start).flatten()
    return rows, sink_end[rows] - 1, sink_end[rows] - doc_start[rows]


def visible_keys(
    q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor, sink_tokens: int = 0
) -> torch.Tensor:
    """How many keys each query sees (int64): its window range plus the sink keys before it. What
    the FLOP and memory models count; ``allowed_keys(...).sum(1)`` without the dense mask."""
    start, end = key_ranges(q_index, q_window, cu_seqlens)
    count = end - start + 1
    if sink_tokens:
        count = count + (start - document_starts(q_index, cu_seqlens)).clamp(max=sink_tokens)
    return count


def missed_sinks(position: torch.Tensor, window: int, sink_tokens: int) -> torch.Tensor:
    """Sink keys a query at ``position`` of a document starting at key 0 lacks: its window holds
    keys ``(position - window, position]``, so the first ``clamp(position - window + 1, 0, S)``
    sinks lie outside it. The per-row form of ``sink_queries`` (decode over cache rows)."""
    if window >= UNBOUNDED:
        return torch.zeros_like(position.long())
    return (position.long() - window + 1).clamp(0, sink_tokens)


def allowed_keys(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Dense ``[Nq, Nk]`` bool mask of the keys every query sees, written from the definition
    (same document, causal, inside the window or among the document's first ``sink_tokens``
    keys) rather than from ranges or partial merges: the ground truth of every executor's tests.
    O(Nq * Nk) memory."""
    check_sink_tokens(sink_tokens)
    cu = cu_seqlens.long().cpu()
    doc_of_key = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    device = q_index.device
    doc_of_key = doc_of_key.to(device)
    j = torch.arange(n_k, device=device)
    qi = q_index.long()[:, None]
    key_doc_start = cu.to(device)[doc_of_key]
    in_window = qi - j[None, :] < q_window.long()[:, None]
    is_sink = (j - key_doc_start)[None, :] < sink_tokens
    return (doc_of_key[None, :] == doc_of_key[qi]) & (j[None, :] <= qi) & (in_window | is_sink)


__all__ = [
    "UNBOUNDED", "KeyRule", "allowed_keys", "check_sink_tokens", "document_starts", "key_ranges",
    "missed_sinks", "prompt_tail_flags", "visible_keys", "sink_queries", "answer_tail_flags",
]
