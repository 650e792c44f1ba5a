"""The SDPA-backed attention op equals the plain-torch reference on every phase layout."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config

from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import OrthrosForCausalLM, plan_for_layout
from orthros_train.ops.attention import resolve_backend
from orthros_train.ops.reference import UNBOUNDED, attention_reference
from orthros_train.ops.sdpa_attention import attention_sdpa, flash_covers, query_segments
from orthros_train.phase import pretrain_layout, sft_layout
from orthros_train.phase.builders import decode_layout, prefill_layout

H, HKV, D = 4, 2, 8


def _config(attention_type: str, window: int) -> OrthrosConfig:
    return tiny_config(64, num_attention_heads=H, num_key_value_heads=HKV, sliding_window=window,
                       attention_type=attention_type)  # fmt: skip


def _queries(attention_type: str, window: int, layout, cache: KVCache | None = None):
    plan = plan_for_layout(_config(attention_type, window), layout, cache)
    _, q_index, q_window = plan.queries(with_base=True)
    return q_index, q_window, plan.key_cu_seqlens


def _layouts():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 60, (2, 37), generator=g)
    ids[0, 9] = ids[0, 20] = ids[1, 30] = 0  # EOD: packed documents of 10, 11, 16 / 31, 6 tokens
    yield "pretrain-packed", pretrain_layout(ids, eod_token_id=0), None
    yield "sft", sft_layout(ids, [[(25, 37)], [(5, 9), (20, 30)]]), None
    yield "prefill", prefill_layout([ids[0], ids[1, :23]]), None
    # Decode and a continued chunk: keys are the cache buffer, one document of capacity per row.
    cache = KVCache(2, 2, capacity=48)
    cache.lengths = torch.tensor([30, 17])
    yield "decode", decode_layout(ids[:, 0], cache.lengths), cache
    yield "chunk", prefill_layout([ids[0, :13], ids[1, :5]], start_positions=cache.lengths), cache
    # A chunk that continues a document inside the first window: its head is lower-right causal.
    short = KVCache(2, 2, capacity=24)
    short.lengths = torch.tensor([3, 1])
    yield "early-chunk", prefill_layout([ids[0, :20], ids[1, :9]], start_positions=short.lengths), short


CASES = [(name, layout, cache, kind, w) for name, layout, cache in _layouts()
         for kind, w in (("orthros", 4), ("orthros", 6), ("dense", 4), ("sliding", 5))]  # fmt: skip


@pytest.mark.parametrize("name,layout,cache,kind,window", CASES, ids=[f"{c[0]}-{c[3]}-W{c[4]}" for c in CASES])
def test_sdpa_equals_reference_forward_and_backward(name, layout, cache, kind, window):
    q_index, q_window, cu = _queries(kind, window, layout, cache)
    n_k = int(cu[-1])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(q_index.numel(), H, D, generator=g, requires_grad=True)
    k = torch.randn(n_k, HKV, D, generator=g, requires_grad=True)
    v = torch.randn(n_k, HKV, D, generator=g, requires_grad=True)
    grad = torch.randn(q.shape, generator=g)
    results = []
    for block in (None, 3):  # 3: several query blocks per windowed segment, with padding
        extra = {} if block is None else {"block": block}
        out, lse = attention_sdpa(q, k, v, q_index, q_window, cu, need_lse=False, **extra)
        assert lse is None
        results.append((out, torch.autograd.grad(out, (q, k, v), grad)))
    ref = attention_reference(q, k, v, q_index, q_window, cu)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for out, grads in results:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)
    with torch.no_grad():  # inference writes the parts straight into one output buffer
        for block in (32, 3):
            out, _ = attention_sdpa(q, k, v, q_index, q_window, cu, need_lse=False, block=block)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_segments_and_flash_cover():
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    # base stream of both documents (window 4), then two output queries
    q_index = torch.cat([torch.arange(16), torch.tensor([9, 15])])
    q_window = torch.cat([torch.full((16,), 4), torch.full((2,), UNBOUNDED)])
    segs = query_segments(q_index, q_window, cu)
    assert [(s.q0, s.q1, s.first, s.doc_start, s.window) for s in segs] == [
        (0, 10, 0, 0, 4), (10, 16, 10, 10, 4), (16, 17, 9, 0, UNBOUNDED), (17, 18, 15, 10, UNBOUNDED),
    ]  # fmt: skip
    assert not flash_covers(q_index, q_window, cu)  # windowed segments need a band mask
    dense = torch.full((16,), UNBOUNDED)
    assert flash_covers(torch.arange(16), dense, cu)  # causal from each document start
    assert not flash_covers(torch.arange(3, 9), dense[:6], cu)  # continues a document: lower-right mask


def test_need_lse_falls_back_to_the_reference_and_auto_picks_sdpa_on_cpu():
    q, k, v = torch.randn(6, H, D), torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    args = (q, k, v, torch.arange(6), torch.full((6,), 3), torch.tensor([0, 6], dtype=torch.int32))
    out, lse = attention_sdpa(*args)
    ref_out, ref_lse = attention_reference(*args)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    fast = resolve_backend("auto", torch.device("cpu"), need_lse=False)
    torch.testing.assert_close(fast(*args)[0], ref_out, atol=2e-6, rtol=1e-5)
    assert resolve_backend("auto", torch.device("cpu"))(*args)[1] is not None  # callers merging by LSE


def test_empty_queries():
    k = torch.randn(5, HKV, D)
    out, _ = attention_sdpa(
        torch.randn(0, H, D), k, k, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
        torch.tensor([0, 5], dtype=torch.int32), need_lse=False,
    )  # fmt: skip
    assert out.shape == (0, H, D)


@pytest.mark.parametrize("kind", ["orthros", "dense", "sliding"])
def test_model_on_sdpa_equals_model_on_reference(kind):
    torch.manual_seed(0)
    ids = torch.randint(1, 60, (2, 21))
    ids[0, 7] = 0
    layout = pretrain_layout(ids, eod_token_id=0)
    losses, grads = [], []
    for backend in ("sdpa", "reference"):
        torch.manual_seed(0)
        cfg = OrthrosConfig(**{**_config(kind, 5).to_dict(), "attention_backend": backend})
        model = OrthrosForCausalLM(cfg)
        loss = model.forward_layout(layout).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_prepared_segments_and_the_gpu_auto_choice():
    """The model prepares the segments once per forward; GPU ``auto`` picks SDPA only where flash
    attention needs no mask (checked on CPU tensors: the Triton side runs in the interpreter)."""
    from orthros_train.ops import attention as op

    layout = pretrain_layout(torch.randint(1, 60, (1, 24)))
    for kind, expect in (("dense", "sdpa"), ("orthros", "triton")):
        q_index, q_window, cu = _queries(kind, 6, layout)
        n = q_index.numel()
        q, k, v = torch.randn(n, H, D), torch.randn(24, HKV, D), torch.randn(24, HKV, D)
        ref = attention_reference(q, k, v, q_index, q_window, cu)[0]
        prepared = op.prepare_attention(q_index, q_window, cu, 24, "sdpa")
        assert prepared is not None and prepared.payload == query_segments(q_index, q_window, cu)
        out = op.orthros_attention(q, k, v, q_index, q_window, cu, backend="sdpa", prepared=prepared)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        choice = op._choose_cuda(q_index, q_window, cu, 24)
        assert choice[0] == expect
        torch.testing.assert_close(op._auto_cuda_output(q, k, v, q_index, q_window, cu, prepared=choice)[0], ref,
                                   atol=2e-5, rtol=1e-4)  # fmt: skip
