"""Decode attention over fixed-capacity cache rows whose lengths live on the device.

A decode step that a CUDA graph can replay may not read a tensor on the host nor change a shape:
the cache rows keep one capacity ``C``, and where each row's new token sits (its position, the
keys it may see) is data on the device. This op is the attention of such a step:

    q        [G * B, Hq, D]  G groups of one query per row, group-major (an Orthros layer:
                             the base queries then the output queries; its last layer and the
                             baselines: one group)
    k, v     [B * C, Hkv, D] the cache buffers (``model.cache.KVCache``): row b owns slots
                             ``[b * C, (b + 1) * C)``; the step's own key is already written
    lengths  [B]             each row's position: its query is at slot ``lengths[b]``
    windows  G ints          keys each group's query sees, itself included (``UNBOUNDED``: all)

Query ``(g, b)`` attends slot ``c`` of row ``b`` iff ``c <= lengths[b]`` and
``lengths[b] - c < windows[g]`` or ``c < sink_tokens`` — the rule of ``keys.py`` with one
document per row.

Two implementations: ``decode_rows_torch`` (plain torch, one masked SDPA over every slot; the
CPU path and the reference) and ``decode_rows_triton`` (the flash-decoding kernel of
``triton_decode.py`` with its grid sized by the capacity, so no launch depends on a length, plus
the sink keys a window misses as a second partial of at most ``S`` keys merged by log-sum-exp).
Tests compare both with ``reference.attention_naive``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from orthros_train.ops.keys import UNBOUNDED, allowed_keys, missed_sinks
from orthros_train.ops.reference import merge_partial_attention


def _groups(q: torch.Tensor, lengths: torch.Tensor, windows: Sequence[int]) -> tuple[int, int]:
    b, g = lengths.numel(), len(windows)
    if g < 1 or q.shape[0] != g * b:
        raise ValueError(f"{q.shape[0]} queries for {g} groups of {b} rows")
    return g, b


def slot_mask(lengths: torch.Tensor, capacity: int, windows: Sequence[int], sink_tokens: int = 0) -> torch.Tensor:
    """``[B, G, C]`` bool: which slots each group's query of each row attends (``keys.allowed_keys``
    with every row its own document of ``capacity`` keys)."""
    b, g = lengths.numel(), len(windows)
    q_window = torch.cat([torch.full((b,), w, device=lengths.device, dtype=torch.long) for w in windows])
    one_row = torch.tensor([0, capacity], device=lengths.device)
    mask = allowed_keys(lengths.long().repeat(g), q_window, one_row, capacity, sink_tokens)
    return mask.view(g, b, capacity).transpose(0, 1)


def decode_rows_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    capacity: int,
    windows: Sequence[int],
    sink_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The op in plain torch: each row's queries against all ``C`` slots under ``slot_mask``."""
    g, b = _groups(q, lengths, windows)
    h, d = q.shape[1:]
    qh = q.view(g, b, h, d).permute(1, 2, 0, 3)  # [B, Hq, G, D]
    kh = k.view(b, capacity, *k.shape[1:]).transpose(1, 2)  # [B, Hkv, C, D]
    vh = v.view(b, capacity, *v.shape[1:]).transpose(1, 2)
    mask = slot_mask(lengths, capacity, windows, sink_tokens)[:, None]  # [B, 1, G, C]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=h != k.shape[1])
    return out.permute(2, 0, 1, 3).reshape(g * b, h, d)


def sink_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    capacity: int,
    window: int,
    sink_tokens: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, D], lse [Hq, B])`` of one query per row over the sink slots its window
    misses, ``[0, clamp(length - window + 1, 0, S))``; an empty range gives a zero output and an
    LSE of -inf (no weight in the merge). Plain torch: at most ``S`` keys per row."""
    b, h, d = q.shape
    h_kv = k.shape[1]
    ks = k.view(b, capacity, h_kv, d)[:, :sink_tokens].float()
    vs = v.view(b, capacity, h_kv, d)[:, :sink_tokens].float()
    qs = q.float().view(b, h_kv, h // h_kv, d)
    scores = torch.einsum("bkgd,bskd->bkgs", qs, ks) * scale  # [B, Hkv, group, S]
    missed = missed_sinks(lengths, window, sink_tokens)
    seen = torch.arange(sink_tokens, device=q.device)[None, :] < missed[:, None]  # [B, S]
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where the row misses no sink
    empty = torch.isinf(lse)
    p = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bkgs,bskd->bkgd", p, vs).reshape(b, h, d)
    return out.to(q.dtype), lse.reshape(b, h).t()


def decode_rows_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    capacity: int,
    windows: Sequence[int],
    sink_tokens: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """The op on the flash-decoding kernel: key ranges from the device lengths, the grid from
    ``capacity`` (chunks past a row's length exit at once), no value check (each one a device
    sync). Sinks a window misses: ``sink_partial``, merged by log-sum-exp."""
    from orthros_train.ops.triton_decode import decode_attention_op  # lazy: imports triton

    g, b = _groups(q, lengths, windows)
    if g > 1 and len(set(windows)) == 1:
        return _folded_groups(decode_rows_triton, q, k, v, lengths, capacity, windows, sink_tokens, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    rows = torch.arange(b, device=q.device)
    q_index = (rows * capacity + lengths.long()).repeat(g)
    # device fills, not torch.tensor(windows): a copy from host memory cannot be captured in a graph
    q_window = torch.cat([torch.full((b,), w, device=q.device, dtype=torch.long) for w in windows])
    cu = (torch.arange(b + 1, device=q.device) * capacity).to(torch.int32)
    out, lse = decode_attention_op(q, k, v, q_index, q_window, cu, scale, max_range=capacity, check_values=False)
    if not sink_tokens:
        return out
    parts = []
    for i, window in enumerate(windows):
        group = slice(i * b, (i + 1) * b)
        if window >= UNBOUNDED:  # an unbounded query's range starts at the row's first slot
            parts.append(out[group])
            continue
        o_s, lse_s = sink_partial(q[group], k, v, lengths, capacity, window, sink_tokens, scale)
        parts.append(merge_partial_attention(out[group], lse[:, group], o_s, lse_s)[0])
    return torch.cat(parts)


def _folded_groups(op, q, k, v, lengths, capacity, windows, sink_tokens, scale) -> torch.Tensor:
    """``op`` with every group's query of a row folded into one query of ``G`` times the heads.

    Where all groups see the same keys (a decode step with the global tail: base and output query
    both see the whole row) one pass over the row's cache serves them all: the queries become
    extra heads of each KV head's group, so the kernel reads every cached key once, not ``G`` times.
    """
    g, b = len(windows), lengths.numel()
    h_q, d = q.shape[1:]
    h_kv = k.shape[1]
    folded = q.view(g, b, h_kv, h_q // h_kv, d).permute(1, 2, 0, 3, 4).reshape(b, g * h_q, d)
    out = op(folded, k, v, lengths, capacity, windows[:1], sink_tokens, scale)
    return out.view(b, h_kv, g, h_q // h_kv, d).permute(2, 0, 1, 3, 4).reshape(g * b, h_q, d)


__all__ = ["decode_rows_torch", "decode_rows_triton", "sink_partial", "slot_mask"]
