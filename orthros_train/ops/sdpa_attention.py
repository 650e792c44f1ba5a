"""The Orthros attention op on ``torch.nn.functional.scaled_dot_product_attention``.

Same contract as ``ops/reference.py`` (packed queries of both streams, each with a key index and a
window, document boundaries ``cu_seqlens``), run through torch's fused SDPA kernels: flash
attention on CPU and GPU where no mask is needed, the fused masked kernels elsewhere. SDPA is the
dense attention a user would pick anyway, so the dense and sliding-window baselines trained and
benchmarked by this repository run at full speed, and the Orthros streams get the same kernels.

The packed queries are cut into *segments*: maximal runs of consecutive queries whose key indices
are consecutive, with one window, inside one document (a document's base stream, its output
stream in pretraining, an answer span, the one query of a prefill or decode step). Each segment
is one SDPA call:

* a segment whose window reaches back to its document start (``dense``, the output stream) is
  causal attention over ``[doc_start, last]``: ``is_causal`` when it starts at the document start
  (flash attention), no mask for a single query, else an explicit lower-right causal mask;
* a windowed segment (the base stream, ``sliding``) is cut into query blocks of ``BLOCK`` rows; a
  block attends the ``BLOCK + W - 1`` keys ending at its last query through a fixed band mask, all
  blocks in one batched call. Work is ``T * (BLOCK + W - 1)`` scores instead of dense's ``T^2/2``.

SDPA does not return a differentiable log-sum-exp, which callers that merge partial attentions
(context parallelism) need; with ``need_lse=True`` (the default of the op contract) this backend
therefore hands the call to the reference op. ``orthros_attention`` asks for the output only.

Finding the segments reads the index tensors on the host: one device sync per call on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orthros_train.ops.reference import UNBOUNDED, attention_reference, check_attention_inputs

# Query rows per block of a windowed segment. Measured on CPU (1 thread, W=128, 8 heads of 64):
# 32-64 rows beat 128 and 256; fewer rows mean fewer wasted band scores, more rows bigger GEMMs.
BLOCK = 64


@dataclass(frozen=True)
class Segment:
    """Queries ``[q0, q1)`` with key indices ``first .. first + q1 - q0 - 1`` in one document."""

    q0: int
    q1: int
    first: int  # key index of query q0
    doc_start: int
    window: int

    @property
    def length(self) -> int:
        return self.q1 - self.q0

    @property
    def last(self) -> int:
        return self.first + self.length - 1

    @property
    def sees_document_start(self) -> bool:
        """Every query of the segment sees back to the document start (no window cut)."""
        return self.window >= self.last - self.doc_start + 1


def query_segments(q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor) -> list[Segment]:
    """Cut the packed queries into runs that each take one SDPA call (host-side)."""
    qi = q_index.detach().long().cpu()
    w = q_window.detach().long().cpu()
    cu = cu_seqlens.detach().long().cpu()
    n = qi.numel()
    if n == 0:
        return []
    doc = torch.searchsorted(cu, qi, right=True) - 1
    cut = (qi[1:] != qi[:-1] + 1) | (w[1:] != w[:-1]) | (doc[1:] != doc[:-1])
    starts = [0, *(torch.nonzero(cut).flatten() + 1).tolist()]
    ends = [*starts[1:], n]
    firsts, windows, doc_starts = qi[starts].tolist(), w[starts].tolist(), cu[doc[starts]].tolist()
    return [Segment(s, e, f, ds, win) for s, e, f, ds, win in zip(starts, ends, firsts, doc_starts, windows)]


def _needs_mask(seg: Segment) -> bool:
    return seg.length > 1 and not (seg.first == seg.doc_start and (seg.window >= UNBOUNDED or seg.sees_document_start))


def flash_covers(q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """True when every segment runs without a mask (causal from its document start, or a single
    query): the layouts flash attention serves on a GPU."""
    return not any(_needs_mask(seg) for seg in query_segments(q_index, q_window, cu_seqlens))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` -> ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _sdpa(q, k, v, scale, **kwargs) -> torch.Tensor:
    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kwargs)


def _causal_segment(q, k, v, seg: Segment, scale: float) -> torch.Tensor:
    """Queries that see their whole document up to themselves: keys ``[doc_start, last]``."""
    lo, hi = seg.doc_start, seg.last
    qs, ks, vs = _heads_first(q[seg.q0 : seg.q1]), _heads_first(k[lo : hi + 1]), _heads_first(v[lo : hi + 1])
    if seg.length == 1:
        o = _sdpa(qs, ks, vs, scale)
    elif seg.first == lo:
        o = _sdpa(qs, ks, vs, scale, is_causal=True)
    else:  # lower-right causal: query i sees keys up to first + i
        offset = seg.first - lo
        key = torch.arange(hi - lo + 1, device=q.device)[None]
        mask = key <= torch.arange(seg.length, device=q.device)[:, None] + offset
        o = _sdpa(qs, ks, vs, scale, attn_mask=mask)
    return o[0].transpose(0, 1)


def _windowed_segment(q, k, v, seg: Segment, scale: float, block: int) -> torch.Tensor:
    """Sliding-window queries: blocks of ``block`` queries, each over the keys its band spans."""
    w, n = seg.window, seg.length
    lo = max(seg.doc_start, seg.first - w + 1)
    if n <= block:  # one block: keys [lo, last], band mask unless a single query
        qs = _heads_first(q[seg.q0 : seg.q1])
        ks, vs = _heads_first(k[lo : seg.last + 1]), _heads_first(v[lo : seg.last + 1])
        mask = None
        if n > 1:
            key = torch.arange(lo, seg.last + 1, device=q.device)[None]
            query = torch.arange(seg.first, seg.last + 1, device=q.device)[:, None]
            mask = (key <= query) & (key > query - w)
        return _sdpa(qs, ks, vs, scale, attn_mask=mask)[0].transpose(0, 1)

    n_blocks = -(-n // block)
    span = block + w - 1  # keys of one block: the W-1 before its first query, then its own
    left = lo - (seg.first - w + 1)  # keys the first blocks would reach before the document start
    right = n_blocks * block - n
    h_q, d = q.shape[1], q.shape[2]
    qs = F.pad(q[seg.q0 : seg.q1], (0, 0, 0, 0, 0, right)).view(n_blocks, block, h_q, d).transpose(1, 2)

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [n_blocks, Hkv, span, D], overlapping windows
        padded = F.pad(x[lo : seg.last + 1], (0, 0, 0, 0, left, right))
        return padded.unfold(0, span, block).permute(0, 1, 3, 2)

    ks, vs = blocks(k), blocks(v)
    row = torch.arange(block, device=q.device)[:, None]
    col = torch.arange(span, device=q.device)[None]
    band = (col >= row) & (col < row + w)  # query row r sits at key column r + w - 1
    mask = band.expand(n_blocks, 1, block, span)
    if left:  # keys before the document start: zero padding that no query may see
        start = torch.arange(n_blocks, device=q.device)[:, None] * block + col  # padded key position
        mask = mask & (start >= left)[:, None, None, :]
    # Padded query rows (right) see only real or zero keys of their band: finite, then dropped.
    o = _sdpa(qs, ks, vs, scale, attn_mask=mask)
    return o.transpose(1, 2).reshape(n_blocks * block, h_q, d)[:n]


def attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    need_lse: bool = True,
    block: int = BLOCK,
    **_prepared: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [Nq, Hq, D], lse)``; ``lse`` is None unless ``need_lse`` (then the reference op runs).

    Extra keyword arguments (prepared metadata of other backends) are accepted and ignored.
    """
    if need_lse:
        return attention_reference(q, k, v, q_index, q_window, cu_seqlens, scale=scale)
    check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    outs = []
    for seg in query_segments(q_index, q_window, cu_seqlens):
        if seg.window >= UNBOUNDED or seg.sees_document_start:
            outs.append(_causal_segment(q, k, v, seg, scale))
        else:
            outs.append(_windowed_segment(q, k, v, seg, scale, block))
    if not outs:
        return q.new_zeros(q.shape), None
    return (torch.cat(outs) if len(outs) > 1 else outs[0]), None


def attention_sdpa_output(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """``attention_sdpa`` without the log-sum-exp: the fast path the model calls."""
    kwargs["need_lse"] = False
    return attention_sdpa(*args, **kwargs)
