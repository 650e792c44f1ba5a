"""The backward's delta (rowsum(dO * O) - dLSE) from its Triton preprocess kernel, on the interpreter.

The kernel upcasts tiles in registers; the plain-torch reference beside it builds fp32 copies of
both tensors. They must agree, and the backward must never build an fp32 tensor of the output's
size for it.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orthros_train.ops import triton_attention as ta
from orthros_train.ops.reference import UNBOUNDED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_q,h_q,d", [(1, 1, 16), (70, 3, 24), (129, 2, 64)])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_delta_kernel_matches_reference(dtype, n_q, h_q, d, with_dlse):
    g = torch.Generator().manual_seed(n_q + d)
    out = torch.randn(n_q, h_q, d, generator=g).to(dtype)
    dout = torch.randn(n_q, h_q, d, generator=g).to(dtype)
    dlse = torch.randn(h_q, n_q, generator=g) if with_dlse else None
    got = ta.backward_delta(dout, out, dlse)
    want = ta.backward_delta_reference(dout, out, dlse)
    assert got.shape == (h_q, n_q) and got.dtype == torch.float32 and got.is_contiguous()
    # both sum exact products of the same 16-bit values in fp32; only the summation order differs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_delta_kernel_strided_inputs():
    """Head-major tensors (a transposed view) and a non-contiguous dlse give the same delta."""
    g = torch.Generator().manual_seed(1)
    out = torch.randn(3, 40, 32, generator=g).transpose(0, 1)  # [Nq, H, D] with stride(0) = 32
    dout = torch.randn(3, 40, 32, generator=g).transpose(0, 1)
    dlse = torch.randn(40, 3, generator=g).t()  # [H, Nq], not contiguous
    torch.testing.assert_close(ta.backward_delta(dout, out, dlse), ta.backward_delta_reference(dout, out, dlse))


def test_delta_kernel_no_queries():
    out = torch.empty(0, 2, 16)
    assert ta.backward_delta(out, out, None).shape == (2, 0)


class _Fp32Allocations(TorchDispatchMode):
    """Records the shapes of every fp32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.shapes.append((str(func), tuple(t.shape)))
        return res


def test_backward_builds_no_fp32_copy_of_the_output():
    t, h_q, h_kv, d = 48, 4, 2, 16
    q_index = torch.cat([torch.arange(t), torch.arange(t)])
    q_window = torch.cat([torch.full((t,), 8), torch.full((t,), UNBOUNDED)])
    cu = torch.tensor([0, 20, t], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2 * t, h_q, d, generator=g).bfloat16()
    k = torch.randn(t, h_kv, d, generator=g).bfloat16()
    v = torch.randn(t, h_kv, d, generator=g).bfloat16()
    blocks = (16, 16)
    out, lse = ta.attention_forward(q, k, v, q_index, q_window, cu, d**-0.5, blocks=blocks)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    dlse = torch.randn(lse.shape, generator=g)
    with _Fp32Allocations() as seen:
        ta.attention_backward(dout, dlse, q, k, v, out, lse, q_index, q_window, cu, d**-0.5, True, blocks=blocks)
    big = [(op, shape) for op, shape in seen.shapes if torch.Size(shape).numel() >= out.numel()]
    assert not big, f"fp32 tensors of the output's size in the backward: {big}"
