"""Context-parallel attention math in one process: every CP rank simulated, K/V all-gathers
replaced by the concatenation the collective would produce. The 2-process runs (real gloo
collectives, gradients, TP/SP, the trainer) are in tests/test_parallel.py."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config

from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import plan_for_layout
from orthros_train.ops.reference import attention_reference
from orthros_train.parallel.context import (
    clip_cu_seqlens,
    context_plan,
    merge_partial_attention,
    output_select,
)
from orthros_train.phase import pretrain_layout, sft_layout


def _config(attention_type: str, window: int) -> OrthrosConfig:
    return tiny_config(64, num_hidden_layers=1, sliding_window=window, attention_type=attention_type)


def _simulated_cp_error(cfg, layout, cp: int, backend: str = "reference", heads=(4, 2), dim=8, grads=False):
    """Max |CP attention - full attention| over every rank's queries (and q/k/v grads)."""
    g = torch.Generator().manual_seed(0)
    t = layout.num_tokens
    full = plan_for_layout(cfg, layout)
    _, q_index, q_window = full.queries(True)
    q = torch.randn(q_index.numel(), heads[0], dim, generator=g, requires_grad=grads)
    k = torch.randn(t, heads[1], dim, generator=g, requires_grad=grads)
    v = torch.randn(t, heads[1], dim, generator=g, requires_grad=grads)
    ref, _ = attention_reference(q, k, v, q_index, q_window, full.key_cu_seqlens, sink_tokens=full.sink_tokens)
    upstream = torch.randn(ref.shape, generator=g)
    plans = [context_plan(cfg, layout, r, cp) for r in range(cp)]
    c = plans[0].chunk_len
    pad = 2 * cp * c - t
    kp = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
    vp = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
    kvs = [torch.cat([kp[p.base_key_index], vp[p.base_key_index]], 1) for p in plans]

    def gather(x: torch.Tensor) -> torch.Tensor:  # what every rank would contribute
        if x.shape[0] == 2 * c:
            return torch.cat(kvs)
        tail = x.shape[0] // 2
        return torch.cat([torch.cat([y[c - tail : c], y[2 * c - tail :]]) for y in kvs])

    worst = 0.0
    total = 0.0
    for p in plans:
        real = p.base_key_index < t
        q_base = q.new_zeros(p.base_key_index.numel(), *q.shape[1:])
        q_base = q_base.index_copy(0, torch.nonzero(real).flatten(), q[p.base_key_index[real]])
        out_rows = t + p.output_select if cfg.attention_type == "orthros" else p.output_select[:0]
        p.gather = gather
        o = p.attend(torch.cat([q_base, q[out_rows]]), kp[p.base_key_index], vp[p.base_key_index], True, backend)
        n = p.base_key_index.numel()
        worst = max(worst, float((o[:n][real] - ref[p.base_key_index[real]]).detach().abs().max()))
        if out_rows.numel():
            worst = max(worst, float((o[n:] - ref[out_rows]).detach().abs().max()))
        if grads:
            total = total + (o[:n][real] * upstream[p.base_key_index[real]]).sum() + (o[n:] * upstream[out_rows]).sum()
    if grads:
        got = torch.autograd.grad(total, (q, k, v))
        want = torch.autograd.grad((ref * upstream).sum(), (q, k, v))
        worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(got, want)])
    return worst


@pytest.mark.parametrize("attention_type", ["orthros", "dense", "sliding"])
@pytest.mark.parametrize("window", [1, 4, 9, 40])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_equals_full_attention_pretrain(attention_type, window, cp):
    """Packed documents crossing chunk edges; windows from 1 to longer than several chunks;
    37-token rows, so the padded tail is exercised."""
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(cp))
    docs = torch.tensor([[0] * 11 + [1] * 20 + [2] * 6, [0] * 37])
    layout = pretrain_layout(ids, document_ids=docs)
    assert _simulated_cp_error(_config(attention_type, window), layout, cp) <= 2e-6


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_gradients_sft(cp):
    """q/k/v gradients through halo, local and past partials and the LSE merge (sft layout:
    output tokens only on answer spans, some ranks without any)."""
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(0))
    layout = sft_layout(ids, [[(4, 8), (20, 29)], [(25, 30)]])
    assert _simulated_cp_error(_config("orthros", 6), layout, cp, grads=True) <= 2e-6


def test_cp_attention_triton_backend_matches():
    """The same CP attention through the Triton kernels (interpreted on CPU), with gradients:
    the LSE merge needs the kernel's LSE gradient path."""
    pytest.importorskip("triton")
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    layout = pretrain_layout(ids, document_ids=torch.tensor([[0] * 13 + [1] * 27]))
    err = _simulated_cp_error(_config("orthros", 6), layout, 2, backend="triton", heads=(2, 1), dim=16, grads=True)
    assert err <= 1e-5


def test_merge_of_partials_is_exact_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for n in (5, 12, 12))
    scale = 8**-0.5
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    full = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    parts = []
    for keys in (slice(0, 7), slice(7, 12)):
        s = scores[..., keys]
        parts += [torch.einsum("hqk,khd->qhd", s.softmax(-1), v[keys]), torch.logsumexp(s, -1)]
    assert torch.allclose(merge_partial_attention(*parts)[0], full, atol=1e-12)


def test_layout_split_is_a_balanced_partition():
    """Every token and every output token lands on exactly one rank; output work is balanced."""
    cfg = _config("orthros", 8)
    t, cp = 64, 4
    layout = pretrain_layout(torch.zeros(1, t, dtype=torch.long))
    plans = [context_plan(cfg, layout, r, cp) for r in range(cp)]
    tokens = torch.cat([p.base_key_index for p in plans])
    assert sorted(tokens.tolist()) == list(range(t))
    outputs = torch.cat([output_select(layout, r, cp) for r in range(cp)])
    assert sorted(outputs.tolist()) == list(range(layout.num_outputs))
    # Causal output-stream work ~ sum of positions: equal on every rank with the 2-chunk order.
    work = [int(p.out_key_index.sum()) for p in plans]
    assert max(work) == min(work), work
    assert [p.chunks for p in plans] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_clip_cu_seqlens():
    cu = torch.tensor([0, 5, 9, 20])
    assert clip_cu_seqlens(cu, 3, 12).tolist() == [0, 2, 6, 9]
    assert clip_cu_seqlens(cu, 5, 9).tolist() == [0, 4]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("sinks", [0, 2])
def test_cp_attention_with_the_global_tail(cp, sinks):
    """Global base queries (``model.base_global_tail``) under CP: an SFT layout's answer tails
    (derived on the device) and a prefill layout's prompt tails (explicit flags), with gradients
    through the past partials they add."""
    from orthros_train.phase.builders import prefill_layout

    cfg = tiny_config(64, num_hidden_layers=1, sliding_window=5, sink_tokens=sinks, base_global_tail=4)
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(cp))
    sft = sft_layout(ids, [[(12, 16), (24, 29)], [(25, 30)]])
    assert _simulated_cp_error(cfg, sft, cp, grads=True) <= 2e-6
    prefill = prefill_layout([ids[0], ids[1, :17]], global_tail=4)
    assert prefill.num_global == 8
    assert _simulated_cp_error(cfg, prefill, cp, grads=True) <= 2e-6
