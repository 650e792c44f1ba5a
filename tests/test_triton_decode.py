"""Flash-decoding kernel against the reference op on ragged batches (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orthros_train.ops import triton_attention as ta
from orthros_train.ops.reference import UNBOUNDED, attention_reference
from orthros_train.ops.triton_decode import decode_attention

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


def _decode_batch(lengths, window, queries_per_row, new_tokens=1):
    """Every row: its cache + new tokens as one document; queries sit on the last token(s).

    Per row ``queries_per_row`` is 1 (output query only) or 2 (the base + output pair of a
    decode step); ``new_tokens`` > 1 puts the pair on each of the last tokens (speculative).
    """
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q_index, q_window = [], []
    for r, per_row in enumerate(queries_per_row):
        end = int(cu[r + 1])
        for pos in range(max(int(cu[r]), end - new_tokens), end):
            if per_row == 2:
                q_index.append(pos)
                q_window.append(window)
            q_index.append(pos)
            q_window.append(UNBOUNDED)
    return torch.tensor(q_index), torch.tensor(q_window), cu


def _tensors(n_q, n_k, h_q, h_kv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_q, h_q, d, generator=g).to(dtype),
        torch.randn(n_k, h_kv, d, generator=g).to(dtype),
        torch.randn(n_k, h_kv, d, generator=g).to(dtype),
    )


def _check(q_index, q_window, cu, h_q, h_kv, d, dtype=torch.float32, tol=FP32_TOL, **kw):
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), h_q, h_kv, d, dtype)
    out, lse = decode_attention(q, k, v, q_index, q_window, cu, **kw)
    ref_out, ref_lse = attention_reference(q, k, v, q_index, q_window, cu)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)
    torch.testing.assert_close(lse, ref_lse, **FP32_TOL)


_RAGGED = {
    "lengths": st.lists(st.integers(1, 200), min_size=1, max_size=4),
    "window": st.sampled_from([1, 4, 16, 1000]),
    "pairs": st.lists(st.sampled_from([1, 2]), min_size=4, max_size=4),
    "new_tokens": st.sampled_from([1, 1, 2]),
    "group": st.sampled_from([1, 2, 4, 8]),
    "d": st.sampled_from([16, 24, 32]),
    "split": st.sampled_from([None, 16, 32, 80]),
}


def _ragged(lengths, window, pairs, new_tokens, group, d, split):
    q_index, q_window, cu = _decode_batch(lengths, window, pairs[: len(lengths)], new_tokens)
    h_kv = 1 if group == 8 else 2
    _check(q_index, q_window, cu, h_kv * group, h_kv, d, split=split)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_RAGGED)
def test_ragged_decode_matches_reference(lengths, window, pairs, new_tokens, group, d, split):
    _ragged(lengths, window, pairs, new_tokens, group, d, split)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_RAGGED)
def test_ragged_decode_matches_reference_many(lengths, window, pairs, new_tokens, group, d, split):
    _ragged(lengths, window, pairs, new_tokens, group, d, split)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_cache(dtype, tol):
    q_index, q_window, cu = _decode_batch([700, 3, 250], 128, [2, 2, 1])
    _check(q_index, q_window, cu, 8, 2, 64, dtype=dtype, tol={"atol": tol, "rtol": tol}, split=256)


def test_long_cache_many_splits():
    q_index, q_window, cu = _decode_batch([2000, 1], 128, [2, 2])
    _check(q_index, q_window, cu, 4, 1, 32, split=128, max_range=2000)


def test_triton_backend_routes_decode_steps_to_the_decode_kernel(monkeypatch):
    """No grad + at most two queries per document: the backend takes the flash-decoding path."""
    import orthros_train.ops.triton_decode as td

    calls = []
    original = td.decode_attention
    monkeypatch.setattr(td, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    q_index, q_window, cu = _decode_batch([40, 90, 7], 16, [2, 2, 2])
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 4, 2, 16)
    with torch.no_grad():
        out, lse = ta.attention_triton(q, k, v, q_index, q_window, cu)
    assert calls == [1]
    ref_out, ref_lse = attention_reference(q, k, v, q_index, q_window, cu)
    torch.testing.assert_close(out, ref_out, **FP32_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP32_TOL)


def test_decode_custom_op_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(4, 8, 64), torch.empty(100, 2, 64)
        qi, qw = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long)
        out, lse = torch.ops.orthros.decode_attention(q, k, k, qi, qw, torch.tensor([0, 100]), 0.125)
        assert out.shape == (4, 8, 64) and lse.shape == (8, 4)
