"""The Orthros attention op in plain torch: the ground truth for every kernel.

One op serves both streams (``docs/architecture.md``). All tensors are packed along one token
dimension with no padding (flash-attn "varlen" style):

    q        [Nq, Hq, D]   queries of the base stream and of the output stream, any order
    k, v     [Nk, Hkv, D]  keys/values of the base stream (Hq % Hkv == 0: GQA)
    q_index  [Nq]          index into the key dimension of the token a query belongs to
                           (base token i -> i; output token at position p -> the base index of p)
    q_window [Nq]          number of keys a query may see, counting its own token
                           (W for base queries, ``UNBOUNDED`` for output queries)
    cu_seqlens [n_docs+1]  document boundaries in the key dimension (0, ..., Nk)

Query ``i`` attends key ``j`` iff ``doc(j) == doc(q_index[i])``, ``j <= q_index[i]`` and
``q_index[i] - j < q_window[i]``. Because documents are contiguous, that is one contiguous key
range per query, ``[key_start, key_end]`` — the form the kernels use as well.

Which keys a query sees (window, sink tokens, the global tail) is defined once, in
``ops/keys.py``; this module computes attention over those keys. Sink tokens (``sink_tokens = S >
0``) add a *sink range* ``[doc_start, min(doc_start + S, key_start))`` that is empty when the
window already reaches them (always for unbounded queries). Backends compute the window range as
before and the sink range as a second partial attention over at most ``S`` keys, merged exactly
through the log-sum-exp (``attention_with_sinks``); ``S = 0`` never takes that path, so it is
bitwise the plain op. The global tail needs nothing here: a global base query is a query whose
window is ``UNBOUNDED``.
"""

from __future__ import annotations

import math

import torch

from orthros_train.ops.keys import (
    UNBOUNDED,
    allowed_keys,
    key_ranges,
    sink_queries,
)

# Queries per chunk of the reference op: bounds its score memory (the memory model reads it).
REFERENCE_CHUNK = 256


def merge_partial_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the union of two disjoint key sets from the two partials.

    ``out [n, H, D]`` is each partial's normalised output and ``lse [H, n]`` its log-sum-exp;
    both must cover at least one key (no ``-inf`` rows). Returns ``(out, lse)`` of the union.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).t()[..., None]
    w_b = torch.exp(lse_b - lse).t()[..., None]
    return (out_a.float() * w_a + out_b.float() * w_b).to(out_a.dtype), lse


def attention_with_sinks(
    fn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sink_tokens: int,
    scale: float | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    prepared: tuple[object, object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` (any backend returning ``(out, lse)``) with sink tokens: the window partial and the
    sink partial (``sink_queries``), merged by their log-sum-exp. Differentiable wherever ``fn``
    is, including through its LSE.

    ``sinks``: ``sink_queries``' result when the caller has it; ``prepared``: ``fn``'s prepared
    payloads for the window call and the sink call (``prepare_attention``).
    """
    rows, s_index, s_window = sink_queries(q_index, q_window, cu_seqlens, sink_tokens) if sinks is None else sinks
    main_payload, sink_payload = prepared if prepared is not None else (None, None)
    kw = {} if main_payload is None else {"prepared": main_payload}
    out, lse = fn(q, k, v, q_index, q_window, cu_seqlens, scale=scale, **kw)
    if rows.numel() == 0:
        return out, lse
    kw = {} if sink_payload is None else {"prepared": sink_payload}
    o_s, lse_s = fn(q[rows], k, v, s_index, s_window, cu_seqlens, scale=scale, **kw)
    merged, lse_m = merge_partial_attention(out[rows], lse[:, rows], o_s, lse_s)
    return out.index_copy(0, rows, merged), lse.index_copy(1, rows, lse_m)


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    values: bool = True,
) -> None:
    """Raise a ValueError that names the offending argument; shared by every backend.

    Shape checks are free; the value checks (``values``) read device tensors, i.e. cost a
    host-device sync each, so callers whose layout was validated where it was built (the
    model, through prepared metadata) skip them in the per-layer hot path.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [tokens, heads, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim differs: q {q.shape[2]} vs k {k.shape[2]}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} not divisible by kv heads {k.shape[1]}")
    if q_index.shape != (q.shape[0],) or q_window.shape != (q.shape[0],):
        raise ValueError("q_index and q_window must be [Nq]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be 1-D with at least two entries")
    if not values:
        return
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != k.shape[0]:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the number of keys ({k.shape[0]}), "
            f"got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if q.shape[0] and (int(q_index.min()) < 0 or int(q_index.max()) >= k.shape[0]):
        raise ValueError("q_index points outside the keys")
    if q.shape[0] and int(q_window.min()) < 1:
        raise ValueError("q_window must be >= 1 (a query always sees its own token)")


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = REFERENCE_CHUNK,
    sink_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact masked softmax attention; returns ``(out [Nq,Hq,D], lse [Hq,Nq] fp32)``.

    Queries are processed in chunks of ``chunk_size`` after sorting by key range, and each chunk
    only materialises scores against the keys its range spans. Base queries span at most
    ``chunk + W`` keys, so the base stream stays linear in memory; output queries span up to
    their document. Differentiable through plain autograd. Math runs in fp32.
    """
    check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens)
    if sink_tokens:
        def plain(*args, **kw):
            return attention_reference(*args, chunk_size=chunk_size, **kw)

        return attention_with_sinks(plain, q, k, v, q_index, q_window, cu_seqlens, sink_tokens, scale=scale)
    n_q, h_q, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out_dtype = q.dtype
    start, end = key_ranges(q_index, q_window, cu_seqlens)

    # Windowed queries first, then unbounded ones, each sorted by range start: a chunk then never
    # mixes a base query (few keys) with an output query (its whole document), so base chunks span
    # at most chunk + W keys and a decode step scores T + W keys, not 2T.
    unbounded = (q_window.long() >= UNBOUNDED).to(start.device)
    n_k1 = k.shape[0] + 1
    order = torch.argsort((unbounded.long() * n_k1 + start) * n_k1 + end, stable=True)
    n_windowed = int((~unbounded).sum())
    bounds = [*range(0, n_windowed, chunk_size), *range(n_windowed, n_q, chunk_size), n_q]
    outs, lses = [], []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        idx = order[c0 : min(c1, c0 + chunk_size)]
        if idx.numel() == 0:
            continue
        s_lo, e_hi = int(start[idx].min()), int(end[idx].max())
        kc = k[s_lo : e_hi + 1].float()  # [S, Hkv, D]
        vc = v[s_lo : e_hi + 1].float()
        qc = q[idx].float().view(-1, h_kv, group, d)  # [C, Hkv, G, D]
        scores = torch.einsum("chgd,shd->hgcs", qc, kc) * scale  # [Hkv, G, C, S]
        key_pos = torch.arange(s_lo, e_hi + 1, device=q.device)
        allowed = (key_pos[None, :] >= start[idx, None]) & (key_pos[None, :] <= end[idx, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, C]
        probs = torch.exp(scores - lse[..., None])
        o = torch.einsum("hgcs,shd->chgd", probs, vc).reshape(-1, h_q, d)
        outs.append(o)
        lses.append(lse.reshape(h_q, -1))
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros((h_q, 0), dtype=torch.float32)
    out_sorted = torch.cat(outs)
    lse_sorted = torch.cat(lses, dim=1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n_q, device=q.device)
    return out_sorted[inverse].to(out_dtype), lse_sorted[:, inverse]


def attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    sink_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[Nq, Nk]`` mask built from document ids and positions, for tests only.

    Its mask is ``keys.allowed_keys`` (written from the definition rather than from key ranges or
    partial merges), so it checks ``attention_reference`` and every backend independently.
    O(Nq * Nk) memory.
    """
    check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens)
    d = q.shape[2]
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    mask = allowed_keys(q_index, q_window, cu_seqlens, k.shape[0], sink_tokens)
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)
    return out.to(q.dtype), lse
