"""Sink tokens (``sink_tokens = S``): every backend against ``attention_naive`` (the mask written
from the definition), ``S = 0`` bitwise the plain op, the model's limits (``W >= T``: dense; inside
the window: ``S = 0``), prefill + decode against the full forward, and the config's checks."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model

from orthros_train.errors import UserError
from orthros_train.infer import prefill
from orthros_train.infer.generate import decode
from orthros_train.model import KVCache, OrthrosConfig
from orthros_train.model.orthros import plan_for_layout
from orthros_train.ops import attention as op
from orthros_train.ops import reference
from orthros_train.ops import sdpa_attention as sa
from orthros_train.ops.attention import attention_with_lse, orthros_attention, prepare_attention
from orthros_train.ops.reference import UNBOUNDED, attention_naive
from orthros_train.phase import pretrain_layout, sft_layout
from orthros_train.phase.builders import decode_layout, prefill_layout

H, HKV, D = 4, 2, 8
W = 6
# Documents shorter than S = 4, between S and W, and longer than W (several windows past the sinks).
LENGTHS = [2, 5, 23, 9]
FWD_TOL = {"atol": 2e-6, "rtol": 1e-5}
GRAD_TOL = {"atol": 5e-6, "rtol": 1e-5}


def _packed(lengths=LENGTHS, window=W, outputs="all"):
    """Base queries of every token (window ``window``) then output queries (unbounded): at every
    position (``all``) or a sparse, unsorted few (``sparse``, as SFT/RL place them)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    out_index = torch.arange(n) if outputs == "all" else torch.tensor([n - 1, 3, 20, 8, 7])
    q_index = torch.cat([torch.arange(n), out_index])
    q_window = torch.cat([torch.full((n,), window), torch.full((out_index.numel(),), UNBOUNDED)])
    return q_index, q_window, cu


def _tensors(n_q, n_k, seed=0, requires_grad=True, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, H, d, generator=g)
    k = torch.randn(n_k, HKV, d, generator=g)
    v = torch.randn(n_k, HKV, d, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _check_against_naive(run, q_index, q_window, cu, sink_tokens, seed=0, d=D):
    """``run(q, k, v)`` -> out, forward and gradients against the naive op with ``sink_tokens``."""
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), seed, d=d)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1))
    ref, _ = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sink_tokens)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = run(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    torch.testing.assert_close(out, ref, **FWD_TOL)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, name=name: f"d{name}: {m}")
    return q, k, v


def test_naive_mask_is_the_definition():
    """The ground truth itself, on a hand-made case: W = 3, S = 2, one document of 8 tokens."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q = torch.zeros(8, 1, 4)  # equal scores: every visible key gets the same weight
    v = torch.arange(8.0)[:, None, None].expand(8, 1, 4).contiguous()
    out, _ = attention_naive(q, v, v, torch.arange(8), torch.full((8,), 3), cu, sink_tokens=2)
    seen = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 3, 4, 5], [0, 1, 4, 5, 6], [0, 1, 5, 6, 7]]
    expected = torch.tensor([sum(s) / len(s) for s in seen])
    torch.testing.assert_close(out[:, 0, 0], expected)


@pytest.mark.parametrize("sink_tokens", [1, 4])
@pytest.mark.parametrize("outputs", ["all", "sparse"])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_torch_backends_equal_naive(backend, outputs, sink_tokens):
    q_index, q_window, cu = _packed(outputs=outputs)
    n_k = int(cu[-1])
    for prepared in (None, prepare_attention(q_index, q_window, cu, n_k, backend, sink_tokens=sink_tokens)):

        def run(q, k, v, prepared=prepared):
            return orthros_attention(q, k, v, q_index, q_window, cu, backend=backend, prepared=prepared,
                                     sink_tokens=sink_tokens)  # fmt: skip

        _check_against_naive(run, q_index, q_window, cu, sink_tokens)
    # the log-sum-exp variant (context parallelism merges by it)
    q, k, v = _tensors(q_index.numel(), n_k, requires_grad=False)
    out, lse = attention_with_lse(q, k, v, q_index, q_window, cu, backend=backend, sink_tokens=sink_tokens)
    ref, ref_lse = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sink_tokens)
    torch.testing.assert_close(out, ref, **FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **FWD_TOL)


@pytest.mark.parametrize("flash_lse", [True, False], ids=["flash-lse-merge", "copied-sinks"])
@pytest.mark.parametrize("block", [3, 4, 32])
@pytest.mark.parametrize("sink_tokens", [1, 4])
def test_sdpa_paths_equal_naive(block, sink_tokens, flash_lse, monkeypatch):
    """Both ways the SDPA body serves the sinks (the CPU flash kernel's LSE merge; the keys
    copied after the sinks, as on other devices), with small blocks so segments have a causal
    head, several body blocks and a tail; with and without autograd (the no-grad path writes one
    output buffer)."""
    calls = []
    if flash_lse:
        apply = sa._BodyWithSinks.apply
        monkeypatch.setattr(sa._BodyWithSinks, "apply", lambda *a: calls.append(1) or apply(*a))
    else:
        monkeypatch.setattr(sa, "_FLASH_CPU", None)
    q_index, q_window, cu = _packed(lengths=[2, 5, 40, 9, 17])

    def run(q, k, v):
        return sa.attention_sdpa(q, k, v, q_index, q_window, cu, need_lse=False, block=block,
                                 sink_tokens=sink_tokens)[0]  # fmt: skip

    q, k, v = _check_against_naive(run, q_index, q_window, cu, sink_tokens)
    assert bool(calls) == (flash_lse and block < 32)  # block 32: no segment has two whole blocks
    with torch.no_grad():
        torch.testing.assert_close(run(q, k, v), attention_naive(q, k, v, q_index, q_window, cu,
                                                                 sink_tokens=sink_tokens)[0], **FWD_TOL)  # fmt: skip


def _cached_layouts():
    """Layouts that continue a KV cache (keys: one document of ``capacity`` slots per row)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 60, (2, 37), generator=g)
    cache = KVCache(2, 2, capacity=48)
    cache.lengths = torch.tensor([30, 17])
    yield "decode", decode_layout(ids[:, 0], cache.lengths), cache
    yield "chunk", prefill_layout([ids[0, :13], ids[1, :5]], start_positions=cache.lengths), cache
    short = KVCache(2, 2, capacity=24)
    short.lengths = torch.tensor([3, 1])  # continues inside the sinks / the first window
    yield "early-chunk", prefill_layout([ids[0, :20], ids[1, :9]], start_positions=short.lengths), short
    yield "sft", sft_layout(ids, [[(25, 37)], [(5, 9), (20, 30)]]), None


CACHED = list(_cached_layouts())


@pytest.mark.parametrize("name,layout,cache", CACHED, ids=[c[0] for c in CACHED])
@pytest.mark.parametrize("kind", ["orthros", "sliding"])
def test_sdpa_and_reference_on_model_plans(name, layout, cache, kind):
    config = OrthrosConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=H,
                           num_key_value_heads=HKV, intermediate_size=64, sliding_window=5, sink_tokens=3,
                           attention_type=kind)  # fmt: skip
    plan = plan_for_layout(config, layout, cache)
    assert plan.sink_tokens == 3
    _, q_index, q_window = plan.queries(with_base=True)
    cu = plan.key_cu_seqlens
    for backend in ("sdpa", "reference"):
        prepared = prepare_attention(q_index, q_window, cu, int(cu[-1]), backend, sink_tokens=3)

        def run(q, k, v, backend=backend, prepared=prepared):
            return orthros_attention(q, k, v, q_index, q_window, cu, backend=backend, prepared=prepared,
                                     sink_tokens=3)  # fmt: skip

        _check_against_naive(run, q_index, q_window, cu, 3)


# Triton under the interpreter: small documents (the interpreter runs every tile in Python).
TRITON_LENGTHS = [2, 5, 11]


@pytest.mark.parametrize("sink_tokens", [1, 4])
@pytest.mark.parametrize("backend", ["triton", "triton_atomic"])
def test_triton_backends_equal_naive(backend, sink_tokens):
    pytest.importorskip("triton")
    q_index, q_window, cu = _packed(lengths=TRITON_LENGTHS, window=5)
    n_k = int(cu[-1])
    prepared = prepare_attention(q_index, q_window, cu, n_k, backend, sink_tokens=sink_tokens, n_band=n_k)
    sinks, (_, sink_plan) = prepared.payload
    assert sink_plan.max_range == sink_tokens and sink_plan.plan.n_band == sinks[0].numel()
    for prep in (prepared, None):

        def run(q, k, v, prep=prep):
            return orthros_attention(q, k, v, q_index, q_window, cu, backend=backend, prepared=prep,
                                     sink_tokens=sink_tokens)  # fmt: skip

        q, k, v = _check_against_naive(run, q_index, q_window, cu, sink_tokens, d=16)
    with torch.no_grad():
        out, lse = attention_with_lse(q, k, v, q_index, q_window, cu, backend=backend, prepared=prepared,
                                      sink_tokens=sink_tokens)  # fmt: skip
    ref, ref_lse = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sink_tokens)
    torch.testing.assert_close(out, ref, **FWD_TOL)
    torch.testing.assert_close(lse, ref_lse, **FWD_TOL)


def test_triton_decode_step_takes_the_sinks_through_the_decode_kernel(monkeypatch):
    """A decode step (no gradient, a base + output query per cache row): both partials run the
    flash-decoding kernel, with host-known grids (no device sync), and equal the naive op."""
    pytest.importorskip("triton")
    from orthros_train.ops import triton_decode

    calls = []
    kernel = triton_decode.decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("max_range"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_decode, "decode_attention", spy)
    cache = KVCache(1, 3, capacity=40)
    cache.lengths = torch.tensor([30, 2, 9])  # past the window and sinks / inside the sinks / between
    layout = decode_layout(torch.tensor([5, 6, 7]), cache.lengths)
    config = OrthrosConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=H,
                           num_key_value_heads=HKV, intermediate_size=64, sliding_window=5, sink_tokens=3)  # fmt: skip
    plan = plan_for_layout(config, layout, cache)
    _, q_index, q_window = plan.queries(with_base=True)
    cu = plan.key_cu_seqlens
    prepared = prepare_attention(q_index, q_window, cu, int(cu[-1]), "triton", sink_tokens=3,
                                 max_range=plan.attention_meta["max_range"])  # fmt: skip
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), requires_grad=False, d=16)
    with torch.no_grad():
        out = orthros_attention(q, k, v, q_index, q_window, cu, backend="triton", prepared=prepared, sink_tokens=3)
    torch.testing.assert_close(out, attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=3)[0], **FWD_TOL)
    assert calls == [31, 3]  # the window partial's grid: the longest row; the sink partial's: S


@pytest.mark.parametrize("sink_tokens", [1, 4])
def test_gpu_auto_route_serves_sinks(sink_tokens):
    """GPU ``auto`` (called directly on CPU tensors): a layout that needs a mask goes to Triton
    with the sink partial merged; one flash attention covers (single-query decode steps) stays
    on SDPA, which gives a windowed single query the sinks it lacks. Both equal the naive op."""
    pytest.importorskip("triton")
    assert op._auto_cuda_output in op._NATIVE_SINKS
    q_index, q_window, cu = _packed(lengths=TRITON_LENGTHS, window=5)
    n_k = int(cu[-1])
    kind, payload = op._choose_cuda(q_index, q_window, cu, n_k, sink_tokens=sink_tokens)
    assert kind == "triton" and torch.equal(payload[0][0], reference.sink_queries(q_index, q_window, cu,
                                                                                   sink_tokens)[0])  # fmt: skip
    q, k, v = _tensors(q_index.numel(), n_k, requires_grad=False, d=16)
    ref = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sink_tokens)[0]
    for prepared in ((kind, payload), None):
        out, _ = op._auto_cuda_output(q, k, v, q_index, q_window, cu, prepared=prepared, sink_tokens=sink_tokens)
        torch.testing.assert_close(out, ref, **FWD_TOL)
    # decode step: a base and an output query at the end of each row
    ends = cu[1:].long() - 1
    dq_index = torch.stack([ends, ends], 1).flatten()
    dq_window = torch.tensor([5, UNBOUNDED]).repeat(len(ends))
    kind, payload = op._choose_cuda(dq_index, dq_window, cu, n_k, sink_tokens=sink_tokens)
    assert kind == "sdpa"
    out, _ = op._auto_cuda_output(q[: dq_index.numel()], k, v, dq_index, dq_window, cu, prepared=(kind, payload),
                                  sink_tokens=sink_tokens)  # fmt: skip
    ref = attention_naive(q[: dq_index.numel()], k, v, dq_index, dq_window, cu, sink_tokens=sink_tokens)[0]
    torch.testing.assert_close(out, ref, **FWD_TOL)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton", "triton_atomic"])
def test_zero_sinks_is_bitwise_the_plain_op_and_never_enters_sink_code(backend, monkeypatch):
    if backend.startswith("triton"):
        pytest.importorskip("triton")
    q_index, q_window, cu = _packed(lengths=TRITON_LENGTHS, window=5)
    n_k = int(cu[-1])
    q, k, v = _tensors(q_index.numel(), n_k, requires_grad=False, d=16)
    plain = orthros_attention(q, k, v, q_index, q_window, cu, backend=backend)
    plain_prepared = prepare_attention(q_index, q_window, cu, n_k, backend)

    def forbidden(*args, **kwargs):
        raise AssertionError("S = 0 entered a sink code path")

    for module in (reference, op):
        monkeypatch.setattr(module, "attention_with_sinks", forbidden)
        monkeypatch.setattr(module, "sink_queries", forbidden)
    monkeypatch.setattr(sa._BodyWithSinks, "apply", forbidden)
    prepared = prepare_attention(q_index, q_window, cu, n_k, backend, sink_tokens=0)
    assert (prepared is None) == (plain_prepared is None)
    assert prepared is None or prepared.sink_tokens == 0
    for prep in (None, prepared):
        out = orthros_attention(q, k, v, q_index, q_window, cu, backend=backend, prepared=prep, sink_tokens=0)
        assert torch.equal(out, plain)
    if backend in ("reference", "sdpa"):  # the LSE variants (the Triton one is covered by the output)
        a = attention_with_lse(q, k, v, q_index, q_window, cu, backend=backend, sink_tokens=0)
        b = attention_with_lse(q, k, v, q_index, q_window, cu, backend=backend)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        a = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=0)
        assert torch.equal(a[0], attention_naive(q, k, v, q_index, q_window, cu)[0])


# -- the model ------------------------------------------------------------------------------


VOCAB = 61
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 43, 1, 41, 42, 27, 18, 28]])


def _model(**overrides):
    settings = {"initializer_range": 0.2, "output_affine": "resampled", **overrides}
    return tiny_model(VOCAB, **settings).eval()


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("sink_tokens", [1, 3, 7])
def test_model_with_window_covering_the_sequence_is_dense(sink_tokens, backend):
    t = IDS.shape[1]
    model = _model(sliding_window=t, sink_tokens=sink_tokens, attention_backend=backend, output_affine="init")
    dense = _model(sliding_window=t, attention_type="dense", attention_backend=backend, output_affine="init")
    dense.load_state_dict(model.state_dict())
    assert model.config.base_sink_tokens == sink_tokens and dense.config.base_sink_tokens == 0
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, dense(IDS).logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["orthros", "sliding"])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_model_inside_the_window_equals_no_sinks_and_differs_beyond(kind, backend):
    w = 6
    with_sinks = _model(sliding_window=w, sink_tokens=3, attention_type=kind, attention_backend=backend)
    without = _model(sliding_window=w, attention_type=kind, attention_backend=backend)
    with torch.no_grad():
        a, b = with_sinks(IDS).logits, without(IDS).logits
    # base token i first sees a sink beyond its window at i = W; every earlier position reads the
    # same keys, and an output token (or the sliding baseline's readout) reads positions <= its own
    same = w
    assert torch.equal(a[:, :same], b[:, :same]) or (a[:, :same] - b[:, :same]).abs().max() <= 1e-6
    assert (a[:, same:] - b[:, same:]).abs().amax(-1).min() > 1e-4


def test_model_training_step_on_sdpa_equals_reference():
    layout = pretrain_layout(torch.cat([IDS, IDS.flip(1)]), eod_token_id=9)  # packed documents
    losses, grads = [], []
    for backend in ("sdpa", "reference"):
        model = _model(sliding_window=5, sink_tokens=2, attention_backend=backend).train()
        loss = model.forward_layout(layout).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 43], [1, 41, 42], [27, 18, 28, 18, 28, 45, 9, 0]]


def _prefill_decode_equals_forward(model, steps: int, chunk: int | None):
    """Greedy prefill + decode logits of a ragged batch against the full forward of each row's
    sequence so far (rows grow past the window and the sinks)."""
    rows = [torch.tensor(p) for p in PROMPTS]
    logits, cache = prefill(model, rows, chunk_size=chunk)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(steps):
        with torch.no_grad():
            for r, seq in enumerate(seqs):
                full = model(torch.tensor(seq)[None]).logits[0, -1]
                torch.testing.assert_close(logits[r], full, atol=2e-5, rtol=1e-5)
        nxt = logits.argmax(-1)
        for r, seq in enumerate(seqs):
            seq.append(int(nxt[r]))
        logits = decode(model, nxt, cache)
    # no eviction: every row keeps all its slots, the sinks (its first S) included
    assert cache.lengths.tolist() == [len(s) for s in seqs]


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("kind", ["orthros", "sliding"])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_prefill_and_decode_equal_the_full_forward(backend, kind, chunk):
    model = _model(sliding_window=5, sink_tokens=2, attention_type=kind, attention_backend=backend)
    _prefill_decode_equals_forward(model, steps=6, chunk=chunk)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["orthros", "sliding"])
def test_prefill_and_decode_on_triton_equal_the_full_forward(kind):
    pytest.importorskip("triton")
    model = _model(sliding_window=5, sink_tokens=2, attention_type=kind, attention_backend="triton")
    _prefill_decode_equals_forward(model, steps=4, chunk=4)


@pytest.mark.parametrize(
    "value,match",
    [
        (-1, "sink_tokens must be an integer >= 0"),
        (2.0, "sink_tokens must be an integer >= 0"),
        ("4", "sink_tokens must be an integer >= 0"),
        (True, "sink_tokens must be an integer >= 0"),
        (8, r"sink_tokens \(8\) must be smaller than sliding_window \(8\)"),
        (9, r"sink_tokens \(9\) must be smaller than sliding_window \(8\)"),
    ],
)
def test_config_refuses_bad_sink_tokens(value, match):
    with pytest.raises(UserError, match=match):
        OrthrosConfig(vocab_size=64, sliding_window=8, sink_tokens=value)
    OrthrosConfig(vocab_size=64, sliding_window=8, sink_tokens=7)  # the largest allowed


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_ops_refuse_bad_sink_tokens(value):
    q_index, q_window, cu = _packed()
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), requires_grad=False)
    for fn in (attention_naive, reference.attention_reference):
        with pytest.raises(ValueError, match="sink_tokens must be an integer >= 0"):
            fn(q, k, v, q_index, q_window, cu, sink_tokens=value)
    with pytest.raises(ValueError, match="sink_tokens must be an integer >= 0"):
        sa.attention_sdpa(q, k, v, q_index, q_window, cu, need_lse=False, sink_tokens=value)
