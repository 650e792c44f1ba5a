"""Flash-decoding kernel: a few queries per sequence against a long KV cache.

A decode step has one base query (window ``W``) and one output query (unbounded) per sequence,
each against that sequence's whole cache, with different cache lengths across the batch. The
forward kernel (``triton_attention.py``) would give each query tile a single program that walks
the whole cache; here the keys of every query are split into chunks of ``split`` keys, one
program per (query, kv head, chunk) computes a partial softmax for all query heads of its GQA
group at once (the group is the M dimension of the dot, so each K/V byte is read once per
group), and a second kernel merges the partials with their log-sum-exps.

Same contract as ``reference.attention_reference`` (which is the ground truth for the tests):
any ``q_index``/``q_window``/``cu_seqlens``; it is just fast when queries are few and ranges
long. Forward only (inference). Chunks past a query's range exit at once, so a ragged batch
costs the sum of its ranges, not ``batch * max_len``.

Sink tokens are not this kernel's business: ``ops/attention.py`` runs a decode step with sinks as
this kernel over the windows plus a second call over the sink keys the base queries lack (each
row's first ``S`` cache slots, a grid sized by ``max_range = S`` with no device sync), merged by
their log-sum-exps (``reference.attention_with_sinks``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from orthros_train.ops.keys import key_ranges
from orthros_train.ops.reference import check_attention_inputs
from orthros_train.ops.triton_interpreter import interpreter_index_fix, interpreting

INTERPRET = interpreting()  # kernels run on CPU tensors in triton's interpreter (tests)
LOG2E = 1.4426950408889634

if INTERPRET:
    # triton 3.6's interpreter needs the loop-bound fix applied there (tensor bounds of range())
    interpreter_index_fix()  # idempotent: a second call finds the hook already wrapped


@triton.jit
def online_softmax_step(q, kt, v, c_ok, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One key block of a single-query attention split: scores (base 2), masked columns out, the
    running max / sum / output rescaled. Shared by the decode kernel and the serving layer's paged
    kernel, which differ only in how they find the keys."""
    sc = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    sc = tl.where(c_ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    p = tl.math.exp2(sc - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split_partial(
    OP, LP, row, s, heads, g_ok, d_ok, offs_d, m_i, l_i, acc, empty_lse,
    stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph,
):
    """Write split ``s`` of query row ``row``: its normalised output and its log-sum-exp (base 2)
    for the combine kernel. A split that saw no key writes a zero output and ``empty_lse``
    (-inf gives it no weight in the combine). Shared by the decode kernel and the serving layer's
    paged kernel, like ``online_softmax_step``."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    part_lse = tl.where(empty, empty_lse, m_i + tl.math.log2(l_safe))
    op_ptrs = OP + row * stride_opm + heads[:, None] * stride_oph + s * stride_ops + offs_d[None, :]
    tl.store(op_ptrs, acc / l_safe[:, None], mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LP + row * stride_lpm + heads * stride_lph + s, part_lse, mask=g_ok)


@triton.jit
def _decode_split_kernel(
    Q, K, V, OP, LP, QSTART, QEND,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph,
    split, qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(QSTART + i)
    end = tl.load(QEND + i)
    lo = start + s * split
    hi = tl.minimum(end + 1, lo + split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_mask = offs_d < D
    heads = hk * GROUP + offs_g
    q_ptrs = Q + i * stride_qm + heads[:, None] * stride_qh + offs_d[None, :]
    if EVEN_D:
        q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=g_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        c_ok = cols < hi
        cols64 = cols.to(tl.int64)
        kt_ptrs = k_base + cols64[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = v_base + cols64[:, None] * stride_vn + offs_d[None, :]
        if EVEN_D:
            kt = tl.load(kt_ptrs, mask=c_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=c_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=c_ok[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=c_ok[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = online_softmax_step(q, kt, v, c_ok, m_i, l_i, acc, qk_scale, PRECISION)

    store_split_partial(OP, LP, i, s, heads, g_ok, d_mask, offs_d, m_i, l_i, acc, float("-inf"),
                        stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph)


@triton.jit
def _decode_combine_kernel(
    OP, LP, Out, LSE, n_q, n_splits,
    stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph, stride_om, stride_oh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    # pass 1: max partial lse (tensor accumulators: loop-carried types stay fixed)
    m_vec = tl.full([BLOCK_S], -1.0e30, tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lp = tl.load(LP + i * stride_lpm + h * stride_lph + offs_s, mask=offs_s < n_splits, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lp)
    m = tl.max(m_vec, 0)
    # pass 2: weighted sum
    l_vec = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < n_splits
        lp = tl.load(LP + i * stride_lpm + h * stride_lph + offs_s, mask=s_ok, other=float("-inf"))
        w = tl.math.exp2(lp - m)
        op = tl.load(
            OP + i * stride_opm + h * stride_oph + offs_s[:, None] * stride_ops + offs_d[None, :],
            mask=s_ok[:, None] & d_mask[None, :],
            other=0.0,
        )
        l_vec += w
        acc += tl.sum(w[:, None] * op, 0)
    l_sum = tl.sum(l_vec, 0)
    tl.store(Out + i * stride_om + h * stride_oh + offs_d, (acc / l_sum).to(Out.dtype.element_ty), mask=d_mask)
    tl.store(LSE + h * n_q + i, (m + tl.math.log2(l_sum)) * 0.6931471805599453)


# Fixed launch configs (no autotuning: a decode step is too short to amortise it); 0 spills at
# head_dim 64/128 in the sm_90 compile report (bench/attention.py --compile-sm90).
SPLIT_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
COMBINE_BLOCK_S = 64
COMBINE_WARPS = 4


def kernel_specs(head_dim: int, group: int, dtype: torch.dtype) -> list[dict]:
    """The two decode kernels at their launch configs, for ahead-of-time compile reports."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = {"GROUP": group, "D": head_dim, "BLOCK_G": max(16, triton.next_power_of_2(group)), "BLOCK_D": block_d,
             "BLOCK_N": SPLIT_LAUNCH["BLOCK_N"], "EVEN_D": block_d == head_dim, "UPCAST": False, "PRECISION": "tf32"}
    combine = {"D": head_dim, "BLOCK_S": COMBINE_BLOCK_S, "BLOCK_D": block_d}
    return [
        {"kernel": "decode_split", "fn": _decode_split_kernel, "consts": split, "autotune": False, "fixed": True,
         "config": {"BLOCK_M": split["BLOCK_G"], "BLOCK_N": SPLIT_LAUNCH["BLOCK_N"],
                    "num_warps": SPLIT_LAUNCH["num_warps"], "num_stages": SPLIT_LAUNCH["num_stages"]}},
        {"kernel": "decode_combine", "fn": _decode_combine_kernel, "consts": combine, "autotune": False,
         "fixed": True, "config": {"BLOCK_M": COMBINE_BLOCK_S, "BLOCK_N": block_d, "num_warps": COMBINE_WARPS,
                                   "num_stages": 3}},
    ]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    split: int | None = None,
    max_range: int | None = None,
    block_n: int | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-decoding forward: ``(out [Nq, Hq, D], lse [Hq, Nq] fp32)``.

    ``split`` keys per program (default: enough chunks to fill the GPU twice over);
    ``max_range`` is the longest key range of any query (computed with one device sync when not
    given; the model passes it from its cache lengths, known on the host). ``check_values=False``
    skips the value checks of the inputs (device syncs; the model validated its layout once).
    """
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the triton decode kernel needs CUDA tensors or TRITON_INTERPRET=1")
    check_attention_inputs(q, k, v, q_index, q_window, cu_seqlens, values=check_values)
    n_q, h_q, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    lse = torch.empty((h_q, n_q), dtype=torch.float32, device=q.device)
    if n_q == 0:
        return out, lse
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    start, end = key_ranges(q_index, q_window, cu_seqlens.to(q.device))
    if max_range is None:
        max_range = int((end - start).max()) + 1
    block_n = block_n or (16 if INTERPRET else SPLIT_LAUNCH["BLOCK_N"])
    if split is None:
        want = max(1, 2 * _num_sms(q.device) // max(1, n_q * h_kv))
        split = triton.cdiv(max_range, want)
    split = max(block_n, triton.cdiv(split, block_n) * block_n)
    n_splits = triton.cdiv(max_range, split)
    block_d = max(16, triton.next_power_of_2(d))
    part_o = torch.empty((n_q, h_q, n_splits, d), dtype=torch.float32, device=q.device)
    part_l = torch.empty((n_q, h_q, n_splits), dtype=torch.float32, device=q.device)
    precision = "tf32"  # fp32 inputs: TF32 dots on tensor cores, as in the training kernels
    _decode_split_kernel[(n_q, h_kv, n_splits)](
        q, k, v, part_o, part_l, start.to(torch.int32), end.to(torch.int32),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        split, scale * LOG2E,
        GROUP=group, D=d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, EVEN_D=block_d == d, UPCAST=INTERPRET, PRECISION=precision,
        num_warps=SPLIT_LAUNCH["num_warps"], num_stages=1 if INTERPRET else SPLIT_LAUNCH["num_stages"],
    )
    _decode_combine_kernel[(n_q, h_q)](
        part_o, part_l, out, lse, n_q, n_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        out.stride(0), out.stride(1),
        D=d, BLOCK_S=min(COMBINE_BLOCK_S, triton.next_power_of_2(n_splits)), BLOCK_D=block_d,
        num_warps=COMBINE_WARPS,
    )
    return out, lse


@torch.library.custom_op("orthros::decode_attention", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_index: torch.Tensor,
    q_window: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_range: int = -1,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = decode_attention(q, k, v, q_index, q_window, cu_seqlens, scale,
                                max_range=None if max_range < 0 else max_range, check_values=check_values)
    return out, lse


@_decode_op.register_fake
def _decode_fake(q, k, v, q_index, q_window, cu_seqlens, scale, max_range=-1, check_values=True):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def decode_attention_op(q, k, v, q_index, q_window, cu_seqlens, scale: float, max_range: int | None = None,
                        check_values: bool = True):
    """``torch.ops.orthros.decode_attention`` (opaque to torch.compile; forward only)."""
    return torch.ops.orthros.decode_attention(q, k, v, q_index, q_window, cu_seqlens, float(scale),
                                              -1 if max_range is None else int(max_range), bool(check_values))
