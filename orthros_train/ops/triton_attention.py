"""Fused Triton kernels for the Orthros attention op (forward and backward).

Same contract as ``ops/reference.py`` (the ground truth): packed queries of both streams
``q [Nq, Hq, D]``, base keys/values ``k, v [Nk, Hkv, D]``, ``q_index``/``q_window [Nq]`` and
``cu_seqlens``; returns ``(out [Nq, Hq, D], lse [Hq, Nq] fp32)``.

How the work stays proportional to the mask
-------------------------------------------
Every query sees one contiguous key range ``[start, end]`` (``reference.key_ranges``). The host
sorts the queries by ``(window, end)``; inside one window class ``start`` is then non-decreasing
as well (``start = max(doc_start(end), end - w + 1)``), so

* a tile of consecutive sorted queries spans the keys ``[min start, max end]`` and only those
  key tiles are visited (a base tile of m queries: ``m + W - 1`` keys; an output tile: from its
  document start to its largest position). Whole-document tiles run the key tiles inside
  ``[max start, min end]`` in a mask-free loop; windowed tiles (three or four key tiles, all on
  the band's edges) run one masked, pipelined loop;
* a forward/dq program packs the query heads that share a KV head (``head_pack``): its tile is
  ``BLOCK_M / pack`` queries x ``pack`` heads, so each K/V tile is loaded once per group.
  Tiles run longest first (reverse sorted order);
* the queries that see a key tile form one contiguous run of the sorted order per window class,
  found by binary search in the kernel. The dk/dv kernel visits only those runs, so the
  backward is deterministic (each dk/dv row is written by one program, dq by one program of a
  separate kernel) and needs no atomics. ``deterministic=False`` instead accumulates dq with
  ``tl.atomic_add`` inside the dk/dv kernel (one kernel, less recomputation, not reproducible
  bit for bit on a GPU).

Sparse output positions (SFT/RL) therefore cost ``O(N * T)``, the base stream ``O(T * W)``.
Queries are gathered through the sort permutation; nothing is copied or padded.

Host side: ``prepare`` sorts the queries into a ``TilePlan`` without reading any tensor value;
a model builds it once per forward (``plan_forward``, through ``ops.attention.prepare_attention``)
and every layer and the backward reuse it, with launch grids sized from host-known row counts.

Numerics: inputs fp32/bf16/fp16, fp32 accumulation, softmax in base 2 with the scale folded in.
Under ``TRITON_INTERPRET=1`` (CPU tests) tiles are upcast to fp32 right after loading (the
interpreter's bf16 arithmetic is wrong) and autotuning has a single config; on a GPU the dots
take bf16/fp16 operands, and fp32 operands run as TF32 (tensor cores, fp32 accumulation; the
exact fp32 path is the reference op).

Entry points: ``attention_triton`` (the ``triton`` backend of ``ops/attention.py``),
``torch.ops.orthros.attention`` (custom op with fake + autograd registration, no graph break
under ``torch.compile``) and ``OrthrosAttentionFunction`` (the same as a plain
``torch.autograd.Function``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from orthros_train.ops.keys import key_ranges
from orthros_train.ops.reference import check_attention_inputs
from orthros_train.ops.triton_interpreter import interpreter_index_fix, interpreting

INTERPRET = interpreting()  # kernels run on CPU tensors in triton's interpreter (tests)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


if INTERPRET:
    interpreter_index_fix()


# --------------------------------------------------------------------------------------------
# autotune configs (one config when interpreting: the interpreter cannot benchmark)
# --------------------------------------------------------------------------------------------


CLASSES = ("band", "full")

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and stream class, chosen from the sm_90
# ahead-of-time compile report (`python bench/attention.py --compile-sm90`, table in
# docs/benchmarks.md): every 16-bit config compiles with 0 spill bytes at head_dim 64 and 128,
# fits the H100's 227 KB of shared memory and has no dot whose warps repeat each other's product
# (`dot_replication` 1). The last one constrains the shapes: triton lays out a dot whose result
# feeds another dot (the scores) with all warps along M, 16 rows per warp, so a tile needs at
# least 16 x num_warps rows there: 64 rows at 4 warps, 128 at 8 (the rows of fwd/dq, the keys
# (BLOCK_N) of dk/dv). With 8 warps on 64 rows both warp groups computed the same scores.
# Not timed on a GPU yet. Each kernel is launched once
# over the windowed queries (the base stream: a band of W keys, where a tile of m queries spans
# m + W - 1 keys, so smaller tiles waste less; every tile masked, one pipelined loop) and once
# over the whole-document queries (the output stream: causal-like, large tiles, mask-free
# interior). In fwd/dq, BLOCK_M counts rows of the dot: queries x the heads packed per program.
_GPU_CONFIGS = {
    "fwd": {
        "band": [(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3)],
        # 128 x 128: the output stream's long causal rows at head_dim 64 (0 spills, 80 KB shared in
        # the sm_90 compile report; at head_dim 128 it spills 24 bytes, so ``tile_fits`` drops it)
        "full": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 2)],
    },
    "dq": {
        "band": [(64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2)],
        "full": [(64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2)],
    },
    "dkdv": {  # BLOCK_N keys per program, BLOCK_M queries per step of its loop
        "band": [(32, 64, 4, 3), (16, 64, 4, 3), (32, 128, 8, 2)],
        "full": [(32, 64, 4, 3), (16, 64, 4, 3), (32, 128, 8, 2)],
    },
    # with atomic dq (a fifth dot and its [BLOCK_M, BLOCK_D] result live in the loop) only the
    # 16-query step stays free of spills at head_dim 128
    "dkdv_atomic": {"band": [(16, 64, 4, 3)], "full": [(16, 64, 4, 3)]},
}
# Triton before 3.9 (3.6 is the GPU image's release) allocates more registers to the dk/dv loop,
# so its dk/dv lists come from the triton 3.6 sm_90 compile report (0 spills, no duplicated dot
# work; fwd/dq lists are clean under both releases). Above WIDE_HEAD_DIM every dk/dv config of the
# 3.9 list spills (d128: 32x64 w4 s3 360 bytes; 16x64 w4 s3 8, 76 with atomic dq): 16-query steps
# only. At head_dim 64 (the 1.3B model) 32-query steps fit with 128 keys at 8 warps, and with 64
# keys at 4 warps and 2 stages for the band and atomic launches (32x64 w4 s3 spills 12-60 bytes,
# 64x64 and 64x128 hundreds), so the 16-query pin stays where it was measured to be needed.
TRITON_BEFORE_3_9 = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)
WIDE_HEAD_DIM = 64  # head dims above this take the narrow < 3.9 dk/dv lists
_GPU_CONFIGS_BEFORE_3_9 = {
    "wide": {
        "dkdv": {"band": [(16, 64, 4, 2)], "full": [(16, 64, 4, 2)]},
        "dkdv_atomic": {"band": [(16, 128, 8, 3)], "full": [(16, 128, 8, 3)]},
    },
    "narrow": {
        "dkdv": {"band": [(32, 128, 8, 2), (32, 64, 4, 2), (16, 64, 4, 3)],
                 "full": [(32, 128, 8, 2), (16, 64, 4, 3), (16, 64, 4, 2)]},
        "dkdv_atomic": {"band": [(32, 128, 8, 2), (32, 64, 4, 2), (16, 128, 8, 3)],
                        "full": [(32, 128, 8, 2), (32, 64, 4, 2), (16, 128, 8, 3)]},
    },
}
# fp32 inputs (TF32 dots): twice the bytes per tile, so smaller tiles and fewer stages.
_GPU_CONFIGS_FP32 = {
    "fwd": {"band": [(64, 32, 4, 2), (32, 32, 4, 2)], "full": [(32, 32, 4, 2), (64, 32, 8, 2)]},
    "dq": {"band": [(32, 32, 4, 2)], "full": [(32, 32, 4, 2), (64, 32, 8, 2)]},
    "dkdv": {"band": [(16, 32, 8, 2), (32, 32, 8, 2)], "full": [(16, 32, 8, 2), (32, 32, 8, 2)]},
    "dkdv_atomic": {"band": [(16, 32, 8, 2), (32, 32, 8, 2)], "full": [(16, 32, 8, 2), (32, 32, 8, 2)]},
}
# The largest tiles keep their accumulators in registers only up to this head dim.
LARGE_TILE = 128 * 128
LARGE_TILE_MAX_HEAD_DIM = 64


def tile_fits(block_m: int, block_n: int, head_dim: int) -> bool:
    """Whether a tile of ``block_m x block_n`` compiles without spills at ``head_dim``."""
    return block_m * block_n < LARGE_TILE or head_dim <= LARGE_TILE_MAX_HEAD_DIM


# The interpreter cannot benchmark: one config per kernel and class.
_INTERP_BLOCKS = {"band": (16, 16), "full": (32, 32)}


def gpu_config_table(fp32: bool, wide: bool, before_3_9: bool | None = None) -> dict:
    """``{kernel: {class: [(BLOCK_M, BLOCK_N, num_warps, num_stages), ...]}}`` for fp32 or 16-bit
    inputs, a head dim above ``WIDE_HEAD_DIM`` or not, and a triton before 3.9 or not (default:
    the installed one)."""
    if fp32:
        return _GPU_CONFIGS_FP32
    if TRITON_BEFORE_3_9 if before_3_9 is None else before_3_9:
        return {**_GPU_CONFIGS, **_GPU_CONFIGS_BEFORE_3_9["wide" if wide else "narrow"]}
    return _GPU_CONFIGS


def _config_list(kernel: str, cls: str, fp32: bool, wide: bool) -> list[triton.Config]:
    if INTERPRET:
        bm, bn = _INTERP_BLOCKS[cls]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    table = gpu_config_table(fp32, wide)
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in table[kernel][cls]
    ]


# Explicit tile sizes ``(BLOCK_M, BLOCK_N)`` for every kernel of a call, bypassing autotune (the
# interpreter's tests and the CPU dry runs use small tiles); None: the autotuned configs. Passed
# through the custom ops as two ints, 0 meaning None.
Blocks = tuple[int, int] | None


def _blocks_args(blocks: Blocks) -> tuple[int, int]:
    return (0, 0) if blocks is None else (int(blocks[0]), int(blocks[1]))


def _blocks_of(block_m: int, block_n: int) -> Blocks:
    return None if block_m <= 0 else (block_m, block_n if block_n > 0 else block_m)


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _lower_bound(ptr, n, target):
    """First index i in [0, n) with ptr[i] >= target (ptr sorted), n if none."""
    lo = tl.program_id(0) * 0  # int32 tensors: loop-carried types must not change
    hi = lo + n
    while lo < hi:
        mid = (lo + hi) // 2
        lt = tl.load(ptr + mid) < target
        lo = tl.where(lt, mid + 1, lo)
        hi = tl.where(lt, hi, mid)
    return lo


@triton.jit
def _upper_bound(ptr, n, target):
    """First index i in [0, n) with ptr[i] > target (ptr sorted), n if none."""
    lo = tl.program_id(0) * 0  # int32 tensors: loop-carried types must not change
    hi = lo + n
    while lo < hi:
        mid = (lo + hi) // 2
        le = tl.load(ptr + mid) <= target
        lo = tl.where(le, mid + 1, lo)
        hi = tl.where(le, hi, mid)
    return lo


@triton.jit
def _load_rows(base, rows64, stride, offs_d, row_mask, d_mask, EVEN_D: tl.constexpr, UPCAST: tl.constexpr):
    """[len(rows), BLOCK_D] tile of a [tokens, ...] tensor (head already folded into base)."""
    ptrs = base + rows64[:, None] * stride + offs_d[None, :]
    if EVEN_D:
        x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _query_tile(
    PERM, QSTART, QEND, ROWS, pid, hp, GROUP: tl.constexpr, HEAD_PACK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Rows of one query tile: ``BLOCK_M // HEAD_PACK`` sorted queries x ``HEAD_PACK`` heads.

    The heads of one program share a KV head (HEAD_PACK divides GROUP), so each K/V tile is
    loaded once for all of them. Tiles run in reverse sorted order: queries are sorted by range
    end, so the last tiles span the most keys and start first (less tail at the end of a wave).
    """
    QM: tl.constexpr = BLOCK_M // HEAD_PACK
    row_lo = tl.load(ROWS)
    row_hi = tl.load(ROWS + 1)
    tile = (row_hi - row_lo + QM - 1) // QM - 1 - pid  # < 0: a spare program of a host-sized grid
    r = tl.arange(0, BLOCK_M)
    rows = row_lo + tile * QM + r // HEAD_PACK
    heads = hp * HEAD_PACK + r % HEAD_PACK
    row_ok = (rows >= row_lo) & (rows < row_hi)  # a spare program (tile < 0) has no rows
    qi = tl.load(PERM + rows, mask=row_ok, other=0).to(tl.int64)
    qs = tl.load(QSTART + rows, mask=row_ok, other=0)
    qe = tl.load(QEND + rows, mask=row_ok, other=-1)
    hk = (hp * HEAD_PACK) // GROUP
    return qi, qs, qe, heads, hk, row_ok


@triton.jit
def _key_bounds(qs, qe, row_ok, BLOCK_N: tl.constexpr, SPLIT_MASK: tl.constexpr):
    """Key tiles of a query tile: [lo, a) masked, [a, b) mask-free, [b, hi) masked.

    Without SPLIT_MASK (the base stream: its few key tiles all cross the band's edges) every
    tile is masked and one pipelined loop covers [lo, hi).
    """
    big = 1073741824  # > any key index (n_k < 2**30); +1 must not overflow int32
    lo = tl.min(tl.where(row_ok, qs, big))
    hi = tl.max(tl.where(row_ok, qe, -1)) + 1
    lo = (lo // BLOCK_N) * BLOCK_N
    a = hi
    b = hi
    if SPLIT_MASK:
        max_start = tl.max(tl.where(row_ok, qs, -1))
        min_end = tl.min(tl.where(row_ok, qe, big))
        hi_al = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        a = ((max_start + BLOCK_N - 1) // BLOCK_N) * BLOCK_N  # first tile with every key >= max start
        b = ((min_end + 1) // BLOCK_N) * BLOCK_N  # tiles below b end at or before min end
        a = tl.maximum(a, lo)
        b = tl.minimum(b, hi_al)
        empty = b <= a
        a = tl.where(empty, hi_al, a)
        b = tl.where(empty, hi_al, b)
    return lo, a, b, hi


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, qs, qe, lo, hi, n_k,
    offs_n, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        cols64 = cols.to(tl.int64)
        if MASKED:
            col_ok = cols < n_k
        else:
            col_ok = cols >= 0  # all true; lets the compiler drop the mask
        # loads written out here, not through a helper: the interpreter re-patches triton.language
        # on every nested jit call, which dominates its run time inside loops
        if EVEN_D:
            kt_mask = col_ok[None, :]
            v_mask = col_ok[:, None]
        else:
            kt_mask = col_ok[None, :] & d_mask[:, None]
            v_mask = col_ok[:, None] & d_mask[None, :]
        kt = tl.load(k_base + cols64[None, :] * stride_kn + offs_d[:, None], mask=kt_mask, other=0.0)
        v = tl.load(v_base + cols64[:, None] * stride_vn + offs_d[None, :], mask=v_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            allowed = (cols[None, :] >= qs[:, None]) & (cols[None, :] <= qe[:, None])
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# The lengths only bound masks and offset LSE rows: Triton's default specialisation of an int on its
# divisibility by 16 would compile every config again for each new layout's length (minutes of cold
# compiles where layouts vary: SFT/RL batches, a benchmark's cases).
@triton.jit(do_not_specialize=["n_q", "n_k", "tune_class", "tune_bucket"])
def _attn_fwd_kernel(
    Q, K, V, Out, LSE, PERM, QSTART, QEND, ROWS,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
    n_q, n_k, qk_scale, tune_class, tune_bucket,  # the last two: autotune key only (_Autotuners)
    GROUP: tl.constexpr, HEAD_PACK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLIT_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # this launch covers the sorted rows [ROWS[0], ROWS[1]) (one stream class)
    qi, qs, qe, heads, hk, row_ok = _query_tile(
        PERM, QSTART, QEND, ROWS, tl.program_id(0), tl.program_id(1), GROUP, HEAD_PACK, BLOCK_M
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q_ptrs = Q + qi[:, None] * stride_qm + heads[:, None] * stride_qh + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    lo, a, b, hi = _key_bounds(qs, qe, row_ok, BLOCK_N, SPLIT_MASK)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked tiles give no NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, qs, qe, lo, a, n_k,
                               offs_n, offs_d, d_mask, qk_scale, BLOCK_N, True, EVEN_D, UPCAST, PRECISION)
    if SPLIT_MASK:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, qs, qe, a, b, n_k,
                                   offs_n, offs_d, d_mask, qk_scale, BLOCK_N, False, EVEN_D, UPCAST, PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, qs, qe, b, hi, n_k,
                                   offs_n, offs_d, d_mask, qk_scale, BLOCK_N, True, EVEN_D, UPCAST, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    o_ptrs = Out + heads[:, None] * stride_oh + qi[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(LSE + heads * n_q + qi, lse, mask=row_ok)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, qs, qe, lo, hi, n_k,
    offs_n, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        cols64 = cols.to(tl.int64)
        if MASKED:
            col_ok = cols < n_k
        else:
            col_ok = cols >= 0
        if EVEN_D:
            t_mask = col_ok[None, :]
        else:
            t_mask = col_ok[None, :] & d_mask[:, None]
        kt = tl.load(k_base + cols64[None, :] * stride_kn + offs_d[:, None], mask=t_mask, other=0.0)
        vt = tl.load(v_base + cols64[None, :] * stride_vn + offs_d[:, None], mask=t_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            allowed = (cols[None, :] >= qs[:, None]) & (cols[None, :] <= qe[:, None])
            s = tl.where(allowed, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


# The lengths only bound masks and offset LSE rows: Triton's default specialisation of an int on its
# divisibility by 16 would compile every config again for each new layout's length (minutes of cold
# compiles where layouts vary: SFT/RL batches, a benchmark's cases).
@triton.jit(do_not_specialize=["n_q", "n_k", "tune_class", "tune_bucket"])
def _attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, PERM, QSTART, QEND, ROWS,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dqm, stride_dqh,
    n_q, n_k, sm_scale, qk_scale, tune_class, tune_bucket,  # the last two: autotune key only
    GROUP: tl.constexpr, HEAD_PACK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SPLIT_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    qi, qs, qe, heads, hk, row_ok = _query_tile(
        PERM, QSTART, QEND, ROWS, tl.program_id(0), tl.program_id(1), GROUP, HEAD_PACK, BLOCK_M
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    if EVEN_D:
        r_mask = row_ok[:, None]
    else:
        r_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(Q + qi[:, None] * stride_qm + heads[:, None] * stride_qh + offs_d[None, :], mask=r_mask, other=0.0)
    do = tl.load(DO + qi[:, None] * stride_dom + heads[:, None] * stride_doh + offs_d[None, :], mask=r_mask,
                 other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE + heads * n_q + qi, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + heads * n_q + qi, mask=row_ok, other=0.0)

    lo, a, b, hi = _key_bounds(qs, qe, row_ok, BLOCK_N, SPLIT_MASK)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, qs, qe, lo, a, n_k,
                       offs_n, offs_d, d_mask, qk_scale, BLOCK_N, True, EVEN_D, UPCAST, PRECISION)
    if SPLIT_MASK:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, qs, qe, a, b, n_k,
                           offs_n, offs_d, d_mask, qk_scale, BLOCK_N, False, EVEN_D, UPCAST, PRECISION)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, qs, qe, b, hi, n_k,
                           offs_n, offs_d, d_mask, qk_scale, BLOCK_N, True, EVEN_D, UPCAST, PRECISION)
    dq_ptrs = DQ + heads[:, None] * stride_dqh + qi[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, cols, q_base, do_base, dq_base, stride_qm, stride_dom, stride_dqm,
    LSE_H, DELTA_H, PERM, QSTART, QEND, seg_lo, seg_hi,
    offs_m, offs_d, d_mask, sm_scale, qk_scale,
    BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """Accumulate dk/dv of one key tile over the sorted query rows [seg_lo, seg_hi) (masked)."""
    for m0 in range(seg_lo, seg_hi, BLOCK_M):
        rows = m0 + offs_m
        row_ok = rows < seg_hi
        qi = tl.load(PERM + rows, mask=row_ok, other=0).to(tl.int64)
        if EVEN_D:
            r_mask = row_ok[:, None]
        else:
            r_mask = row_ok[:, None] & d_mask[None, :]
        q = tl.load(q_base + qi[:, None] * stride_qm + offs_d[None, :], mask=r_mask, other=0.0)
        do = tl.load(do_base + qi[:, None] * stride_dom + offs_d[None, :], mask=r_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse2 = tl.load(LSE_H + qi, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA_H + qi, mask=row_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        qs = tl.load(QSTART + rows, mask=row_ok, other=0)
        qe = tl.load(QEND + rows, mask=row_ok, other=-1)
        allowed = (cols[:, None] >= qs[None, :]) & (cols[:, None] <= qe[None, :]) & row_ok[None, :]
        st = tl.where(allowed, st, float("-inf"))
        pt = tl.math.exp2(st - lse2[None, :])
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        # the softmax scale folds into dS here (one multiply per score), so dk needs no scaling
        # after the loop and can start from the partial sums of an earlier launch
        dst = pt * (dpt - delta[None, :]) * sm_scale
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=PRECISION)
            dq_ptrs = dq_base + qi[:, None] * stride_dqm + offs_d[None, :]
            tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & d_mask[None, :])
    return dk, dv


# The lengths only bound masks and offset LSE rows: Triton's default specialisation of an int on its
# divisibility by 16 would compile every config again for each new layout's length (minutes of cold
# compiles where layouts vary: SFT/RL batches, a benchmark's cases).
@triton.jit(do_not_specialize=["n_q", "n_k", "tune_class", "tune_bucket"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DKA, DVA, DQ, LSE, DELTA, PERM, QSTART, QEND, COMP_START, COMP_END, NGROUPS, ROWS,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dkn, stride_dkh, stride_dvn, stride_dvh, stride_dqm, stride_dqh,
    n_q, n_k, sm_scale, qk_scale, tune_class, tune_bucket,  # the last two: autotune key only
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk/dv of one key tile from the sorted rows [ROWS[0], ROWS[1]); with ACCUMULATE, starts
    from the fp32 partial sums DKA/DVA of an earlier launch (same layout as DK/DV).

    One masked, pipelined loop over the query tiles that see the key tile: a mask-free interior
    loop (as in the forward) would need its own registers per loop and made every 16-bit config
    at head_dim 128 spill; the mask is a few integer ops per score next to four dots.
    """
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    # Last key of the tile, clamped to n_k so the searches stay inside one window class
    # (a class spans n_k + 1 composite values).
    n1 = tl.minimum(n0 + BLOCK_N - 1, n_k)
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_k
    cols64 = cols.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    k = _load_rows(K + hk * stride_kh, cols64, stride_kn, offs_d, col_ok, d_mask, EVEN_D, UPCAST)
    v = _load_rows(V + hk * stride_vh, cols64, stride_vn, offs_d, col_ok, d_mask, EVEN_D, UPCAST)
    out_mask = col_ok[:, None] & d_mask[None, :]
    if ACCUMULATE:
        # Start from the band launch's fp32 partial sums: loading them after the loop kept two
        # more [BLOCK_N, BLOCK_D] fp32 tiles live next to the accumulators (spills at head_dim 128).
        acc_off = hk * stride_dkh + cols64[:, None] * stride_dkn + offs_d[None, :]
        dk = tl.load(DKA + acc_off, mask=out_mask, other=0.0).to(tl.float32)
        dv = tl.load(DVA + acc_off, mask=out_mask, other=0.0).to(tl.float32)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    row_lo = tl.load(ROWS)
    row_hi = tl.load(ROWS + 1)
    n_groups = tl.load(NGROUPS)
    for g in range(0, n_groups):
        # Sorted rows of window class g: comp = g * (n_k + 1) + start/end, both non-decreasing.
        base = tl.cast(g, tl.int64) * (n_k + 1)
        q_lo = _lower_bound(COMP_END, n_q, base + n0)  # first row with end >= n0
        q_hi = _upper_bound(COMP_START, n_q, base + n1)  # first row with start > n1
        q_lo = tl.maximum(q_lo, row_lo)
        q_hi = tl.minimum(q_hi, row_hi)
        for j in range(GROUP):
            h = hk * GROUP + j
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, cols, Q + h * stride_qh, DO + h * stride_doh, DQ + h * stride_dqh,
                stride_qm, stride_dom, stride_dqm, LSE + h * n_q, DELTA + h * n_q, PERM, QSTART, QEND, q_lo, q_hi,
                offs_m, offs_d, d_mask, sm_scale, qk_scale,
                BLOCK_M, EVEN_D, UPCAST, PRECISION, ATOMIC_DQ,
            )
    dk_ptrs = DK + hk * stride_dkh + cols64[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + hk * stride_dvh + cols64[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["n_q"])
def _bwd_delta_kernel(
    OUT, DO, DLSE, DELTA, stride_om, stride_oh, stride_dom, stride_doh, n_q,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """``DELTA[h, i] = sum_d DO[i, h, d] * OUT[i, h, d] - DLSE[h, i]`` in fp32 (DLSE, DELTA: [Hq, Nq]).

    The FlashAttention-2 backward's preprocess: tiles are upcast in registers, so no fp32 copy
    of the output (or of its gradient) is ever materialised.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < n_q
    mask = row_ok[:, None] & (offs_d < D)[None, :]
    rows64 = rows.to(tl.int64)
    o = tl.load(OUT + rows64[:, None] * stride_om + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + rows64[:, None] * stride_dom + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + h * n_q + rows64, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + h * n_q + rows64, delta, mask=row_ok)


# One fixed launch: a memory-bound row sum (each element read once) has nothing to autotune.
DELTA_LAUNCH = {"BLOCK_M": 64, "num_warps": 4}


def backward_delta(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """``delta [Hq, Nq] fp32 = rowsum(dout * out) - dlse`` through ``_bwd_delta_kernel``."""
    n_q, h_q, d = out.shape
    delta = torch.empty((h_q, n_q), dtype=torch.float32, device=out.device)
    if n_q == 0:
        return delta
    # dlse is [Hq, Nq] (D times smaller than out): made contiguous fp32 if it is not already
    dl = delta if dlse is None else dlse.to(torch.float32).contiguous()  # placeholder when HAS_DLSE is off
    _bwd_delta_kernel[(triton.cdiv(n_q, DELTA_LAUNCH["BLOCK_M"]), h_q)](
        out, dout, dl, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), n_q,
        D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), HAS_DLSE=dlse is not None,
        BLOCK_M=DELTA_LAUNCH["BLOCK_M"], num_warps=DELTA_LAUNCH["num_warps"],
    )
    return delta


def backward_delta_reference(dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """Plain-torch ``backward_delta`` (tests): the same sum through fp32 copies of both tensors."""
    delta = (dout.float() * out.float()).sum(-1).t()
    return (delta if dlse is None else delta - dlse.float()).contiguous()


def _config_key(cfg: triton.Config) -> tuple[int, int, int, int]:
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


# Kernel arguments that carry an autotuner's stream class (index in CLASSES) and length bucket
# into Triton's tuning key (see _Autotuners).
TUNE_ARGS = ("tune_class", "tune_bucket")


def length_bucket(rows: int, n_k: int) -> int:
    """The autotuners' size key of a launch: the power of two at or above its rows and keys,
    clamped to [1K, 256K]. The best tile depends on the problem's size (a short sequence fills
    the GPU only with small tiles, a long one wants the largest), but keying on exact lengths
    would benchmark every config again for each new packing of SFT data."""
    n = max(rows, n_k, 1)
    return min(max(triton.next_power_of_2(n), 1 << 10), 1 << 18)


class _Autotuners(dict):
    """One autotuner per (stream class, length bucket), built on first use; each keeps its own
    best config (the compiled kernels are shared: they live on the jit function). The prune
    keeps the configs listed for the input dtype (fp32 tiles need twice the shared memory), the
    head dim (``_config_list``) and, for dk/dv, the dq variant (``ATOMIC_DQ``, passed as a
    keyword: the autotuner hands it over with the other keyword arguments).

    Triton's on-disk autotune cache (``TRITON_CACHE_AUTOTUNING=1``: gpu_check and
    ``trainer.deterministic`` turn it on) names an entry from the jit function, the tuning key (the
    values of the arguments in ``key`` and every tensor's dtype) and the pruned configs, never from
    the Autotuner object. Tuners of one kernel that differ only in class or bucket would share
    one entry, and the first to tune would hand its pick to the others (a 128K launch run with
    tiles timed at 4K for the other stream). So every launch passes its class and bucket as two
    kernel arguments named in ``key`` (``TUNE_ARGS``; the kernels ignore them and do not
    specialise on them, so every bucket shares one compile): they are part of the tuning key and
    of the entry's name (``tests/test_autotune_entries.py`` computes the names as triton does).
    """

    def __init__(self, kernel: str, fn, key: list[str], **kw) -> None:
        super().__init__()
        self.kernel, self.fn, self.key, self.kw = kernel, fn, [*key, *TUNE_ARGS], kw

    def __missing__(self, cls_bucket: tuple[str, int]):
        (cls, bucket), kernel = cls_bucket, self.kernel
        variants = (kernel, f"{kernel}_atomic") if kernel == "dkdv" else (kernel,)
        lists = {(name, fp32, wide): _config_list(name, cls, fp32, wide)
                 for name in variants for fp32 in (False, True) for wide in (False, True)}
        union = list({_config_key(c): c for cfgs in lists.values() for c in cfgs}.values())

        def prune(configs, named_args, **kwargs):
            if INTERPRET:
                return configs
            name = f"{kernel}_atomic" if kwargs.get("ATOMIC_DQ", named_args.get("ATOMIC_DQ")) else kernel
            q = named_args["Q"]
            head_dim = q.shape[-1]
            keep = {_config_key(c) for c in lists[(name, q.dtype == torch.float32, head_dim > WIDE_HEAD_DIM)]}
            return [c for c in configs if _config_key(c) in keep
                    and tile_fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], head_dim)]

        tuner = triton.autotune(configs=union, key=self.key, prune_configs_by={"early_config_prune": prune},
                                **self.kw)(self.fn)
        tuner.tune_args = dict(zip(TUNE_ARGS, (CLASSES.index(cls), int(bucket))))  # what _launch passes
        self[cls_bucket] = tuner
        return tuner


def _autotuned(kernel: str, fn, key: list[str], **kw) -> _Autotuners:
    return _Autotuners(kernel, fn, key, **kw)


_FWD = _autotuned("fwd", _attn_fwd_kernel, ["BLOCK_D", "GROUP", "HEAD_PACK", "PRECISION"])
_BWD_DQ = _autotuned("dq", _attn_bwd_dq_kernel, ["BLOCK_D", "GROUP", "HEAD_PACK", "PRECISION"])
_BWD_DKDV = _autotuned(
    "dkdv", _attn_bwd_dkdv_kernel, ["BLOCK_D", "GROUP", "PRECISION", "ATOMIC_DQ", "ACCUMULATE"],
    restore_value=["DQ"],  # the full launch's atomics add onto the band launch's dq
)
_KERNELS = {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}

# Arguments that are not q/k/v-typed pointers, strides, counts or scales, for ahead-of-time
# compiles (bench/attention.py).
KERNEL_ARG_TYPES = {
    "PERM": "*i32", "QSTART": "*i32", "QEND": "*i32", "ROWS": "*i32", "NGROUPS": "*i32",
    "tune_class": "i32", "tune_bucket": "i32",
    "COMP_START": "*i64", "COMP_END": "*i64",
    "LSE": "*fp32", "DELTA": "*fp32", "DQ": "*fp32", "DKA": "*fp32", "DVA": "*fp32", "DLSE": "*fp32",
}


def head_pack(group: int) -> int:
    """Query heads per program: the largest power of two dividing the GQA group, at most 16
    (so it divides every BLOCK_M); they share one KV head."""
    pack = 1
    while group % (pack * 2) == 0 and pack * 2 <= 16:
        pack *= 2
    return pack


def kernel_specs(head_dim: int, group: int, dtype: torch.dtype) -> list[dict]:
    """Every (kernel, constexprs, launch config) the autotuners may compile for these inputs
    (after their dtype prune), for ahead-of-time compile reports (``bench/attention.py``)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    specs = []
    for kernel, fn in _KERNELS.items():
        for cls in CLASSES:
            for variant in ((False, True) if kernel == "dkdv" else (None,)):
                table = "dkdv_atomic" if variant else kernel
                for cfg in _config_list(table, cls, dtype == torch.float32, head_dim > WIDE_HEAD_DIM):
                    bm, bn, w, s = _config_key(cfg)
                    if not tile_fits(bm, bn, head_dim):
                        continue
                    consts = {"GROUP": group, "D": head_dim, "BLOCK_D": block_d, "EVEN_D": head_dim == block_d,
                              "UPCAST": False, "PRECISION": _precision(dtype), "BLOCK_M": bm, "BLOCK_N": bn}
                    if kernel == "dkdv":
                        consts.update(ATOMIC_DQ=variant, ACCUMULATE=cls == "full")
                    else:
                        consts.update(HEAD_PACK=head_pack(group), SPLIT_MASK=cls == "full")
                    specs.append({
                        "kernel": f"{kernel}[{cls}{', atomic dq' if variant else ''}]", "fn": fn, "consts": consts,
                        "autotune": True, "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s},
                    })
    specs.append({
        "kernel": "bwd_delta", "fn": _bwd_delta_kernel, "autotune": False, "fixed": True,
        "consts": {"D": head_dim, "BLOCK_D": block_d, "HAS_DLSE": True, "BLOCK_M": DELTA_LAUNCH["BLOCK_M"]},
        "config": {"BLOCK_M": DELTA_LAUNCH["BLOCK_M"], "BLOCK_N": block_d, "num_warps": DELTA_LAUNCH["num_warps"],
                   "num_stages": 3},
    })
    return specs


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


@dataclass
class TilePlan:
    """The queries' sort order and ranges, built once per forward and shared by every layer
    and by the backward (``prepare``). All tensors live on the query device; the counts are
    host integers, so nothing here ever waits for the device.

    ``perm`` sorted position -> query; ``start``/``end`` the sorted key ranges (int32);
    ``bounds`` int32 ``[0, n_band, n_q]`` (sorted rows of the windowed queries, then of the
    whole-document queries: one launch each); ``comp_start``/``comp_end`` the composite keys
    ``class * (n_k + 1) + start/end`` of the dk/dv kernel's searches and ``n_groups`` the number
    of window classes; ``n_band`` the windowed rows when the host knows them (else ``None``: the
    grids then cover all rows and the spare programs exit at once).
    """

    perm: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    bounds: torch.Tensor
    comp_start: torch.Tensor
    comp_end: torch.Tensor
    n_groups: torch.Tensor
    n_q: int
    n_k: int
    n_band: int | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.perm, self.start, self.end, self.bounds, self.comp_start, self.comp_end, self.n_groups]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], n_k: int, n_band: int) -> "TilePlan":
        perm = tensors[0]
        return cls(*tensors, n_q=perm.numel(), n_k=n_k, n_band=None if n_band < 0 else n_band)

    def rows(self, cls: str) -> torch.Tensor:
        return self.bounds[0:2] if cls == "band" else self.bounds[1:3]

    def launches(self) -> list[tuple[str, int]]:
        """(class, rows its grid covers) per launch: exact and non-empty when counts are known."""
        if self.n_band is None:
            return [(cls, self.n_q) for cls in CLASSES]
        counts = {"band": self.n_band, "full": self.n_q - self.n_band}
        return [(cls, counts[cls]) for cls in CLASSES if counts[cls] > 0]


def prepare(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    n_band: int | None = None,
    count_on_cpu: bool = False,
) -> TilePlan:
    """Sort the queries by (window, end); reads no tensor value (no host-device sync).

    ``n_band`` is the number of queries with a window of at most ``n_k`` keys, when the caller
    knows it (the model does: its base queries). ``count_on_cpu`` counts it when the tensors
    live on the CPU, where that is free (standalone calls: tests, the interpreter).
    """
    device = q_index.device
    cu = cu_seqlens.to(device)
    start, end = key_ranges(q_index, q_window, cu)
    # Windows >= n_k + 1 all mean "whole document": one class, sorted last.
    win = q_window.long().clamp(max=n_k + 1)
    order = torch.argsort(win * (n_k + 1) + end, stable=True)
    win_sorted = win[order]
    band_rows = (win_sorted <= n_k).sum().to(torch.int32).reshape(1)
    if n_band is None and count_on_cpu and device.type == "cpu":
        n_band = int(band_rows)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    n_q = torch.full((1,), order.numel(), dtype=torch.int32, device=device)
    gid = torch.zeros_like(win_sorted)
    gid[1:] = torch.cumsum((win_sorted[1:] != win_sorted[:-1]).long(), 0)
    return TilePlan(
        perm=order.to(torch.int32),
        start=start[order].to(torch.int32).contiguous(),
        end=end[order].to(torch.int32).contiguous(),
        bounds=torch.cat([zero, band_rows, n_q]),
        comp_start=(gid * (n_k + 1) + start[order]).contiguous(),
        comp_end=(gid * (n_k + 1) + end[order]).contiguous(),
        n_groups=(gid[-1:] + 1).to(torch.int32).contiguous() if order.numel() else zero + 1,
        n_q=order.numel(),
        n_k=n_k,
        n_band=n_band,
    )


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs run their dots in TF32 on a GPU (tensor cores; 10-bit mantissa operands, fp32
    accumulation), as flash-attention style kernels do; the exact fp32 path is the reference op.
    ``ieee`` dots would run without tensor cores and spill (see docs/benchmarks.md)."""
    return "tf32"


def _common(q: torch.Tensor, k: torch.Tensor) -> dict:
    d = q.shape[2]
    block_d = max(16, triton.next_power_of_2(d))
    return {
        "GROUP": q.shape[1] // k.shape[1],
        "D": d,
        "BLOCK_D": block_d,
        "EVEN_D": block_d == d,
        "UPCAST": INTERPRET,
        "PRECISION": _precision(q.dtype),
    }


def _launch(kernel, grid_fn, args, meta, blocks: Blocks = None):
    """Run an autotuned kernel, or its plain jit function at the given block sizes."""
    tune = kernel.tune_args  # the tuner's class and bucket: part of its tuning key (_Autotuners)
    if blocks is None:
        kernel[grid_fn](*args, **meta, **tune)
        return
    sizes = {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
    kernel.fn[grid_fn(sizes)](*args, **meta, **tune, **sizes, num_warps=4, num_stages=1 if INTERPRET else 2)


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            "the triton attention backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "orthros_train.ops.triton_attention is imported (CPU interpreter, for tests)"
        )


def _contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attention_forward(
    q, k, v, q_index, q_window, cu_seqlens, scale: float, plan: TilePlan | None = None, blocks: Blocks = None
):
    """Launch the forward kernel (once per stream class); returns ``(out, lse)``."""
    _check_device(q)
    q, k, v = _contig(q), _contig(k), _contig(v)
    n_q, h_q, _ = q.shape
    n_k = k.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty((h_q, n_q), dtype=torch.float32, device=q.device)
    if n_q == 0:
        return out, lse
    plan = plan or prepare(q_index, q_window, cu_seqlens, n_k, count_on_cpu=True)
    common = _common(q, k)
    pack = head_pack(common["GROUP"])
    for cls, rows in plan.launches():
        _launch(
            _FWD[cls, length_bucket(rows, n_k)],
            lambda meta, rows=rows: (triton.cdiv(rows * pack, meta["BLOCK_M"]), h_q // pack),
            (
                q, k, v, out, lse, plan.perm, plan.start, plan.end, plan.rows(cls),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), n_q, n_k, scale * LOG2E,
            ),
            {**common, "HEAD_PACK": pack, "SPLIT_MASK": cls == "full"},
            blocks,
        )
    return out, lse


def attention_backward(
    dout, dlse, q, k, v, out, lse, q_index, q_window, cu_seqlens, scale, deterministic,
    plan: TilePlan | None = None, blocks: Blocks = None,
):
    """Launch the backward kernels; returns ``(dq, dk, dv)`` in the input dtypes.

    dk/dv: the band launch writes fp32 partial sums, the full launch adds them and stores the
    result (two launches in a fixed order: still deterministic). dq: one program per query tile
    (``deterministic``) or atomics from the dk/dv kernel. Key tiles run in index order, which is
    longest first for causal rows (early keys are seen by the most queries).
    """
    _check_device(q)
    q, k, v, dout = _contig(q), _contig(k), _contig(v), _contig(dout)
    n_q, h_q, _ = q.shape
    n_k, h_kv, _ = k.shape
    # delta_i = rowsum(dO * O) - dLSE_i  (the lse gradient folds into the same term)
    delta = backward_delta(dout, _contig(out), dlse)
    lse = lse.contiguous()
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # contiguous, like the fp32 partials
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n_q == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    plan = plan or prepare(q_index, q_window, cu_seqlens, n_k, count_on_cpu=True)
    common = _common(q, k)
    pack = head_pack(common["GROUP"])
    if deterministic:
        dq = torch.empty_like(q)
        dq_acc = dq  # unused by the dk/dv kernel when ATOMIC_DQ is off
    else:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk_part = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv_part = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    launches = [cls for cls, _ in plan.launches()]
    for cls in launches:
        accumulate = len(launches) == 2 and cls == "full"
        dk_out, dv_out = (dk_part, dv_part) if len(launches) == 2 and cls == "band" else (dk, dv)
        _launch(
            _BWD_DKDV[cls, length_bucket(n_q, n_k)],
            lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), h_kv),
            (
                q, k, v, dout, dk_out, dv_out, dk_part, dv_part, dq_acc, lse, delta,
                plan.perm, plan.start, plan.end, plan.comp_start, plan.comp_end, plan.n_groups, plan.rows(cls),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dk_out.stride(0), dk_out.stride(1),
                dv_out.stride(0), dv_out.stride(1), dq_acc.stride(0), dq_acc.stride(1),
                n_q, n_k, scale, scale * LOG2E,
            ),
            {**common, "ATOMIC_DQ": not deterministic, "ACCUMULATE": accumulate},
            blocks,
        )
    if not deterministic:
        return dq_acc.to(q.dtype), dk, dv
    for cls, rows in plan.launches():
        _launch(
            _BWD_DQ[cls, length_bucket(rows, n_k)],
            lambda meta, rows=rows: (triton.cdiv(rows * pack, meta["BLOCK_M"]), h_q // pack),
            (
                q, k, v, dout, dq, lse, delta, plan.perm, plan.start, plan.end, plan.rows(cls),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                n_q, n_k, scale, scale * LOG2E,
            ),
            {**common, "HEAD_PACK": pack, "SPLIT_MASK": cls == "full"},
            blocks,
        )
    return dq, dk, dv


def forward_tile_work(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    blocks: dict[str, tuple[int, int]] | None = None,
    heads_per_program: int = 1,
) -> dict[str, int]:
    """Work of the forward kernel at given ``{class: (BLOCK_M, BLOCK_N)}``, mirrored on the host.

    ``visited``: query-key pairs in the key tiles the kernel loads (per head); ``unmasked``: the
    pairs the mask allows. ``visited / unmasked`` near 1 means work proportional to the mask.
    A tile holds ``BLOCK_M // heads_per_program`` queries (``head_pack`` of the GQA group).
    """
    blocks = blocks or {"band": (64, 64), "full": (128, 64)}
    plan = prepare(q_index.cpu(), q_window.cpu(), cu_seqlens.cpu(), n_k, count_on_cpu=True)
    visited = tiles = 0
    bounds = plan.bounds.tolist()
    for cls, (lo_row, hi_row) in zip(CLASSES, (bounds[0:2], bounds[1:3])):
        rows_m, bn = blocks[cls]
        bm = max(1, rows_m // heads_per_program)
        if hi_row <= lo_row:
            continue
        start = plan.start[lo_row:hi_row].long()
        end = plan.end[lo_row:hi_row].long()
        pad = (-start.numel()) % bm
        start = torch.nn.functional.pad(start, (0, pad), value=2**62).view(-1, bm)
        end = torch.nn.functional.pad(end, (0, pad), value=-1).view(-1, bm)
        lo = start.min(1).values // bn * bn
        hi = (end.max(1).values + bn) // bn * bn
        n = int(((hi - lo) // bn).sum())
        tiles += n
        visited += n * bm * bn
    unmasked = int((plan.end.long() - plan.start.long() + 1).sum())
    return {"visited": visited, "unmasked": unmasked, "key_tiles": tiles}


# --------------------------------------------------------------------------------------------
# torch.library custom ops (visible to torch.compile without graph breaks)
# --------------------------------------------------------------------------------------------
# ``orthros::attention_planned`` takes a prepared TilePlan (its tensors and host row count, -1 =
# unknown), so a model sorts its queries once per forward and every layer and backward reuse it.


def _tile_plan(plan, n_band, q_index, q_window, cu_seqlens, n_k) -> TilePlan | None:
    if not plan:
        return None  # built by attention_forward / attention_backward
    return TilePlan.from_tensors(list(plan), n_k, n_band)


def _attention_impl(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, plan, n_band, block_m, block_n):
    tile_plan = _tile_plan(plan, n_band, q_index, q_window, cu_seqlens, k.shape[0])
    return attention_forward(q, k, v, q_index, q_window, cu_seqlens, scale, tile_plan, _blocks_of(block_m, block_n))


@torch.library.custom_op("orthros::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    deterministic: bool,
    block_m: int = 0,
    block_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _attention_impl(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, [], -1, block_m, block_n)
    return out, lse


@torch.library.custom_op("orthros::attention_planned", mutates_args=())
def _attention_planned_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    deterministic: bool,
    plan: list[torch.Tensor],
    n_band: int,
    block_m: int = 0,
    block_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _attention_impl(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, plan, n_band,
                               block_m, block_n)
    return out, lse


@_attention_op.register_fake
def _attention_fake(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, block_m=0, block_n=0):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@_attention_planned_op.register_fake
def _attention_planned_fake(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, plan, n_band, block_m=0,
                            block_n=0):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("orthros::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    deterministic: bool,
    plan: list[torch.Tensor],
    n_band: int,
    block_m: int = 0,
    block_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tile_plan = _tile_plan(plan, n_band, q_index, q_window, cu_seqlens, k.shape[0])
    return attention_backward(
        dout, dlse, q, k, v, out, lse, q_index, q_window, cu_seqlens, scale, deterministic, tile_plan,
        _blocks_of(block_m, block_n),
    )


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, q_index, q_window, cu_seqlens, scale, det, plan,
                             n_band, block_m=0, block_n=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, q, k, v, out, lse, q_index, q_window, cu_seqlens, scale, deterministic, plan=(), n_band=-1,
          block_m=0, block_n=0):
    ctx.save_for_backward(q, k, v, out, lse, q_index, q_window, cu_seqlens, *plan)
    ctx.scale = scale
    ctx.deterministic = deterministic
    ctx.n_band = n_band
    ctx.blocks = (block_m, block_n)


# The custom ops' autograd leaves out trailing arguments equal to their defaults (the block
# sizes) from the inputs it expects gradients for: the backward returns one gradient per input in
# ``ctx.needs_input_grad``, which has that structure.


def _setup_context(ctx, inputs, output):
    _save(ctx, *inputs[:3], *output, *inputs[3:])


def _setup_context_unplanned(ctx, inputs, output):
    _save(ctx, *inputs[:3], *output, *inputs[3:8], (), -1, *inputs[8:])


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_index, q_window, cu_seqlens, *plan = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.orthros.attention_backward(
        dout, dlse, q, k, v, out, lse, q_index, q_window, cu_seqlens, ctx.scale, ctx.deterministic, plan, ctx.n_band,
        *ctx.blocks,
    )
    return (dq, dk, dv, None, None, None, None, None, None, None)[: len(ctx.needs_input_grad)]


def _backward_planned(ctx, dout, dlse):
    dq, dk, dv, *_ = _backward(ctx, dout, dlse)
    n_plan = len(ctx.saved_tensors) - 8
    return (dq, dk, dv, None, None, None, None, None, [None] * n_plan, None, None, None)[: len(ctx.needs_input_grad)]


_attention_op.register_autograd(_backward, setup_context=_setup_context_unplanned)
_attention_planned_op.register_autograd(_backward_planned, setup_context=_setup_context)


class OrthrosAttentionFunction(torch.autograd.Function):
    """The same forward/backward as ``torch.ops.orthros.attention``, as a plain autograd.Function."""

    @staticmethod
    def forward(ctx, q, k, v, q_index, q_window, cu_seqlens, scale, deterministic):
        out, lse = torch.ops.orthros.attention(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic)
        _save(ctx, q, k, v, out, lse, q_index, q_window, cu_seqlens, scale, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


@dataclass
class TritonForwardPlan:
    """What the ``triton`` backend precomputes once per forward pass (``plan_forward``):
    the tile plan and, for decode steps, the longest key range (sizes the decode grid)."""

    plan: TilePlan
    max_range: int | None = None


def plan_forward(
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_k: int,
    n_band: int | None = None,
    max_range: int | None = None,
) -> TritonForwardPlan:
    """Build the metadata every layer of one forward reuses (no host-device sync).

    The caller vouches that the query/key layout is valid (it was validated where it was built):
    calls that pass the result skip the value checks that would each cost a device sync.
    """
    return TritonForwardPlan(prepare(q_index, q_window, cu_seqlens, n_k, n_band), max_range)


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    deterministic: bool = True,
    decode: bool | None = None,
    prepared: TritonForwardPlan | None = None,
    blocks: Blocks = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``triton`` backend: ``(out, lse)`` with the contract of ``attention_reference``.

    ``deterministic`` picks the atomic-free backward (default; also forced when
    ``torch.use_deterministic_algorithms(True)`` is on). ``decode`` routes to the
    flash-decoding kernel (``ops/triton_decode.py``); ``None`` does so when no gradient is needed
    and there are at most two queries per document (a decode step). ``prepared`` (from
    ``plan_forward`` for these queries and keys) skips the per-call sort and value checks.
    """
    # value checks read tensors (device syncs): only for a standalone call, never in a graph
    values = prepared is None and not torch.compiler.is_compiling()
    check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens, values=values)
    if prepared is not None and (prepared.plan.n_q != q.shape[0] or prepared.plan.n_k != k.shape[0]):
        raise ValueError(
            f"prepared attention metadata is for {prepared.plan.n_q} queries x {prepared.plan.n_k} keys, "
            f"got {q.shape[0]} x {k.shape[0]}: prepare it for this call's queries and keys"
        )
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if decode is None:
        decode = not needs_grad and q.shape[0] <= 2 * (cu_seqlens.shape[0] - 1)
    if decode:
        from orthros_train.ops.triton_decode import decode_attention_op

        max_range = None if prepared is None else prepared.max_range
        return decode_attention_op(q, k, v, q_index, q_window, cu_seqlens, scale, max_range, prepared is None)
    if prepared is None:
        return torch.ops.orthros.attention(q, k, v, q_index, q_window, cu_seqlens, scale, deterministic,
                                           *_blocks_args(blocks))
    plan = prepared.plan
    n_band = -1 if plan.n_band is None else plan.n_band
    return torch.ops.orthros.attention_planned(
        q, k, v, q_index, q_window, cu_seqlens, scale, deterministic, plan.tensors(), n_band, *_blocks_args(blocks)
    )
