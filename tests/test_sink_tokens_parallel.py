"""Sink tokens under context and tensor/sequence parallelism.

Most checks simulate every CP rank in one process (the K/V all-gathers replaced by the
concatenation the collective would produce, as tests/test_context_parallel.py does) against
``attention_naive``, the mask written from the definition. The 2-process gloo runs (real
collectives, the model's logits, loss and gradients) reuse tests/parallel_scripts with a
``sinks=S`` argument.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import assert_variants_close, result_of, tiny_config, torchrun

from orthros_train.model.orthros import plan_for_layout
from orthros_train.ops.reference import attention_naive
from orthros_train.parallel.context import context_plan
from orthros_train.phase import pretrain_layout, sft_layout


def _simulated_gather(plans, kvs: list[torch.Tensor], calls: list[str]):
    """``gather_for(rank)``: the all-gather of CP rank ``rank`` simulated in one process, from every
    rank's local K/V rows ``kvs`` (rank-major, as the collective returns them). It tells the three
    gathers a rank makes apart by what it sends (the whole chunk pair, its sink rows, or a halo)
    and records each in ``calls`` ("full", "sinks", "halo"), so tests can check which ran."""
    c = plans[0].chunk_len
    cp = len(plans)

    def sink_rows(r: int) -> torch.Tensor:  # what rank r sends to the gather of sink rows
        meta = plans[r]._sink_meta(kvs[r].device)
        mine = kvs[r][meta["local_rows"]]
        return torch.cat([mine, mine.new_zeros(meta["width"] - mine.shape[0], *mine.shape[1:])])

    def gather_for(rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:  # every rank's contribution, rank-major
            if x.shape[0] == 2 * c:
                calls.append("full")
                return torch.cat(kvs)
            meta = plans[rank]._meta.get("sinks")
            if meta is not None and x.shape[0] == meta["width"] and torch.equal(x, sink_rows(rank)):
                calls.append("sinks")
                return torch.cat([sink_rows(r) for r in range(cp)])
            calls.append("halo")
            tail = x.shape[0] // 2
            return torch.cat([torch.cat([y[c - tail : c], y[2 * c - tail :]]) for y in kvs])

        return gather

    return gather_for


def _simulated_cp_error(cfg, layout, cp: int, backend: str = "reference", heads=(4, 2), dim=8, grads=False):
    """Max |CP attention - naive attention with sinks| over every rank's queries (and q/k/v
    grads); also returns how many calls each rank made to its all-gather, by gathered row count."""
    g = torch.Generator().manual_seed(0)
    t = layout.num_tokens
    full = plan_for_layout(cfg, layout)
    assert full.sink_tokens == cfg.base_sink_tokens
    _, q_index, q_window = full.queries(True)
    q = torch.randn(q_index.numel(), heads[0], dim, generator=g, requires_grad=grads)
    k = torch.randn(t, heads[1], dim, generator=g, requires_grad=grads)
    v = torch.randn(t, heads[1], dim, generator=g, requires_grad=grads)
    ref, _ = attention_naive(q, k, v, q_index, q_window, full.key_cu_seqlens, sink_tokens=cfg.base_sink_tokens)
    upstream = torch.randn(ref.shape, generator=g)
    plans = [context_plan(cfg, layout, r, cp) for r in range(cp)]
    assert all(p.sink_tokens == cfg.base_sink_tokens for p in plans)
    c = plans[0].chunk_len
    pad = 2 * cp * c - t
    kp = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
    vp = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
    kvs = [torch.cat([kp[p.base_key_index], vp[p.base_key_index]], 1) for p in plans]
    calls: list[str] = []
    gather_for = _simulated_gather(plans, kvs, calls)

    worst, total = 0.0, 0.0
    for p in plans:
        real = p.base_key_index < t
        q_base = q.new_zeros(p.base_key_index.numel(), *q.shape[1:])
        q_base = q_base.index_copy(0, torch.nonzero(real).flatten(), q[p.base_key_index[real]])
        out_rows = t + p.output_select if cfg.attention_type == "orthros" else p.output_select[:0]
        p.gather = gather_for(p.rank)
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
    return worst, calls


def _config(attention_type: str, window: int, sinks: int):
    return tiny_config(64, num_hidden_layers=1, sliding_window=window, attention_type=attention_type, sink_tokens=sinks)


# 2 rows x 37 tokens, documents of 11, 20, 6 and 37 tokens: at CP=2 (chunks of 19) and CP=4
# (chunks of 10) the second and fourth documents start on one rank and run onto others.
IDS = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(5))
DOCS = torch.tensor([[0] * 11 + [1] * 20 + [2] * 6, [0] * 37])


@pytest.mark.parametrize("attention_type", ["orthros", "sliding"])
@pytest.mark.parametrize("window, sinks", [(2, 1), (4, 3), (5, 2), (9, 4), (24, 4)])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_attention_with_sinks_equals_the_definition(attention_type, window, sinks, cp):
    """Packed documents whose first keys live on other CP ranks; windows shorter and longer than
    a chunk; the orthros model takes its sink keys from the output stream's full gather, the
    sliding baseline (no output stream) from a gather of the sink rows alone."""
    layout = pretrain_layout(IDS, document_ids=DOCS)
    err, calls = _simulated_cp_error(_config(attention_type, window, sinks), layout, cp)
    assert err <= 2e-6
    if attention_type == "sliding":
        assert "sinks" in calls
        if window - 1 < -(-layout.num_tokens // (2 * cp)):  # a halo shorter than a chunk: never the sequence
            assert "full" not in calls
    else:
        assert "sinks" not in calls  # rows of the full gather the output stream made anyway


@pytest.mark.parametrize("attention_type", ["orthros", "sliding"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_sink_gradients(attention_type, cp):
    """q/k/v gradients through the sink partial and its merge, the sink keys' gradients summed back
    to the ranks that hold them (sft layout: output tokens only on answer spans)."""
    layout = sft_layout(IDS[:, :30], [[(4, 8), (20, 29)], [(25, 30)]])
    err, _ = _simulated_cp_error(_config(attention_type, 5, 2), layout, cp, grads=True)
    assert err <= 2e-6


def test_cp_sinks_without_long_documents_take_the_plain_path():
    """No document longer than W: no query lacks a sink key, so nothing extra is gathered."""
    layout = pretrain_layout(IDS[:, :8])
    err, calls = _simulated_cp_error(_config("sliding", 9, 4), layout, 2)
    assert err <= 2e-6 and "sinks" not in calls


def test_cp_sinks_triton_backend():
    """The sink partial through the Triton kernels (interpreted on CPU), gradients included."""
    pytest.importorskip("triton")
    layout = pretrain_layout(IDS[:1, :30], document_ids=torch.tensor([[0] * 9 + [1] * 21]))
    cfg = _config("orthros", 6, 2)
    err, _ = _simulated_cp_error(cfg, layout, 2, backend="triton", heads=(2, 1), dim=16, grads=True)
    assert err <= 1e-5


@pytest.mark.slow
def test_tp2_sp_with_sinks_equals_reference():
    """TP=2 without and with SP (orthros, the sliding baseline) with 2 sink tokens: logits, loss,
    gradients and the TP checkpoint round trip equal the single-device model (2 gloo ranks)."""
    assert_variants_close(result_of(torchrun("tp_equivalence", "sinks=2")), 3)


@pytest.mark.slow
def test_cp2_with_sinks_equals_reference():
    """CP=2 with 2 sink tokens: orthros (W shorter and longer than a chunk), the sliding baseline
    and a mixture-of-experts model; pretrain and sft layouts whose documents start on the other
    rank. Logits, loss and gradients equal the single-device model (2 gloo ranks)."""
    assert_variants_close(result_of(torchrun("cp_equivalence", "1", "none", "sinks=2")), 8)
