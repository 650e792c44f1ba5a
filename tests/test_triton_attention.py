"""Triton attention kernels (forward + backward) against the reference op, on the interpreter.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton, so the kernels run on CPU.
Cases are tiny (the interpreter runs every program in Python) but many: randomized layouts via
hypothesis plus the phase builders' real layouts.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orthros_train.ops import attention as attention_mod
from orthros_train.ops import triton_attention as ta
from orthros_train.ops.reference import UNBOUNDED, attention_naive, attention_reference, key_ranges
from orthros_train.phase.builders import prefill_layout, pretrain_layout, sft_layout

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


# Small tiles: several tiles per document at these sizes, and quick under the interpreter.
SMALL = (16, 16)


def _queries(t: int, window: int, output_index: torch.Tensor, base: bool = True):
    """q_index/q_window of [base; output] as the model builds them."""
    parts_i, parts_w = [], []
    if base:
        parts_i.append(torch.arange(t))
        parts_w.append(torch.full((t,), window))
    parts_i.append(output_index.long())
    parts_w.append(torch.full((output_index.numel(),), UNBOUNDED))
    return torch.cat(parts_i), torch.cat(parts_w)


def _tensors(n_q, n_k, h_q, h_kv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, h_q, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(n_k, h_kv, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(n_k, h_kv, d, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _run(fn, q, k, v, q_index, q_window, cu, dout, dlse, **kw):
    out, lse = fn(q, k, v, q_index, q_window, cu, **kw)
    loss = (out.float() * dout).sum() + (lse * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def _check(q_index, q_window, cu, h_q=4, h_kv=2, d=16, dtype=torch.float32, tol=FP32_TOL, seed=0, blocks=SMALL,
           **kw):
    n_k = int(cu[-1])
    q, k, v = _tensors(q_index.numel(), n_k, h_q, h_kv, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=g)
    dlse = torch.randn(h_q, q.shape[0], generator=g)
    got = _run(ta.attention_triton, q, k, v, q_index, q_window, cu, dout, dlse, blocks=blocks, **kw)
    want = _run(attention_reference, q, k, v, q_index, q_window, cu, dout, dlse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")
    return got


# ---------------------------------------------------------------------------------------------
# randomized layouts
# ---------------------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    n_docs = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 45)) for _ in range(n_docs)]
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    window = draw(st.sampled_from([1, 2, 5, 16, 37, t, t + 50]))
    kind = draw(st.sampled_from(["pretrain", "sft", "prefill", "base_only", "output_only"]))
    if kind in ("pretrain", "output_only"):
        out = torch.arange(t)
    elif kind == "sft":
        keep = draw(st.lists(st.booleans(), min_size=t, max_size=t))
        out = torch.nonzero(torch.tensor(keep)).flatten()
    elif kind == "prefill":
        out = cu[1:].long() - 1
    else:
        out = torch.zeros(0, dtype=torch.long)
    q_index, q_window = _queries(t, window, out, base=kind != "output_only")
    if q_index.numel() == 0:
        q_index, q_window = _queries(t, window, out, base=True)
    if draw(st.booleans()):  # the op takes queries in any order
        perm = torch.randperm(q_index.numel(), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
        q_index, q_window = q_index[perm], q_window[perm]
    group = draw(st.sampled_from([1, 2, 4, 8]))
    h_kv = draw(st.sampled_from([1, 2])) if group <= 2 else 1
    d = draw(st.sampled_from([16, 8, 24]))
    blocks = draw(st.sampled_from([(16, 16), (16, 32), (32, 16)]))
    return q_index, q_window, cu, h_kv * group, h_kv, d, blocks


def _check_case(case):
    q_index, q_window, cu, h_q, h_kv, d, blocks = case
    _check(q_index, q_window, cu, h_q=h_q, h_kv=h_kv, d=d, blocks=blocks)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_match_reference(case):
    _check_case(case)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_match_reference_many(case):
    _check_case(case)


# ---------------------------------------------------------------------------------------------
# the phase builders' layouts and named edge cases
# ---------------------------------------------------------------------------------------------


def _builder_case(kind: str):
    g = torch.Generator().manual_seed(3)
    if kind == "pretrain":
        ids = torch.randint(0, 50, (2, 40), generator=g)
        docs = torch.tensor([[0] * 13 + [1] * 27, [0] * 3 + [1] * 30 + [2] * 7])
        lay = pretrain_layout(ids, document_ids=docs)
    elif kind == "sft":
        ids = torch.randint(0, 50, (2, 48), generator=g)
        lay = sft_layout(ids, [[(5, 9), (20, 31)], [(2, 3), (40, 48)]])
    else:
        lay = prefill_layout([torch.randint(0, 50, (n,), generator=g) for n in (37, 5, 60)])
    q_index, q_window = _queries(lay.num_tokens, 8, lay.output_index)
    return q_index, q_window, lay.cu_seqlens


@pytest.mark.parametrize("kind", ["pretrain", "sft", "prefill"])
def test_phase_layouts_match_reference(kind):
    q_index, q_window, cu = _builder_case(kind)
    _check(q_index, q_window, cu, h_q=8, h_kv=2, d=32)


@pytest.mark.parametrize(
    "lengths,window",
    [
        ([50], 1),  # W = 1: every base query sees only itself
        ([50], 64),  # W >= T
        ([33], 7),  # T not a multiple of the block size
        ([1, 2, 3, 1, 9], 4),  # documents shorter than a tile, several per tile
        ([17, 1], UNBOUNDED),  # dense: one window class only
    ],
)
def test_edge_cases(lengths, window):
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q_index, q_window = _queries(t, window, torch.arange(t))
    _check(q_index, q_window, cu, h_q=2, h_kv=1, d=16)


def test_naive_mask_agrees_on_a_packed_layout():
    """Cross-check against the dense-mask definition too (not only the chunked reference)."""
    q_index, q_window, cu = _builder_case("pretrain")
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 4, 2, 16)
    out, lse = ta.attention_triton(q, k, v, q_index, q_window, cu, blocks=SMALL)
    out2, lse2 = attention_naive(q, k, v, q_index, q_window, cu)
    torch.testing.assert_close(out, out2, **FP32_TOL)
    torch.testing.assert_close(lse, lse2, **FP32_TOL)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_inputs(dtype, tol):
    q_index, q_window, cu = _builder_case("sft")
    out, lse, dq, dk, dv = _check(
        q_index, q_window, cu, h_q=4, h_kv=2, d=16, dtype=dtype, tol={"atol": tol, "rtol": tol}
    )
    assert out.dtype == dtype and dq.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize("d", [64, 128])
def test_model_head_dims_with_default_blocks(d):
    q_index, q_window = _queries(40, 16, torch.tensor([3, 30, 39]))
    # blocks=None: the interpreter's single autotune config per stream class
    _check(q_index, q_window, torch.tensor([0, 40], dtype=torch.int32), h_q=2, h_kv=1, d=d, blocks=None)


# ---------------------------------------------------------------------------------------------
# backward variants
# ---------------------------------------------------------------------------------------------


def test_deterministic_backward_is_bitwise_reproducible():
    q_index, q_window, cu = _builder_case("pretrain")
    first = _check(q_index, q_window, cu, h_q=4, h_kv=1, d=16, deterministic=True)
    second = _check(q_index, q_window, cu, h_q=4, h_kv=1, d=16, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_atomic_dq_backward_matches_reference():
    q_index, q_window, cu = _builder_case("sft")
    _check(q_index, q_window, cu, h_q=4, h_kv=2, d=16, deterministic=False)


def test_gradient_of_out_only():
    """When lse is unused its gradient is None/zero; the op must handle it."""
    q_index, q_window, cu = _builder_case("prefill")
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 2, 2, 16)
    out, _ = ta.attention_triton(q, k, v, q_index, q_window, cu, blocks=SMALL)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    out2, _ = attention_reference(q, k, v, q_index, q_window, cu)
    want = torch.autograd.grad(out2.square().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_autograd_function_equals_custom_op():
    q_index, q_window, cu = _builder_case("sft")
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 2, 1, 16)
    out, lse = ta.OrthrosAttentionFunction.apply(q, k, v, q_index, q_window, cu, 0.25, True)
    got = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    out2, lse2 = torch.ops.orthros.attention(q, k, v, q_index, q_window, cu, 0.25, True)
    want = torch.autograd.grad(out2.sum() + lse2.sum(), (q, k, v))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# dispatch, custom op registration, torch.compile
# ---------------------------------------------------------------------------------------------


def test_backend_dispatch():
    assert {"reference", "triton", "triton_atomic"} <= set(attention_mod.available_backends())
    cpu = torch.device("cpu")
    # auto never picks the kernels for CPU tensors (they would need the interpreter)
    kernels = {attention_mod.resolve_backend(name, cpu) for name in ("triton", "triton_atomic")}
    assert attention_mod.resolve_backend("auto", cpu) not in kernels
    q_index, q_window, cu = _builder_case("prefill")
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 2, 1, 16)
    with torch.no_grad():
        forced = attention_mod.orthros_attention(q, k, v, q_index, q_window, cu, backend="triton")
        ref = attention_mod.orthros_attention(q, k, v, q_index, q_window, cu)
    torch.testing.assert_close(forced, ref, **FP32_TOL)


def test_custom_op_opcheck():
    """Schema, fake (meta) kernel and autograd registration checked by torch.library.opcheck."""
    q_index, q_window = _queries(20, 4, torch.tensor([5, 19]))
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    q, k, v = _tensors(q_index.numel(), 20, 2, 1, 16)
    torch.library.opcheck(
        torch.ops.orthros.attention.default,
        (q, k, v, q_index, q_window, cu, 0.25, True),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(30, 8, 64), torch.empty(20, 2, 64), torch.empty(20, 2, 64)
        qi, qw = torch.zeros(30, dtype=torch.long), torch.ones(30, dtype=torch.long)
        out, lse = torch.ops.orthros.attention(q, k, v, qi, qw, torch.tensor([0, 20]), 0.125, True)
        assert out.shape == (30, 8, 64) and lse.shape == (8, 30) and lse.dtype == torch.float32


def test_torch_compile_fullgraph():
    """The op is opaque to dynamo: fullgraph compile (forward + backward) with no graph break."""
    torch._dynamo.reset()
    q_index, q_window, cu = _builder_case("sft")
    q, k, v = _tensors(q_index.numel(), int(cu[-1]), 2, 1, 16)

    def f(q, k, v):
        q = q * 1.5
        out = attention_mod.orthros_attention(q, k, v, q_index, q_window, cu, backend="triton")
        return (out * out).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32_TOL)


def test_orthros_block_compiles_fullgraph():
    """A whole Orthros layer (both streams) with the triton backend: one graph, same numbers."""
    from orthros_train.model.orthros import OrthrosForCausalLM, plan_for_layout

    torch._dynamo.reset()
    cfg = tiny_config(64, intermediate_size=48, sliding_window=6, attention_backend="triton")
    model = OrthrosForCausalLM(cfg)
    lay = sft_layout(torch.randint(0, 64, (2, 24)), [[(4, 10)], [(15, 24)]])
    plan = plan_for_layout(cfg, lay)
    x = model.embed_tokens(lay.input_ids)
    y = x[lay.output_index]
    block = model.layers[0]
    want = block(x, y, plan)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, y, plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32_TOL)
    torch.autograd.grad(got[1].sum(), list(block.parameters()))


def test_no_queries():
    q, k, v = _tensors(0, 10, 2, 1, 16)
    idx = torch.zeros(0, dtype=torch.long)
    out, lse = ta.attention_triton(q, k, v, idx, idx, torch.tensor([0, 10]), blocks=SMALL)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    dk = torch.autograd.grad(out.sum(), k, allow_unused=True)[0]
    assert dk is None or not dk.any()


def test_model_with_triton_backend_matches_reference():
    from orthros_train.model.orthros import OrthrosForCausalLM

    cfg = tiny_config(64, intermediate_size=48, sliding_window=6)
    model = OrthrosForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 24))
    lay = sft_layout(ids, [[(4, 10)], [(15, 24)]])
    want = model.forward_layout(lay)
    cfg.attention_backend = "triton"
    got = model.forward_layout(lay)
    torch.testing.assert_close(got.logits, want.logits, **FP32_TOL)
    grads = torch.autograd.grad(got.loss, list(model.parameters()))
    ref = torch.autograd.grad(want.loss, list(model.parameters()))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# work proportional to the mask (host mirror of the kernel's tile bounds)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["base", "sft", "prefill", "pretrain"])
def test_tile_work_is_proportional_to_the_mask(kind):
    t, w = 16384, 128
    g = torch.Generator().manual_seed(0)
    out = {
        "base": torch.zeros(0, dtype=torch.long),
        "sft": torch.sort(torch.randperm(t, generator=g)[: t // 10]).values,
        "prefill": torch.tensor([t - 1]),
        "pretrain": torch.arange(t),
    }[kind]
    q_index, q_window = _queries(t, w, out)
    cu = torch.tensor([0, t])
    work = ta.forward_tile_work(q_index, q_window, cu, t, blocks={"band": (64, 64), "full": (64, 64)})
    ideal = int(sum(e - s + 1 for s, e in zip(*[x.tolist() for x in key_ranges(q_index, q_window, cu)])))
    assert work["unmasked"] == ideal
    # base band: a 64-query tile spans 64 + W - 1 keys -> 3 key tiles for 128 keys a query;
    # output rows: causal tiles, at most one diagonal tile of waste per query tile.
    bound = {"base": 1.55, "sft": 1.55, "prefill": 1.55, "pretrain": 1.1}[kind]
    assert work["visited"] <= bound * ideal + 64 * t  # + one full-document tile (prefill's query)
    if kind in ("base", "prefill"):
        assert work["visited"] < 0.05 * t * t  # linear in T, far from the T^2/2 of full causal


def test_autotuning_is_keyed_on_a_length_bucket_and_large_tiles_on_head_dim() -> None:
    from orthros_train.ops import triton_attention as ta

    assert ta.length_bucket(10, 100) == 1 << 10 and ta.length_bucket(5000, 4096) == 8192
    assert ta.length_bucket(10, 1 << 20) == 1 << 18  # clamped: one bucket for the longest contexts
    assert ta.tile_fits(128, 128, 64) and not ta.tile_fits(128, 128, 128) and ta.tile_fits(128, 64, 128)
    tuners = ta._autotuned("fwd", ta._attn_fwd_kernel, ["BLOCK_D"])
    first, again, other = tuners["full", 1024], tuners["full", 1024], tuners["full", 4096]
    assert first is again and first is not other and first.fn is other.fn  # one kernel, tuned per bucket
    assert (128, 128, 8, 2) in ta._GPU_CONFIGS["fwd"]["full"]  # the large forward tile is on the GPU list
