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

Sink tokens (``sink_tokens = S``, see ``ops/reference.py``) are native here: a windowed query at
``i`` sees ``[doc_start, doc_start + S) U (i - W, i]``, which is the contiguous causal range
``[doc_start, i]`` as long as ``i - W + 1 <= doc_start + S``: those queries join the causal head.
Every later query lacks all ``S`` sinks and its block's band starts after them: on CPU the body's
blocks run the flash kernel as before and a small softmax over the ``S`` sink keys is merged in by
the two log-sum-exps (``_BodyWithSinks``); elsewhere the sink keys are prepended to every block
(a copy of the blocks' keys). The tail's band and single queries get the sinks they lack;
unbounded segments are unchanged. ``S / (BLOCK + W - 1)`` more scores, plus the merge's passes over
the queries and outputs: measured on CPU (1 thread, T = 16K, W = 128, 8 heads of 64 on 4 KV
heads), S = 4 costs about 15-19% more than S = 0 forward and forward+backward (the copy: +80%).

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

from orthros_train.ops.keys import UNBOUNDED, check_sink_tokens
from orthros_train.ops.reference import attention_reference, check_attention_inputs

# Query rows per block of a windowed segment. Measured on CPU (1 thread, W=128, 8 heads of 64,
# T=16K): 32 rows 0.076 s per layer, 64 rows 0.087 s, 128 rows 0.105 s; fewer rows waste fewer
# band scores (a block scores block + W - 1 keys per query), more rows make bigger GEMMs.
BLOCK = 32


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


def prepare_segments(
    q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor, n_k: int, **_hints: object
) -> list[Segment]:
    """Once-per-forward metadata for ``attention_sdpa(prepared=...)``: the query segments.

    The segments do not depend on the hints (``sink_tokens`` among them): sinks are applied per
    call, so one prepared list serves any ``sink_tokens``."""
    return query_segments(q_index, q_window, cu_seqlens)


def needs_mask(seg: Segment) -> bool:
    """The segment's SDPA call needs an explicit mask (flash attention cannot serve it)."""
    return seg.length > 1 and not (seg.first == seg.doc_start and (seg.window >= UNBOUNDED or seg.sees_document_start))


def flash_covers(q_index: torch.Tensor, q_window: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """True when every segment runs without a mask (causal from its document start, or a single
    query): the layouts flash attention serves on a GPU."""
    return not any(needs_mask(seg) for seg in query_segments(q_index, q_window, cu_seqlens))


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


def _band(q, k, v, seg: Segment, scale: float, sinks: int = 0) -> torch.Tensor:
    """A few windowed queries in one call: keys ``[lo, last]`` with a band mask, plus the
    document's first ``sinks`` keys that lie before ``lo`` (each key listed once)."""
    w = seg.window
    lo = max(seg.doc_start, seg.first - w + 1)
    qs = _heads_first(q[seg.q0 : seg.q1])
    ks, vs = k[lo : seg.last + 1], v[lo : seg.last + 1]
    key = torch.arange(lo, seg.last + 1, device=q.device)[None]
    n_sink = min(sinks, lo - seg.doc_start)  # the sink keys outside [lo, last]
    if n_sink > 0:
        ds = seg.doc_start
        ks, vs = torch.cat([k[ds : ds + n_sink], ks]), torch.cat([v[ds : ds + n_sink], vs])
        key = torch.cat([torch.arange(ds, ds + n_sink, device=q.device)[None], key], dim=1)
    mask = None
    if seg.length > 1:  # a single query sees every key listed
        query = torch.arange(seg.first, seg.last + 1, device=q.device)[:, None]
        mask = (key <= query) & (key > query - w)
        if sinks:
            mask |= (key <= query) & (key < seg.doc_start + sinks)
    return _sdpa(qs, _heads_first(ks), _heads_first(vs), scale, attn_mask=mask)[0].transpose(0, 1)


# CPU flash attention with its log-sum-exp (what ``F.scaled_dot_product_attention`` runs on CPU
# for the band blocks); None on a torch without it, where the sinks take the copying path.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
if _FLASH_CPU_BACKWARD is None:
    _FLASH_CPU = None


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one the flash kernel takes (SDPA converts it the same way)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _sink_scores(body: torch.Tensor, sink_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores ``[Hq, S, n]`` (fp32) of the queries ``body [n, Hq, D]`` against the sink keys
    ``[S, Hkv, D]``: one GEMM per query head straight from its strided rows (no copy of the
    queries; the ``[S, n]`` orientation is the fast one for MKL's skinny products)."""
    n, h_q, _ = body.shape
    group = h_q // sink_k.shape[1]
    scores = body.new_empty((h_q, sink_k.shape[0], n), dtype=torch.float32)
    for h in range(h_q):
        torch.mm(sink_k[:, h // group].float(), body[:, h].float().t(), out=scores[h])
    return scores.mul_(scale)


class _BodyWithSinks(torch.autograd.Function):
    """The body blocks of a windowed segment plus the document's sink keys, on CPU.

    The band runs through the CPU flash kernel as plain SDPA would (strided views of ``k``/``v``,
    no copy), which also returns its log-sum-exp; the ``S`` sinks are a small explicit softmax
    per query head, merged with the band through the two log-sum-exps in place. The backward is
    the flash kernel's own, given the *merged* output and log-sum-exp (its probabilities and its
    ``rowsum(dO * O)`` are then the merged softmax's: exact, as in ring attention), plus the
    sinks' explicit gradients. Prepending the sinks to every block instead copies every block's
    keys (measured at W = 128, 8 heads of 64: +80% time, against +2.5% more scores).
    """

    @staticmethod
    def forward(ctx, body, ks, vs, sink_k, sink_v, band, scale):
        n, h_q, d = body.shape
        n_blocks = ks.shape[0]
        block = n // n_blocks
        group = h_q // sink_k.shape[1]
        qs = body.view(n_blocks, block, h_q, d).transpose(1, 2)
        out, lse = _FLASH_CPU(qs, ks, vs, 0.0, False, attn_mask=band, scale=scale)
        out = out.transpose(1, 2).reshape(n, h_q, d)  # token-major (a view of the kernel's layout)
        lse = lse.transpose(1, 2).reshape(n, h_q).float()
        scores = _sink_scores(body, sink_k, scale)  # [Hq, S, n]
        lse_m = torch.logaddexp(lse, torch.logsumexp(scores, dim=1).t())  # [n, Hq]
        p_sink = scores.sub_(lse_m.t()[:, None]).exp_()  # the sinks' probabilities in the merged softmax
        out.mul_(torch.exp(lse - lse_m)[..., None].to(out.dtype))
        for h in range(h_q):
            out[:, h].addmm_(p_sink[h].t().to(out.dtype), sink_v[:, h // group].to(out.dtype))
        # p_sink is small (S / D of the queries' size): kept, not recomputed
        ctx.save_for_backward(body, ks, vs, sink_k, sink_v, band, out, lse_m.contiguous(), p_sink)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        body, ks, vs, sink_k, sink_v, band, out, lse_m, p_sink = ctx.saved_tensors
        scale = ctx.scale
        n, h_q, d = body.shape
        n_blocks = ks.shape[0]
        block = n // n_blocks
        group = h_q // sink_k.shape[1]
        dout = dout.contiguous()

        def blocked(x):  # [n, Hq, ...] token-major -> the kernel's [n_blocks, Hq, block, ...]
            return x.view(n_blocks, block, h_q, *x.shape[2:]).transpose(1, 2)

        dq, dk, dv = _FLASH_CPU_BACKWARD(
            blocked(dout), blocked(body), ks, vs, blocked(out), blocked(lse_m), 0.0, False,
            attn_mask=band, scale=scale,
        )
        dq = dq.transpose(1, 2).reshape(n, h_q, d)
        delta = (dout.float() * out.float()).sum(-1).t()  # [Hq, n]: rowsum(dO * O) of the merged softmax
        d_sink_k = torch.zeros(sink_k.shape, dtype=torch.float32, device=sink_k.device)
        d_sink_v = torch.zeros(sink_v.shape, dtype=torch.float32, device=sink_v.device)
        for h in range(h_q):
            kv = h // group
            do_h, q_h = dout[:, h].float(), body[:, h].float()
            ds = (sink_v[:, kv].float() @ do_h.t()).sub_(delta[h]).mul_(p_sink[h])  # [S, n]
            dq[:, h].addmm_(ds.t().to(dq.dtype), sink_k[:, kv].to(dq.dtype), alpha=scale)
            d_sink_k[:, kv].addmm_(ds, q_h, alpha=scale)
            d_sink_v[:, kv].addmm_(p_sink[h], do_h)
        return dq, dk, dv, d_sink_k.to(sink_k.dtype), d_sink_v.to(sink_v.dtype), None, None


def _windowed_segment(q, k, v, seg: Segment, scale: float, block: int, sinks: int = 0) -> list[torch.Tensor]:
    """Sliding-window queries in three parts, each one SDPA call.

    head: queries whose window (with the ``sinks`` first keys) still reaches the document start
    (causal from there); body: whole blocks of ``block`` queries, each over the ``block + W - 1``
    keys its band spans, taken as overlapping strided views of ``k``/``v`` (no copy) with one
    shared band mask, after the ``sinks`` sink keys (open to every query: the body's windows
    start after them); tail: the remaining queries, with a band mask. Returns the parts' outputs
    in query order (the body's as ``[n_blocks, block, Hq, D]``).
    """
    w = seg.window
    # first query whose window, sinks included, does not reach back to the document start
    body_first = max(seg.first, seg.doc_start + w - 1 + sinks)
    n_blocks = max(0, seg.last - body_first + 1) // block
    if n_blocks < 2:
        return [_band(q, k, v, seg, scale, sinks)]
    parts = []
    q_body = seg.q0 + body_first - seg.first
    if body_first > seg.first:
        head = Segment(seg.q0, q_body, seg.first, seg.doc_start, UNBOUNDED)
        parts.append(_causal_segment(q, k, v, head, scale))
    span = block + w - 1  # keys of one block: the W-1 before its first query, then its own
    h_q, d = q.shape[1], q.shape[2]
    qs = q[q_body : q_body + n_blocks * block].view(n_blocks, block, h_q, d).transpose(1, 2)
    k_lo, k_hi = body_first - w + 1, body_first + n_blocks * block
    ks = k[k_lo:k_hi].unfold(0, span, block).transpose(2, 3)  # [n_blocks, Hkv, span, D]
    vs = v[k_lo:k_hi].unfold(0, span, block).transpose(2, 3)
    row = torch.arange(block, device=q.device)[:, None]
    col = torch.arange(span, device=q.device)[None]
    band = (col >= row) & (col < row + w)  # query row r sits at key column r + w - 1
    if sinks:
        ds = seg.doc_start
        sink_k, sink_v = k[ds : ds + sinks], v[ds : ds + sinks]
        if _FLASH_CPU is not None and q.device.type == "cpu" and not torch.compiler.is_compiling():
            body = q[q_body : q_body + n_blocks * block]
            out = _BodyWithSinks.apply(body, ks, vs, sink_k, sink_v, _float_mask(band, q.dtype), scale)
            parts.append(out.view(n_blocks, block, h_q, d))
        else:  # the sinks prepended to every block: a copy of the blocks' keys, but plain SDPA
            sink_k = sink_k.transpose(0, 1)[None].expand(n_blocks, -1, -1, -1)
            sink_v = sink_v.transpose(0, 1)[None].expand(n_blocks, -1, -1, -1)
            ks, vs = torch.cat([sink_k, ks], dim=2), torch.cat([sink_v, vs], dim=2)
            band = torch.cat([band.new_ones(block, sinks), band], dim=1)
            parts.append(_sdpa(qs, ks, vs, scale, attn_mask=band).transpose(1, 2))
    else:
        parts.append(_sdpa(qs, ks, vs, scale, attn_mask=band).transpose(1, 2))  # [n_blocks, block, Hq, D]
    q_tail = q_body + n_blocks * block
    if q_tail < seg.q1:
        tail = Segment(q_tail, seg.q1, seg.first + q_tail - seg.q0, seg.doc_start, w)
        parts.append(_band(q, k, v, tail, scale, sinks))
    return parts


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
    prepared: list[Segment] | None = None,
    sink_tokens: int = 0,
    **_other: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [Nq, Hq, D], lse)``; ``lse`` is None unless ``need_lse`` (then the reference op runs).

    ``prepared``: this forward's ``prepare_segments`` (skips finding the segments and the input
    checks in every layer). ``sink_tokens``: the windowed queries' sinks (``ops/reference.py``).
    Other keyword arguments are accepted and ignored.
    """
    if need_lse:
        return attention_reference(q, k, v, q_index, q_window, cu_seqlens, scale=scale, sink_tokens=sink_tokens)
    if sink_tokens:
        check_sink_tokens(sink_tokens)
    if prepared is None:
        check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens)
        prepared = query_segments(q_index, q_window, cu_seqlens)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    parts: list[torch.Tensor] = []  # outputs in query order, [n, Hq, D] or [blocks, block, Hq, D]
    for seg in prepared:
        # a windowed query whose window reaches the end of the document's sinks sees its whole
        # document so far: the segment is causal when its last query does (S = 0: the plain test)
        if seg.window >= UNBOUNDED or seg.window + sink_tokens >= seg.last - seg.doc_start + 1:
            parts.append(_causal_segment(q, k, v, seg, scale))
        else:
            parts.extend(_windowed_segment(q, k, v, seg, scale, block, sink_tokens))
    if not parts:
        return q.new_zeros(q.shape), None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return torch.cat([p.reshape(-1, *q.shape[1:]) for p in parts]), None
    # Without autograd: copy every part once, straight from SDPA's layout into the output.
    out = q.new_empty(q.shape)
    i = 0
    for p in parts:
        n = p.shape[0] * (p.shape[1] if p.dim() == 4 else 1)
        out[i : i + n].view(p.shape).copy_(p)
        i += n
    return out, None


def attention_sdpa_output(*args, **kwargs) -> tuple[torch.Tensor, None]:
    """``attention_sdpa`` without the log-sum-exp: the fast path the model calls."""
    kwargs["need_lse"] = False
    return attention_sdpa(*args, **kwargs)
