"""The reference op against a dense-mask implementation written from the definition."""

from __future__ import annotations

import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from orthros_train.ops.reference import UNBOUNDED, attention_naive, attention_reference, key_ranges


@st.composite
def layouts(draw):
    doc_lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    n_k = sum(doc_lengths)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(doc_lengths), 0)), dtype=torch.int32)
    window = draw(st.sampled_from([1, 2, 5, 16, 1000]))
    group = draw(st.sampled_from([1, 2, 4]))
    h_kv = draw(st.integers(1, 2))
    d = draw(st.sampled_from([4, 8]))
    # Base queries on every token plus output queries on a random sorted subset (sft-like).
    out_mask = draw(st.lists(st.booleans(), min_size=n_k, max_size=n_k))
    out_idx = torch.tensor([i for i, m in enumerate(out_mask) if m], dtype=torch.long)
    q_index = torch.cat([torch.arange(n_k), out_idx])
    q_window = torch.cat([torch.full((n_k,), window), torch.full((len(out_idx),), UNBOUNDED)])
    chunk = draw(st.sampled_from([3, 16, 256]))
    seed = draw(st.integers(0, 10_000))
    return n_k, cu, q_index, q_window, h_kv * group, h_kv, d, chunk, seed


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_reference_matches_naive(case):
    n_k, cu, q_index, q_window, h_q, h_kv, d, chunk, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(q_index), h_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(n_k, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(n_k, h_kv, d, generator=g, dtype=torch.float64)
    q.requires_grad_(True)
    out, lse = attention_reference(q, k, v, q_index, q_window, cu, chunk_size=chunk)
    ref_out, ref_lse = attention_naive(q, k, v, q_index, q_window, cu)
    assert torch.allclose(out.double(), ref_out.double(), atol=1e-5)
    assert torch.allclose(lse, ref_lse.float(), atol=1e-5)
    (g1,) = torch.autograd.grad(out.sum(), q)
    (g2,) = torch.autograd.grad(ref_out.sum(), q)
    assert torch.allclose(g1.double(), g2.double(), atol=1e-5)


def test_key_ranges_respect_documents_and_window():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q_index = torch.tensor([0, 4, 5, 11, 11])
    q_window = torch.tensor([3, 3, 3, 3, UNBOUNDED])
    start, end = key_ranges(q_index, q_window, cu)
    assert start.tolist() == [0, 2, 5, 9, 5]
    assert end.tolist() == [0, 4, 5, 11, 11]


@contextlib.contextmanager
def recorded_key_spans():
    """Yields the list of key counts each chunk of the reference op scores (its einsum's key extent)."""
    spans: list[int] = []
    orig_einsum = torch.einsum

    def spy(eq, *ops):
        if eq == "chgd,shd->hgcs":
            spans.append(ops[1].shape[0])
        return orig_einsum(eq, *ops)

    torch.einsum = spy
    try:
        yield spans
    finally:
        torch.einsum = orig_einsum


def test_base_stream_memory_is_linear_at_4k():
    """T = 4096 with W = 128: every chunk spans at most chunk + W keys (no T x T scores)."""
    t, w, chunk = 4096, 128, 256
    with recorded_key_spans() as spans:
        q = torch.randn(t, 2, 16)
        k = torch.randn(t, 1, 16)
        out, _ = attention_reference(
            q, k, k, torch.arange(t), torch.full((t,), w), torch.tensor([0, t], dtype=torch.int32), chunk_size=chunk
        )
    assert max(spans) <= chunk + w
    assert out.shape == q.shape


def test_decode_step_scores_window_plus_document_not_twice_the_cache():
    """A base query and an output query of one decode step go to separate chunks."""
    t, w = 1000, 16
    with recorded_key_spans() as spans:
        k = torch.randn(t, 1, 8)
        q = torch.randn(2, 1, 8)
        attention_reference(
            q, k, k, torch.tensor([t - 1, t - 1]), torch.tensor([w, UNBOUNDED]), torch.tensor([0, t], dtype=torch.int32)
        )
    assert sorted(spans) == [w, t]
