"""The served base stream with sink tokens and the cache-layout checks, without an engine: the
Triton paged kernel (window + sinks, under TRITON_INTERPRET=1) and the CPU torch path over the CPU
backend's own cache writes, both against ``attention_naive`` (the op's definition); the layout
check with vLLM's CPU writer and a wrong reader; the kernels compiled ahead; the refusals of the
config hook."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from orthros_train.ops.reference import attention_naive  # noqa: E402
from orthros_train.serve import kv_layout  # noqa: E402
from orthros_train.serve.output_rows import every_row  # noqa: E402
from orthros_train.serve.refusal import OrthrosServeError  # noqa: E402

W, S = 8, 3
# Refused when the engine's config is built: the plugin hook's one-line error, or the export's config
# class's own ValueError where it rejects a value first.
REFUSED = (ValueError, OrthrosServeError)


def requests_case(lengths, new, h_q=4, h_kv=2, d=32, block_size=16, seed=0, dtype=torch.float32):
    """Per request: keys/values of its whole sequence (``lengths``) in shuffled blocks, and this
    step's last ``new`` tokens as queries; plus the flat tensors ``attention_naive`` takes."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(blocks_per) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lengths), max(blocks_per) + 1), num_blocks - 1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per):
        table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    k = torch.randn(sum(lengths), h_kv, d, generator=g).to(dtype)
    v = torch.randn(sum(lengths), h_kv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    slots, q_index = [], []
    for r, n in enumerate(lengths):
        pos = torch.arange(n)
        slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
        q_index.extend(range(int(cu[r]) + n - new[r], int(cu[r]) + n))
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h_q, d, generator=g).to(dtype)
    return dict(k=k, v=v, q=q, slots=torch.cat(slots), table=table, num_blocks=num_blocks, cu=cu,
                q_index=torch.tensor(q_index), qsl=qsl, seq=torch.tensor(lengths, dtype=torch.int32),
                block_size=block_size)


def paged_caches(case) -> tuple[torch.Tensor, torch.Tensor]:
    """``requests_case``'s keys and values written into paged caches ``[blocks, block_size, Hkv, D]``."""
    bs, h_kv, d = case["block_size"], case["k"].shape[1], case["k"].shape[2]
    key_cache = torch.zeros(case["num_blocks"] * bs, h_kv, d, dtype=case["k"].dtype)
    value_cache = torch.zeros_like(key_cache)
    key_cache[case["slots"]], value_cache[case["slots"]] = case["k"], case["v"]
    return key_cache.view(case["num_blocks"], bs, h_kv, d), value_cache.view(case["num_blocks"], bs, h_kv, d)


def naive(case, window, sinks):
    q_window = torch.full_like(case["q_index"], window)
    out, _ = attention_naive(case["q"], case["k"], case["v"], case["q_index"], q_window, case["cu"],
                             sink_tokens=sinks)
    return out


LENGTHS, NEW = [40, 9, 23, 5], [7, 9, 1, 2]  # a chunk past W, a whole prompt, a decode step, a short prompt


@pytest.mark.parametrize("window,sinks", [(W, S), (W, 0), (4, 3), (1, 1)])
def test_triton_paged_kernel_with_window_and_sinks_equals_the_definition(window, sinks):
    from orthros_train.serve.paged_attention import paged_output_attention_reference, paged_window_attention

    case = requests_case(LENGTHS, NEW)
    n = case["slots"].shape[0]
    key_cache, value_cache = paged_caches(case)
    request, keys = every_row(case["qsl"], int(case["qsl"][-1]) + 3, n, max(NEW)).row_requests(case["seq"])
    q = torch.cat([case["q"], torch.randn(3, 4, 32)])  # three padding rows: zero, no key read
    got = paged_window_attention(q, key_cache, value_cache, case["table"], request, keys, window, sinks)
    want = naive(case, window, sinks)
    torch.testing.assert_close(got[:-3], want, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(got[-3:]) == 0
    ref = paged_output_attention_reference(q, key_cache, value_cache, case["table"], keys, None,
                                           row_request=request, window=window, sink_tokens=sinks)
    torch.testing.assert_close(ref[:-3], want, atol=2e-5, rtol=2e-5)


def cpu_cache(case, h_kv=2, d=32):
    """The case's K/V written into a cache of the CPU backend's layout by its own writer."""
    from vllm import _custom_ops as ops

    bs = case["block_size"]
    kv = torch.zeros(case["num_blocks"], h_kv, bs, 2 * d)
    key_cache, value_cache = kv_layout.cpu_op_views(kv)
    ops.cpu_attn_reshape_and_cache(case["k"], case["v"], key_cache, value_cache, case["slots"], "vec16" if bs % 32
                                   else "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv


@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_base_attention_over_the_cpu_cache_equals_the_definition(block_size):
    from orthros_train.serve.model import BaseStreamAttention

    case = requests_case(LENGTHS, NEW, block_size=block_size, seed=1)
    kv = cpu_cache(case)
    m = int(case["qsl"][-1])
    layer = SimpleNamespace(window=W, sink_tokens=S, kv_cache=kv, num_kv_heads=2, num_heads=4, head_size=32,
                            impl=SimpleNamespace(scale=32**-0.5), CPU_CHUNK_ROWS=4)  # a 7-row chunk in two
    q = torch.cat([case["q"], torch.randn(2, 4, 32)]).view(m + 2, -1)
    out = torch.full((m + 2, 4 * 32), float("nan"))
    BaseStreamAttention._base_attention_cpu(layer, q, out, case["table"], case["qsl"], case["seq"], m)
    torch.testing.assert_close(out[:m].view(m, 4, 32), naive(case, W, S), atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(out[m:]) == 0


def test_layout_check_passes_the_cpu_writer_and_catches_a_wrong_reader():
    from vllm import _custom_ops as ops

    def cpu_writer(isa):
        def write(k, v, kv, slots):
            key_cache, value_cache = kv_layout.cpu_op_views(kv)
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
        return write

    for isa, bs, dtype in [("vec", 128, torch.float32), ("vec", 32, torch.bfloat16), ("vec16", 16, torch.float32)]:
        kv_layout.check_layout(kv_layout.CPU, cpu_writer(isa), 2, 32, bs, dtype, "cpu", f"CPU_ATTN {isa}")
    # The CPU cache read as FlashAttention's (or the reverse) is caught at load, with what was checked.
    with pytest.raises(kv_layout.KVLayoutError, match="CPU_ATTN vec does not lay out its KV cache"):
        kv_layout.check_layout(kv_layout.PAGED, cpu_writer("vec"), 2, 32, 128, torch.float32, "cpu", "CPU_ATTN vec")

    def paged_writer(k, v, kv, slots):
        key_cache, value_cache = kv.transpose(1, 2).split(k.shape[-1], dim=-1)
        bs = kv.shape[2]
        key_cache[slots // bs, slots % bs] = k
        value_cache[slots // bs, slots % bs] = v

    kv_layout.check_layout(kv_layout.PAGED, paged_writer, 2, 32, 16, torch.float32, "cpu", "FLASH_ATTN")
    with pytest.raises(kv_layout.KVLayoutError, match="FLASH_ATTN does not lay out"):
        kv_layout.check_layout(kv_layout.CPU, paged_writer, 2, 32, 16, torch.float32, "cpu", "FLASH_ATTN")

    def failing(k, v, kv, slots):
        raise RuntimeError("Unsupported CPU attention configuration")

    with pytest.raises(kv_layout.KVLayoutError, match="X could not write a test block.*Unsupported"):
        kv_layout.check_layout(kv_layout.CPU, failing, 2, 32, 16, torch.float32, "cpu", "X")


def test_layouts_that_are_not_handled_are_refused_with_the_fix():
    assert kv_layout.layout_for("FLASH_ATTN", "auto", "cuda") == kv_layout.PAGED
    assert kv_layout.layout_for("TRITON_ATTN", "auto", "cuda") == kv_layout.PAGED
    assert kv_layout.layout_for("CPU_ATTN", "auto", "cpu") == kv_layout.CPU
    with pytest.raises(kv_layout.KVLayoutError, match="kv_cache_dtype='fp8'.*--kv-cache-dtype auto"):
        kv_layout.layout_for("FLASH_ATTN", "fp8", "cuda")
    with pytest.raises(kv_layout.KVLayoutError, match="backend FLASHMLA is not one.*--attention-backend FLASH_ATTN"):
        kv_layout.layout_for("FLASHMLA", "auto", "cuda")
    # FlashInfer writes the same cache, but its step metadata has no query_start_loc / seq_lens /
    # block_table (the model would fail at its first step): refused at load, with the fix
    with pytest.raises(kv_layout.KVLayoutError, match="FLASHINFER is not one.*--attention-backend FLASH_ATTN"):
        kv_layout.layout_for("FLASHINFER", "auto", "cuda")
    with pytest.raises(kv_layout.KVLayoutError, match="in the model's dtype.*'bfloat16' is not taken.*auto"):
        kv_layout.layout_for("FLASH_ATTN", "bfloat16", "cuda")


def test_breakable_cuda_graphs_are_refused_at_model_init(monkeypatch):
    from orthros_train.serve.model import refuse_breakable_graphs
    from orthros_train.serve.refusal import OrthrosServeError

    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    refuse_breakable_graphs()
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(OrthrosServeError, match="breakable CUDA graphs.*unset those variables"):
        refuse_breakable_graphs()
    with pytest.raises(kv_layout.KVLayoutError, match="expected a KV cache"):
        kv_layout.split_paged(torch.zeros(2, 2, 16, 48), 32)


def test_the_paged_kernels_are_compiled_ahead_for_every_launch_the_model_makes():
    """Compiled at load for the row counts Triton specialises on; the values that change with the
    deployment are not specialised on, so no later launch (a graph capture) compiles."""
    from orthros_train.serve import paged_attention

    kernel = paged_attention._paged_split_kernel
    # Compiled (a JITFunction) or interpreted, the kernel keeps the arguments it was declared with.
    not_specialised = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
    assert {"stride_btr", "n_splits", "block_size", "window", "sinks"} <= set(not_specialised)
    assert not paged_attention.is_compiled("cpu", torch.float32, 4, 2, 32)
    paged_attention.compile_paged_kernels(torch.device("cpu"), torch.float32, 4, 2, 32, base_stream=True)
    assert paged_attention.is_compiled(torch.device("cpu"), torch.float32, 4, 2, 32)


def test_served_sink_tokens():
    from orthros_train.serve.config import served_sink_tokens

    config = SimpleNamespace(base_window=16, sink_tokens=4)
    assert served_sink_tokens(config, 1024) == 4
    assert served_sink_tokens(config, 16) == 0  # no window ever misses a request's first tokens
    assert served_sink_tokens(SimpleNamespace(base_window=16), 1024) == 0  # absent: 0


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from exports import make_orthros

    return make_orthros(tmp_path_factory.mktemp("sinks"), sink_tokens=S)[1]


def build_config(export_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(export_dir), dtype="float32", enforce_eager=True,
                      max_model_len=1024).create_engine_config()


def test_an_export_without_base_window_is_refused_naming_its_config(export, tmp_path):
    """The config class would default the window (128): a model trained with another W served wrong."""
    for extra in ({}, {"sliding_window": 16}):
        bad = tmp_path / f"export{len(extra)}"
        shutil.copytree(export, bad)
        config = json.loads((bad / "config.json").read_text())
        del config["base_window"]
        config.update(extra)
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(REFUSED) as info:
            build_config(bad)
        # The hook's message is one line (vLLM may wrap it in lines of its own).
        message = next(line for line in str(info.value).splitlines() if "has no base_window" in line)
        assert f"{bad / 'config.json'} has no base_window" in message and "orthros-convert to-hf" in message
        assert '"base_window": W' in message
        assert ("sliding_window is not read" in message) == bool(extra)


@pytest.mark.parametrize("sinks", [-1, 16, 2.5, True, "4"])
def test_bad_sink_tokens_are_refused(export, tmp_path, sinks):
    bad = tmp_path / "export"
    shutil.copytree(export, bad)
    config = json.loads((bad / "config.json").read_text())
    config["sink_tokens"] = sinks
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(REFUSED, match="sink_tokens"):
        build_config(bad)


def test_an_export_without_sink_tokens_serves_as_zero(export, tmp_path):
    from orthros_train.serve.config import served_sink_tokens

    old = tmp_path / "export"
    shutil.copytree(export, old)
    config = json.loads((old / "config.json").read_text())
    del config["sink_tokens"]
    (old / "config.json").write_text(json.dumps(config))
    assert served_sink_tokens(build_config(old).model_config.hf_config, 1024) == 0
    assert served_sink_tokens(build_config(export).model_config.hf_config, 1024) == S
