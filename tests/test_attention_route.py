"""The GPU attention route (ops/route.py): every row of the table, the whole-streams test, and the
FlashAttention varlen path's numerics against the reference op with the plain-torch stand-in."""

from __future__ import annotations

import importlib
import importlib.machinery

import pytest
import torch

from orthros_train.ops import attention as attention_mod
from orthros_train.ops import route as route_mod
from orthros_train.ops.reference import UNBOUNDED, attention_reference
from orthros_train.ops.route import (
    ROUTES,
    RouteFacts,
    VarlenPlan,
    choose_route,
    varlen_reference,
    varlen_streams,
    whole_streams,
)
from orthros_train.ops.sdpa_attention import query_segments

BF16 = torch.bfloat16
GPU = dict(device_type="cuda", dtype=BF16, head_dim=64, varlen="torch", triton=True)
PRETRAIN = (8, UNBOUNDED)

# (facts, the route's name, a word of its reason): one case per row of ROUTES, in order.
CASES = [
    (RouteFacts("cpu", need_lse=True), "reference", "LSE off the GPU"),
    (RouteFacts("cpu", stream_windows=PRETRAIN, varlen="torch"), "sdpa", "off the GPU"),
    (RouteFacts(**GPU, need_lse=True, stream_windows=PRETRAIN), "triton", "log-sum-exp"),
    (RouteFacts(**GPU, stream_windows=PRETRAIN), "varlen", "whole streams"),
    (RouteFacts(**GPU, stream_windows=PRETRAIN, deterministic=True), "triton", "reproducible kernels"),
    (RouteFacts(**{**GPU, "varlen": None}, stream_windows=PRETRAIN), "split", "is_causal per document"),
    (RouteFacts(**GPU, needs_mask=False), "sdpa", "no mask"),
    (RouteFacts(**GPU), "triton", "answer spans"),
    (RouteFacts(**{**GPU, "triton": False}), "sdpa", "triton is not installed"),
]
# What keeps whole streams off FlashAttention: each goes to the Triton kernels.
NOT_VARLEN = [
    {"sink_tokens": 4},  # the base stream's sinks are not a window
    {"dtype": torch.float32},  # FlashAttention runs half precision only
    {"dtype": None},  # a caller that did not say its queries' dtype
    {"head_dim": 320},
    {"head_dim": 60},
]


@pytest.mark.parametrize("facts, name, why", CASES)
def test_each_row_of_the_table(facts, name, why) -> None:
    route = choose_route(facts)
    assert (route.name, why in route.why) == (name, True), route


def test_the_cases_cover_every_row() -> None:
    assert [ROUTES.index(choose_route(facts)) for facts, _, _ in CASES] == list(range(len(ROUTES)))


@pytest.mark.parametrize("varlen", ["torch", None])
@pytest.mark.parametrize("change", NOT_VARLEN)
def test_whole_streams_fall_back_to_triton(change, varlen) -> None:
    """What keeps them off FlashAttention keeps them off the split route too."""
    assert choose_route(RouteFacts(**{**GPU, "stream_windows": PRETRAIN, "varlen": varlen, **change})).name == "triton"


def test_a_deterministic_run_gets_no_torch_flashattention_backward() -> None:
    """torch's own FlashAttention backward (varlen and SDPA) keeps its atomics under warn_only:
    a run that asked for reproducible kernels takes flash-attn told deterministic=True, or Triton."""
    det = {**GPU, "deterministic": True}
    for facts in (RouteFacts(**det, stream_windows=PRETRAIN), RouteFacts(**{**det, "varlen": None},
                  stream_windows=PRETRAIN), RouteFacts(**det, stream_windows=(UNBOUNDED,), needs_mask=False),
                  RouteFacts(**det, needs_mask=False)):  # fmt: skip
        assert choose_route(facts).name == "triton", facts
    for varlen in route_mod.DETERMINISTIC_VARLEN:
        assert choose_route(RouteFacts(**{**det, "varlen": varlen}, stream_windows=PRETRAIN)).name == "varlen"
    # without triton nothing reproducible is left: SDPA as before
    assert choose_route(RouteFacts(**{**det, "triton": False}, needs_mask=False)).name == "sdpa"


def test_the_split_route_needs_a_causal_and_a_windowed_stream() -> None:
    no_varlen = {**GPU, "varlen": None}
    assert choose_route(RouteFacts(**no_varlen, stream_windows=(8,))).name == "triton"  # sliding baseline
    assert choose_route(RouteFacts(**no_varlen, stream_windows=(UNBOUNDED,), needs_mask=False)).name == "sdpa"


def pretrain_queries(lengths, window, streams=2):
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    index = torch.arange(n).repeat(streams)
    windows = [window, UNBOUNDED][:streams] if streams == 2 else [window]
    q_window = torch.cat([torch.full((n,), w) for w in windows])
    return index, q_window, cu


def test_whole_streams_are_found_in_pretraining_and_baselines_only() -> None:
    index, window, cu = pretrain_queries([20, 28], 8)
    assert whole_streams(query_segments(index, window, cu), 48, 96) == (8, UNBOUNDED)
    index, window, cu = pretrain_queries([20, 28], 8, streams=1)  # the sliding baseline
    assert whole_streams(query_segments(index, window, cu), 48, 48) == (8,)
    # A window that covers every document is causal attention.
    index, window, cu = pretrain_queries([20, 28], 64, streams=1)
    assert whole_streams(query_segments(index, window, cu), 48, 48) == (UNBOUNDED,)
    # SFT: output tokens on an answer span only.
    answer = torch.cat([torch.arange(48), torch.arange(30, 40)])
    q_window = torch.cat([torch.full((48,), 8), torch.full((10,), UNBOUNDED)])
    assert whole_streams(query_segments(answer, q_window, cu), 48, 58) is None
    # Prefill: one output token; a stream in another order.
    assert whole_streams(query_segments(answer[:49], q_window[:49], cu), 48, 49) is None
    shuffled = torch.cat([torch.arange(48), torch.arange(48).flip(0)])
    assert whole_streams(query_segments(shuffled, torch.cat([q_window[:48], q_window[:48]]), cu), 48, 96) is None


def inputs(n_q, n_k, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n_k, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n_k, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("streams, window", [(2, 8), (1, 8), (1, UNBOUNDED)])
def test_varlen_streams_equal_the_reference_forward_and_backward(streams, window) -> None:
    index, q_window, cu = pretrain_queries([20, 1, 27], window, streams)
    q, k, v = inputs(index.numel(), 48)
    plan = VarlenPlan("reference", whole_streams(query_segments(index, q_window, cu), 48, index.numel()), 27)
    out = varlen_streams(q, k, v, cu, plan)
    ref, _ = attention_reference(q, k, v, index, q_window, cu)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_gpu_auto_takes_the_varlen_route_for_pretraining(monkeypatch) -> None:
    """``auto``'s CUDA path, run on CPU tensors with the plain-torch varlen as the installed one."""
    monkeypatch.setattr(attention_mod, "installed_varlen", lambda: "reference")
    index, q_window, cu = pretrain_queries([20, 28], 8)
    q, k, v = inputs(96, 48)
    kind, plan = attention_mod._choose_cuda(index, q_window, cu, 48, dtype=BF16, head_dim=16)
    assert (kind, plan) == ("varlen", VarlenPlan("reference", (8, UNBOUNDED), 28))
    out, _ = attention_mod._auto_cuda_output(q, k, v, index, q_window, cu, prepared=(kind, plan))
    torch.testing.assert_close(out, attention_reference(q, k, v, index, q_window, cu)[0], rtol=1e-12, atol=1e-12)
    # fp32 queries, sink tokens, an SFT layout: the Triton kernels as before.
    assert attention_mod._choose_cuda(index, q_window, cu, 48, dtype=torch.float32, head_dim=16)[0] == "triton"
    assert attention_mod._choose_cuda(index, q_window, cu, 48, sink_tokens=2, dtype=BF16, head_dim=16)[0] == "triton"
    assert attention_mod._choose_cuda(index[:60], q_window[:60], cu, 48, dtype=BF16, head_dim=16)[0] == "triton"
    torch.use_deterministic_algorithms(True, warn_only=True)  # as trainer.deterministic sets it
    try:
        assert attention_mod._choose_cuda(index, q_window, cu, 48, dtype=BF16, head_dim=16)[0] == "triton"
    finally:
        torch.use_deterministic_algorithms(False)


def test_without_flashattention_the_output_stream_goes_to_sdpa_and_the_base_stream_to_triton(monkeypatch) -> None:
    """The ``split`` route (a torch whose varlen lacks window_size): numerics of both halves,
    forward and backward, against the reference op (Triton under the interpreter on CPU)."""
    monkeypatch.setattr(attention_mod, "installed_varlen", lambda: None)
    index, q_window, cu = pretrain_queries([20, 1, 27], 8)
    q, k, v = (t.detach().float().requires_grad_() for t in inputs(96, 48))
    kind, plans = attention_mod._choose_cuda(index, q_window, cu, 48, dtype=BF16, head_dim=16)
    assert kind == "split" and [p[1] for p in plans] == ["triton", "sdpa"]
    out, _ = attention_mod._auto_cuda_output(q, k, v, index, q_window, cu, prepared=(kind, plans))
    ref, _ = attention_reference(q, k, v, index, q_window, cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_describe_routes_names_the_route_of_each_layout(monkeypatch) -> None:
    monkeypatch.setattr(route_mod, "installed_varlen", lambda: "flash_attn_2")
    gpu = route_mod.describe_routes("cuda", BF16, 64, "orthros", 128, 4096)
    assert gpu["pretraining"].startswith("varlen (flash_attn_2): whole streams")
    assert gpu["answer spans (SFT/RL)"].startswith("triton") and gpu["decode steps"].startswith("sdpa")
    assert f"torch {torch.__version__}, FlashAttention varlen: flash_attn_2" in gpu["decided by"]
    assert route_mod.describe_routes("cuda", BF16, 64, "orthros", 128, 4096, sink_tokens=4)["pretraining"] \
        .startswith("triton")
    assert route_mod.describe_routes("cuda", BF16, 64, "orthros", 128, 4096, deterministic=True)["pretraining"] \
        .startswith("varlen (flash_attn_2)")  # flash-attn is told deterministic=True
    monkeypatch.setattr(route_mod, "installed_varlen", lambda: "torch")
    assert route_mod.describe_routes("cuda", BF16, 64, "orthros", 128, 4096, deterministic=True)["pretraining"] \
        .startswith("triton: reproducible kernels")
    monkeypatch.setattr(route_mod, "installed_varlen", lambda: None)
    assert route_mod.describe_routes("cuda", BF16, 64, "orthros", 128, 4096)["pretraining"].startswith("split")
    assert set(route_mod.describe_routes("cpu", torch.float32, 64, "orthros", 128, 4096).values()) == {
        next(r for r in ROUTES if r.name == "sdpa").name + ": " + ROUTES[1].why}


def test_the_installed_implementation_is_read_from_signatures() -> None:
    route_mod.installed_varlen.cache_clear()
    found = route_mod.installed_varlen()
    assert found in (None, "torch", "flash_attn_2", "flash_attn_3")
    if found is not None:
        assert callable(route_mod.varlen_function(found))


# -- the installed implementations, faked: what the node's packages would be called with -------------------


class FakeFlash:
    """A flash-attn module's ``flash_attn_varlen_func`` (keyword-only past v, as the test demands)."""

    def __init__(self, lse: bool = False) -> None:
        self.calls: list[dict] = []
        self.lse = lse

    def flash_attn_varlen_func(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, window_size=(-1, -1),
                               deterministic=False):  # fmt: skip
        self.calls.append(dict(max_seqlen_q=max_seqlen_q, causal=causal, window_size=window_size,
                               deterministic=deterministic, kv_heads=k.shape[1]))  # fmt: skip
        out = varlen_reference(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
                               v.repeat_interleave(q.shape[1] // v.shape[1], 1), cu_seqlens_q, max_seqlen_q,
                               softmax_scale, window_size)  # fmt: skip
        return (out, None) if self.lse else out


def install_fake(monkeypatch, module: str, fake) -> None:
    import sys
    import types

    mod = types.ModuleType(module)
    mod.flash_attn_varlen_func = fake.flash_attn_varlen_func
    mod.__spec__ = importlib.machinery.ModuleSpec(module, None)
    monkeypatch.setitem(sys.modules, module, mod)
    route_mod.installed_varlen.cache_clear()
    route_mod.varlen_function.cache_clear()
    monkeypatch.setattr(route_mod.torch.cuda, "is_available", lambda: False)


@pytest.fixture
def clear_route_caches():
    yield
    route_mod.installed_varlen.cache_clear()
    route_mod.varlen_function.cache_clear()


@pytest.mark.parametrize("module, name, lse", [("flash_attn_interface", "flash_attn_3", True),
                                               ("flash_attn", "flash_attn_2", False)])  # fmt: skip
def test_flash_attn_is_called_by_keyword_with_the_run_s_determinism(monkeypatch, clear_route_caches, module, name,
                                                                    lse) -> None:  # fmt: skip
    fake = FakeFlash(lse)
    install_fake(monkeypatch, module, fake)
    assert route_mod.installed_varlen() == name
    index, q_window, cu = pretrain_queries([20, 1, 27], 8)
    q, k, v = inputs(96, 48)
    plan = VarlenPlan(name, (8, UNBOUNDED), 27)
    out = varlen_streams(q, k, v, cu, plan)
    torch.testing.assert_close(out, attention_reference(q, k, v, index, q_window, cu)[0], rtol=1e-12, atol=1e-12)
    assert [c["window_size"] for c in fake.calls] == [(7, 0), (-1, 0)]
    assert all(c["causal"] and c["max_seqlen_q"] == 27 and not c["deterministic"] and c["kv_heads"] == 2
               for c in fake.calls)  # fmt: skip
    monkeypatch.setattr(route_mod.torch, "are_deterministic_algorithms_enabled", lambda: True)
    varlen_streams(q, k, v, cu, plan)
    assert [c["deterministic"] for c in fake.calls[2:]] == [True, True]


def test_a_flash_attn_that_does_not_load_is_passed_over(monkeypatch, clear_route_caches) -> None:
    import importlib.util as util

    real_find, real_import = util.find_spec, importlib.import_module
    monkeypatch.setattr(util, "find_spec",
                        lambda n, *a: object() if n == "flash_attn_interface" else real_find(n, *a))  # fmt: skip

    def broken(name, *args):
        if name == "flash_attn_interface":
            raise ImportError("undefined symbol: _ZN3c10 (built for another torch)")
        return real_import(name, *args)
    monkeypatch.setattr(importlib, "import_module", broken)
    route_mod.installed_varlen.cache_clear()
    found = route_mod.installed_varlen()
    assert found != "flash_attn_3" and found in (None, "flash_attn_2", "torch")


def test_a_flash_attn_without_the_deterministic_keyword_is_passed_over(monkeypatch, clear_route_caches) -> None:
    """flash-attn 2.3 took window_size but not deterministic: a reproducible run could not use it."""

    class Old(FakeFlash):
        def flash_attn_varlen_func(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   softmax_scale=None, causal=False, window_size=(-1, -1)):  # fmt: skip
            raise AssertionError("never called")
    install_fake(monkeypatch, "flash_attn", Old())
    assert route_mod.installed_varlen() != "flash_attn_2"


def test_a_gpu_older_than_ampere_gets_no_flashattention_route(monkeypatch, clear_route_caches) -> None:
    install_fake(monkeypatch, "flash_attn", FakeFlash())
    monkeypatch.setattr(route_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(route_mod.torch.cuda, "get_device_capability", lambda *a: (7, 5))
    route_mod.installed_varlen.cache_clear()
    assert route_mod.installed_varlen() is None
    monkeypatch.setattr(route_mod.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    route_mod.installed_varlen.cache_clear()
    assert route_mod.installed_varlen() == "flash_attn_2"


def test_flash_attn_3_only_on_hopper(monkeypatch, clear_route_caches) -> None:
    install_fake(monkeypatch, "flash_attn_interface", FakeFlash())
    monkeypatch.setattr(route_mod.torch.cuda, "is_available", lambda: True)
    for capability, expected in (((9, 0), "flash_attn_3"), ((10, 0), "not fa3"), ((8, 6), "not fa3")):
        monkeypatch.setattr(route_mod.torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        route_mod.installed_varlen.cache_clear()
        found = route_mod.installed_varlen()
        assert (found == "flash_attn_3") == (expected == "flash_attn_3"), (capability, found)


def test_torch_varlen_without_gqa_gets_its_key_heads_expanded_once_per_layer(monkeypatch, clear_route_caches) -> None:
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # torch 2.11's keywords
        calls.append(k.shape[1])
        return varlen_reference(q, k, v, cu_q, max_q, scale, window_size)
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    route_mod._torch_groups_heads.cache_clear()
    route_mod.varlen_function.cache_clear()
    expanded = []
    real_repeat = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        lambda t, *a, **kw: expanded.append(1) or real_repeat(t, *a, **kw))  # fmt: skip
    try:
        index, q_window, cu = pretrain_queries([20, 28], 8)
        q, k, v = inputs(96, 48)
        out = varlen_streams(q, k, v, cu, VarlenPlan("torch", (8, UNBOUNDED), 28))
    finally:
        route_mod._torch_groups_heads.cache_clear()
    torch.testing.assert_close(out, attention_reference(q, k, v, index, q_window, cu)[0], rtol=1e-12, atol=1e-12)
    assert calls == [4, 4] and len(expanded) == 2  # k and v once, both streams share them


def test_the_dry_run_prints_the_route_and_the_trainer_logs_it(tmp_path, make_trainer, caplog) -> None:
    import logging

    from fixtures import compose_recipe

    from orthros_train.train.plan import attention_routes, plan_summary

    cfg = compose_recipe("pretrain_1p3b", f"trainer.run_dir={tmp_path / 'plan'}")
    routes = plan_summary(cfg)["attention_route"]  # a GPU recipe: the GPU's routes
    assert set(routes) == {"cuda"} and attention_routes(cfg, "cpu")["cpu"]["pretraining"].startswith("sdpa")
    no_varlen = "split" if "triton" in attention_mod.available_backends() else "sdpa"
    expected = "varlen" if route_mod.installed_varlen() else no_varlen
    assert routes["cuda"]["pretraining"].startswith(expected) and routes["cuda"]["prefill"].startswith("triton")
    with caplog.at_level(logging.INFO, logger="orthros_train.train.trainer"):
        trainer = make_trainer()
        trainer.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention route")]
    assert said == ["attention route on cpu: pretraining -> sdpa; answer spans (SFT/RL) -> sdpa; prefill -> sdpa; "
                    "decode steps -> sdpa"], said


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_installed_flashattention_equals_the_reference_on_gpu() -> None:
    """The real kernel (FA3, FA2 or torch's varlen) against the reference op in fp32, bf16 inputs."""
    name = route_mod.installed_varlen()
    if name is None:
        pytest.skip("no FlashAttention varlen with a window on this machine")
    index, q_window, cu = (t.cuda() for t in pretrain_queries([200, 1, 311], 64))
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in inputs(1024, 512, dim=64))
    plan = VarlenPlan(name, whole_streams(query_segments(index, q_window, cu), 512, 1024), 311)
    out = varlen_streams(q, k, v, cu, plan)
    ref, _ = attention_reference(q.float(), k.float(), v.float(), index, q_window, cu)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()  # the pretraining step's backward, windowed stream included
    ref_q, ref_k, ref_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(ref_q, ref_k, ref_v, index, q_window, cu)
    ref.square().sum().backward()
    for got, want in ((q.grad, ref_q.grad), (k.grad, ref_k.grad), (v.grad, ref_v.grad)):
        assert (got.float() - want).norm() <= 2e-2 * want.norm()  # bf16 rounding, relative to the gradient
