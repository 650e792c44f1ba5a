"""The GPU paths of the served model, marked ``gpu`` (skipped on CPU; ``pytest -m gpu`` on a CUDA
machine with vLLM's GPU build): the output attention through vLLM's FlashAttention against the plain
gather, and an engine with CUDA graphs (piecewise and full decode) whose greedy tokens equal the
project's ``generate`` (decode batches of captured sizes, a mixed step, speculative verification,
prompt logprobs under the V1 runner)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

pytestmark = pytest.mark.gpu


def test_flash_attention_output_call_equals_the_plain_gather():
    """The call the model makes (several causal output rows per request, one query per request in
    decode) on the FlashAttention cache layout, against the reference with per-row key counts."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

    from orthros_train.serve.output_rows import OutputRows
    from orthros_train.serve.paged_attention import paged_output_attention_reference

    g = torch.Generator().manual_seed(0)
    blocks, block_size, h_kv, h_q, d = 64, 16, 2, 8, 128
    kv = torch.randn(blocks, h_kv, block_size, 2 * d, generator=g).to("cuda", torch.bfloat16)
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)  # as the model views vLLM's cache
    seq = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda")
    table = torch.randperm(blocks, generator=g)[:3 * 20].view(3, 20).to(torch.int32).cuda()
    out_qsl = torch.tensor([0, 1, 5, 8], dtype=torch.int32, device="cuda")  # 1, 4 and 3 output rows
    q = torch.randn(8, h_q, d, generator=g).to("cuda", torch.bfloat16)
    out = torch.empty_like(q)
    flash_attn_varlen_func(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=out_qsl, max_seqlen_q=4,
                           seqused_k=seq, max_seqlen_k=300, softmax_scale=d**-0.5, causal=True, window_size=None,
                           block_table=table, fa_version=get_flash_attn_version())
    plan = OutputRows(rows=torch.arange(8, device="cuda"), query_start_loc=out_qsl, count=8, max_query_len=4,
                      every_row=False)
    request, keys = plan.row_requests(seq)
    want = paged_output_attention_reference(q, key_cache, value_cache, table, keys, None, row_request=request)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_engine_with_cuda_graphs_equals_generate(tmp_path):
    from exports import make_orthros
    from vllm import LLM, SamplingParams
    from vllm.config import CUDAGraphMode
    from vllm.inputs import TokensPrompt

    from orthros_train.infer.generate import generate
    from orthros_train.model.orthros import OrthrosForCausalLM

    ckpt, export = make_orthros(tmp_path, head_dim=64)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval().cuda()
    g = torch.Generator().manual_seed(1)
    llm = LLM(model=str(export), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3, seed=0,
              max_logprobs=5)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for lengths in ([40], [40, 300, 17, 129], [5] * 16, [600, 3, 3, 3]):  # decode sizes 1, 4, 16; a mixed step
            prompts = [torch.randint(1, 384, (n,), generator=g).tolist() for n in lengths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
            with torch.no_grad():
                want = generate(model, prompts, max_new_tokens=8).sequences
            assert [list(o.outputs[0].token_ids) for o in outs] == want, lengths
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_paged_window_kernel_with_sinks_equals_the_plain_gather():
    """The base stream's call with sink tokens on CUDA (bf16, the cache as the model views vLLM's):
    rows of several requests, a decode row and padding rows."""
    from orthros_train.serve.output_rows import every_row
    from orthros_train.serve.paged_attention import paged_output_attention_reference, paged_window_attention

    g = torch.Generator().manual_seed(2)
    blocks, block_size, h_kv, h_q, d = 64, 16, 2, 8, 128
    kv = torch.randn(blocks, h_kv, block_size, 2 * d, generator=g).to("cuda", torch.bfloat16)
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    seq = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda")
    table = torch.randperm(blocks, generator=g)[:3 * 20].view(3, 20).to(torch.int32).cuda()
    qsl = torch.tensor([0, 40, 57, 58], dtype=torch.int32, device="cuda")  # a chunk, a whole prompt, a decode row
    request, keys = every_row(qsl, 64, 58, 40).row_requests(seq)
    q = torch.randn(64, h_q, d, generator=g).to("cuda", torch.bfloat16)
    out = paged_window_attention(q, key_cache, value_cache, table, request, keys, window=32, sink_tokens=4)
    want = paged_output_attention_reference(q, key_cache, value_cache, table, keys, None, row_request=request,
                                            window=32, sink_tokens=4)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.count_nonzero(out[58:]) == 0


def _compiled_variants(kernel) -> int | None:
    """How many compiled variants a Triton kernel holds (None where this Triton keeps them elsewhere)."""
    caches = getattr(kernel, "device_caches", None)
    if not caches:
        return None
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize("runner_v2", [False, True], ids=["v1-runner", "model-runner-v2"])
def test_engine_with_sink_tokens_and_cuda_graphs_equals_generate(tmp_path, monkeypatch, runner_v2):
    """Sink tokens on GPU: the base stream on the Triton kernel (piecewise graphs: between pieces;
    full decode graphs: captured), the layout checked and the kernels compiled when the model loads,
    none compiled later (no compile inside a capture). Decode batches of 3 and 5 requests are padded
    to captured sizes (Model Runner V2 pads requests too: their rows go to the scratch row)."""
    from exports import make_orthros
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from orthros_train.infer.generate import generate
    from orthros_train.model.orthros import OrthrosForCausalLM
    from orthros_train.serve import paged_attention

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner_v2 else "0")
    ckpt, export = make_orthros(tmp_path, head_dim=64, sink_tokens=4)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval().cuda()
    g = torch.Generator().manual_seed(3)
    llm = LLM(model=str(export), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3, seed=0)
    try:
        assert paged_attention.is_compiled(torch.device("cuda", torch.cuda.current_device()), torch.float32, 4, 2, 64)
        variants = _compiled_variants(paged_attention._paged_split_kernel)
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for lengths in ([40], [40, 300, 17], [5] * 5, [600, 3, 3, 3]):
            prompts = [torch.randint(1, 384, (n,), generator=g).tolist() for n in lengths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
            with torch.no_grad():
                want = generate(model, prompts, max_new_tokens=8).sequences
            assert [list(o.outputs[0].token_ids) for o in outs] == want, lengths
        if variants is not None:
            assert _compiled_variants(paged_attention._paged_split_kernel) == variants
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("sinks", [0, 4])
def test_engine_with_a_global_tail_and_cuda_graphs_equals_generate(tmp_path, monkeypatch, sinks):
    """The global tail on GPU (V1 runner: the prompt lengths reach the model before the forward):
    the tail rows through the per-row Triton kernel after vLLM's windowed attention (S = 0) or the
    model's own op (S = 4), piecewise graphs in mixed steps and full graphs in decode (the prompt
    lengths read from their fixed device buffer at replay), a prompt chunked by a 64-token budget."""
    import json

    from exports import make_orthros
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from orthros_train.infer.generate import generate
    from orthros_train.model.orthros import OrthrosForCausalLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    ckpt, export = make_orthros(tmp_path, head_dim=64, sink_tokens=sinks, base_global_tail=24)
    config = json.loads((export / "config.json").read_text())
    config["base_global_tail"] = 24
    (export / "config.json").write_text(json.dumps(config))
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval().cuda()
    g = torch.Generator().manual_seed(4)
    llm = LLM(model=str(export), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3, seed=0,
              max_num_batched_tokens=64)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for lengths in ([40], [40, 300, 17], [5] * 5, [600, 3, 3, 3]):
            prompts = [torch.randint(1, 384, (n,), generator=g).tolist() for n in lengths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
            with torch.no_grad():
                want = generate(model, prompts, max_new_tokens=8).sequences
            assert [list(o.outputs[0].token_ids) for o in outs] == want, lengths
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_cache_layout_the_model_does_not_read_is_refused_at_load(tmp_path):
    """An fp8 cache (the Triton kernels have no scales) stops the engine when the model loads, with
    the fix, instead of serving wrong tokens."""
    from exports import make_orthros
    from vllm import LLM

    _, export = make_orthros(tmp_path, head_dim=64)
    with pytest.raises(Exception, match="--kv-cache-dtype auto"):
        LLM(model=str(export), dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
            kv_cache_dtype="fp8", enforce_eager=True)


@pytest.mark.parametrize("runner_v2", [False, True], ids=["v1-runner", "model-runner-v2"])
@pytest.mark.parametrize("full_graphs_with_ngram", [False, True], ids=["default-graphs", "full-graphs-ngram"])
def test_bf16_engine_on_the_default_backend_picks_the_fp32_model_s_tokens(tmp_path, monkeypatch, runner_v2,
                                                                          full_graphs_with_ngram):  # fmt: skip
    """The production path on Hopper: bf16, vLLM's default backend (FlashAttention 3 for the base
    stream; the output stream on it between graph pieces, on the Triton kernel inside full graphs,
    which Model Runner V2 captures with the forward context's mode at NONE), and full graphs with
    n-gram verification rows. bf16 rounding may flip a near tie, so each chosen token must be the
    fp32 model's argmax to within 0.15 nats, teacher-forced on the engine's own continuation."""
    from exports import make_orthros
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from orthros_train.model.orthros import OrthrosForCausalLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner_v2 else "0")
    ckpt, export = make_orthros(tmp_path, head_dim=64)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval().cuda()
    extra = {}
    if full_graphs_with_ngram:
        extra = {"compilation_config": {"cudagraph_mode": "FULL"},
                 "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}
    llm = LLM(model=str(export), dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3, seed=0, **extra)
    g = torch.Generator().manual_seed(4)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for lengths in ([40], [40, 300, 17, 129], [5] * 5, [600, 3, 3, 3]):
            # repeated stretches give the n-gram drafter something to propose
            prompts = [(torch.randint(1, 384, (max(n // 2, 1),), generator=g).repeat(2)[:n]).tolist() for n in lengths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
            for prompt, o in zip(prompts, outs):
                tokens = list(o.outputs[0].token_ids)
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
                logp = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)
                chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, device="cuda")]
                assert (logp.max(-1).values - chosen).max() < 0.15, (lengths, tokens)
    finally:
        llm.llm_engine.engine_core.shutdown()
