"""Triton kernels of the fused token-wise ops, each with its autograd; the plain-torch statement of
each is in ``ops/fused_tokenwise_reference.py`` and ``tests/test_fused_tokenwise.py`` compares the
two (on CPU under ``TRITON_INTERPRET=1``).

Why our own kernels and not Liger-Kernel's (``liger-kernel`` 0.8.5, which has RMSNorm, fused
add+RMSNorm, RoPE and SwiGLU in Triton): its RMSNorm, add+RMSNorm and SiLU-mul kernels fail in
triton 3.9's interpreter (a float kernel argument is called ``.to()``), so they could not be
checked on CPU, which every kernel of this project is; its RoPE rotates q and k of one sequence
length by one cos/sin, while an Orthros layer rotates ``T + N`` queries (base and output stream)
and ``T`` keys at different positions. The kernels below are the row-wise textbook ones:

* ``add_rms_norm``: the residual add and the following RMSNorm in one pass over the rows (fp32
  statistics, the normed value cast to the stream's dtype before the weight, as eager); the
  backward returns the input gradient and per-program partial weight gradients summed by torch;
* ``rope_qk``: queries and keys rotated by one launch, one program per row of either, each row
  with its own cos/sin (computed once per forward by ``AttentionPlan.rotary_angles``); the
  backward is the same kernel rotating the other way;
* ``silu_mul``: SwiGLU's activation read from the merged gate/up GEMM's one buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orthros_train.ops.triton_interpreter import interpreter_index_fix, interpreting

if interpreting():
    interpreter_index_fix()


def _rows_per_program(block_cols: int) -> int:
    # a few rows per program for narrow rows (fewer, fuller programs), one row for wide ones
    return max(1, min(16, 4096 // block_cols))


# -- residual add + RMSNorm --------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_fwd(
    X, R, W, Y, S, RSTD, n_rows, n_cols, stride_x, stride_r, eps,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # the sum is held in the stream's dtype, as eager's ``x + residual``
        s = (x.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(S + rows64[:, None] * n_cols + cols[None, :], s, mask=mask)
    else:
        s = x
    s32 = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s32 * s32, axis=1) / n_cols + eps)
    normed = (s32 * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + rows64[:, None] * n_cols + cols[None, :], (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd(
    DY, DS, S, W, RSTD, DX, DW_PART, n_rows, n_cols, stride_s,
    HAS_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    flat = rows64[:, None] * n_cols + cols[None, :]
    dy = tl.load(DY + flat, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + rows64[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    nhat = s * rstd[:, None]
    dn = dy * w[None, :]
    ds = rstd[:, None] * (dn - nhat * (tl.sum(dn * nhat, axis=1) / n_cols)[:, None])
    if HAS_DS:  # the gradient of the residual stream itself (the sum feeds the next sub-layer too)
        ds += tl.load(DS + flat, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + flat, ds.to(DX.dtype.element_ty), mask=mask)
    # the weight multiplies the normed value cast to the stream's dtype (eager's order)
    dw = tl.sum(dy * nhat.to(DX.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=col_ok)


def _norm_launch(n_cols: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(n_cols)
    return _rows_per_program(block_n), block_n


class AddRMSNorm(torch.autograd.Function):
    """``(rms_norm(x + residual), x + residual)``, or ``rms_norm(x)`` alone with ``residual=None``."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):  # noqa: ANN001, ANN205 - autograd's signature
        n_cols = x.shape[-1]
        x2 = x.reshape(-1, n_cols)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        r2 = None
        if residual is not None:
            r2 = residual.reshape(-1, n_cols)
            if r2.stride(-1) != 1:
                r2 = r2.contiguous()
        n_rows = x2.shape[0]
        y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        s = torch.empty_like(y) if residual is not None else x2
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_m, block_n = _norm_launch(n_cols)
        if n_rows:
            _add_rms_norm_fwd[(triton.cdiv(n_rows, block_m),)](
                x2, r2 if r2 is not None else x2, weight, y, s, rstd, n_rows, n_cols, x2.stride(0),
                r2.stride(0) if r2 is not None else 0, eps, HAS_RES=residual is not None, BLOCK_M=block_m,
                BLOCK_N=block_n,
            )
        ctx.save_for_backward(s, weight, rstd)
        ctx.has_residual = residual is not None
        ctx.shape = x.shape
        if residual is None:
            return y.view(x.shape)
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds=None):  # noqa: ANN001, ANN205
        s, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = rstd.numel(), weight.numel()
        dy = dy.reshape(n_rows, n_cols).contiguous()
        if ds is not None:
            ds = ds.reshape(n_rows, n_cols).contiguous()
        dx = torch.empty((n_rows, n_cols), dtype=s.dtype, device=s.device)
        block_m, block_n = _norm_launch(n_cols)
        programs = triton.cdiv(n_rows, block_m)
        dw_part = torch.zeros((max(programs, 1), n_cols), dtype=torch.float32, device=s.device)
        if n_rows:
            _rms_norm_bwd[(programs,)](
                dy, ds if ds is not None else dy, s, weight, rstd, dx, dw_part, n_rows, n_cols, s.stride(0),
                HAS_DS=ds is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            )
        dw = dw_part.sum(0).to(weight.dtype)
        dx = dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dw, None


# -- RoPE of the queries and the keys in one launch ------------------------------------------------


@triton.jit
def _rope_qk(
    Q, K, QO, KO, CQ, SQ, CK, SK, n_q, heads_q, heads_k, stride_q, stride_k, head_dim,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_q:  # a query row
        row = pid.to(tl.int64)
        src = Q + row * stride_q
        dst = QO + row * heads_q * head_dim
        cos = CQ + row * head_dim
        sin = SQ + row * head_dim
        heads = heads_q
    else:  # a key row
        row = (pid - n_q).to(tl.int64)
        src = K + row * stride_k
        dst = KO + row * heads_k * head_dim
        cos = CK + row * head_dim
        sin = SK + row * head_dim
        heads = heads_k
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    at = h[:, None] * head_dim + d[None, :]
    x1 = tl.load(src + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + at + HALF, mask=mask, other=0.0).to(tl.float32)
    # cos/sin are fp32; eager multiplies by them cast to the stream's dtype
    c1 = tl.load(cos + d, mask=d < HALF, other=0.0).to(QO.dtype.element_ty).to(tl.float32)[None, :]
    c2 = tl.load(cos + HALF + d, mask=d < HALF, other=0.0).to(QO.dtype.element_ty).to(tl.float32)[None, :]
    s1 = tl.load(sin + d, mask=d < HALF, other=0.0).to(QO.dtype.element_ty).to(tl.float32)[None, :]
    s2 = tl.load(sin + HALF + d, mask=d < HALF, other=0.0).to(QO.dtype.element_ty).to(tl.float32)[None, :]
    if BACKWARD:  # the transpose of the rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(dst + at, y1.to(QO.dtype.element_ty), mask=mask)
    tl.store(dst + at + HALF, y2.to(QO.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``[rows, heads, head_dim]`` with heads and dims packed (a row stride of its own is fine:
    the q/k slices of a merged projection are read in place)."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        t = t.contiguous()
    return t


def _rope_launch(q, k, cq, sq, ck, sk, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    q, k = _rows_view(q), _rows_view(k)
    n_q, heads_q, head_dim = q.shape
    n_k, heads_k, _ = k.shape
    qo = torch.empty((n_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((n_k, heads_k, head_dim), dtype=k.dtype, device=k.device)
    if n_q + n_k:
        half = head_dim // 2
        _rope_qk[(n_q + n_k,)](
            q, k, qo, ko, cq, sq, ck, sk, n_q, heads_q, heads_k, q.stride(0), k.stride(0), head_dim,
            HALF=half, BLOCK_H=triton.next_power_of_2(max(heads_q, heads_k)), BLOCK_D=triton.next_power_of_2(half),
            BACKWARD=backward,
        )
    return qo, ko


class RopeQK(torch.autograd.Function):
    """Rotate-half RoPE of ``q [Nq, Hq, D]`` and ``k [Nk, Hk, D]`` by their own rows' fp32 cos/sin
    (``[N, 1, D]`` or ``[N, D]``), in one launch."""

    @staticmethod
    def forward(ctx, q, k, cq, sq, ck, sk):  # noqa: ANN001, ANN205
        if q.dtype != k.dtype:
            raise ValueError(f"rope_qk: queries are {q.dtype} but keys {k.dtype}; rotate tensors of one dtype")
        angles = [a.reshape(a.shape[0], -1).float().contiguous() for a in (cq, sq, ck, sk)]
        ctx.save_for_backward(*angles)
        return _rope_launch(q, k, *angles, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):  # noqa: ANN001, ANN205
        cq, sq, ck, sk = ctx.saved_tensors  # autograd materialises a missing gradient as zeros
        dq, dk = _rope_launch(dq, dk, cq, sq, ck, sk, backward=True)
        return dq, dk, None, None, None, None


# -- SwiGLU's activation on the merged gate/up buffer ----------------------------------------------


@triton.jit
def _silu_mul_fwd(GU, OUT, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(GU + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(OUT.dtype.element_ty).to(tl.float32)  # eager rounds silu(gate) first
    tl.store(OUT + row * inter + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(DY, GU, DGU, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dy = tl.load(DY + row * inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = (g * sig).to(DGU.dtype.element_ty).to(tl.float32)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DGU + row * 2 * inter + cols, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * 2 * inter + inter + cols, (dy * act).to(DGU.dtype.element_ty), mask=mask)


def _silu_block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` of a merged ``[rows, 2 * inter]`` buffer (gate first)."""

    @staticmethod
    def forward(ctx, gate_up):  # noqa: ANN001, ANN205
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        rows = gate_up.numel() // (2 * inter) if inter else 0
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
        block = _silu_block(inter)
        if rows and inter:
            _silu_mul_fwd[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (gate_up,) = ctx.saved_tensors
        dy = dy.contiguous()
        inter = gate_up.shape[-1] // 2
        rows = gate_up.numel() // (2 * inter) if inter else 0
        dgu = torch.empty_like(gate_up)
        block = _silu_block(inter)
        if rows and inter:
            _silu_mul_bwd[(rows, triton.cdiv(inter, block))](dy, gate_up, dgu, inter, BLOCK=block)
        return dgu


__all__ = ["AddRMSNorm", "RopeQK", "SiluMul"]
