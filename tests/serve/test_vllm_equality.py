"""vLLM serving an Orthros export gives the project's own generate: greedy tokens and top-k logprobs.

Each case runs vLLM's engine (CPU backend, fp32, eager) on a tiny `orthros-convert to-hf` export
and compares with ``orthros_train.infer.generate`` (prefill + decode on the project's model):
the base window smaller than the prompts, a mixed-length batch, chunked prefill with a small token
budget, prefix caching over shared prefixes and KV-block pressure (preemption and recompute); and,
with gamma = 1, beta = 0 and W >= length, vLLM's own Llama on the same weights.
"""

from __future__ import annotations

import contextlib
import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from exports import make_llama_twin, make_orthros  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from orthros_train.infer.generate import decode, generate, prefill  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402

NEW = 6  # tokens generated per request
TOP_K = 4
LOGPROB_TOL = 2e-4  # fp32 on both sides; the CPU kernels sum in another order


@contextlib.contextmanager
def engine(model_dir, **kwargs):
    """A vLLM engine on ``model_dir`` (fp32, eager, small), shut down afterwards."""
    args = dict(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=32 << 20, seed=0,
                max_logprobs=TOP_K)
    llm = LLM(model=str(model_dir), **{**args, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def vllm_run(llm, prompts, new=NEW):
    params = SamplingParams(max_tokens=new, temperature=0.0, logprobs=TOP_K, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outs


def reference(model, prompts, new=NEW):
    """(greedy tokens, per-step log-softmax [new, V]) from the project's prefill + decode."""
    rows = [torch.tensor(p) for p in prompts]
    logits, cache = prefill(model, rows, chunk_size=None)
    tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(new):
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = lp.argmax(-1)
        for i in range(len(prompts)):
            tokens[i].append(int(nxt[i]))
            logprobs[i].append(lp[i])
        logits = decode(model, nxt, cache)
    return tokens, logprobs


def assert_same(outs, model, prompts, new=NEW):
    want_tokens, want_lp = reference(model, prompts, new)
    assert generate(model, prompts, max_new_tokens=new).sequences == want_tokens  # the loop is generate's
    for i, out in enumerate(outs):
        got = out.outputs[0]
        assert list(got.token_ids) == want_tokens[i], f"request {i} (prompt length {len(prompts[i])})"
        for step, (entry, lp) in enumerate(zip(got.logprobs, want_lp[i])):
            top = torch.topk(lp, TOP_K)
            want_ids = top.indices.tolist()
            assert set(want_ids) <= set(entry), f"request {i} step {step}: top-{TOP_K} ids differ"
            for tok in want_ids:
                assert abs(entry[tok].logprob - float(lp[tok])) <= LOGPROB_TOL, (i, step, tok)


def prompts_of(lengths, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny export with W = 16 (every prompt below is longer) and trained-looking gamma/beta."""
    ckpt, export = make_orthros(tmp_path_factory.mktemp("orthros"))
    return OrthrosForCausalLM.from_pretrained(ckpt).eval(), export


def test_window_smaller_than_prompt_mixed_batch_and_chunked_prefill(tiny):
    model, export = tiny
    mixed = prompts_of([40, 300, 17, 129, 600])
    # A 64-token budget: the long prompts arrive in chunks, each chunk's last row gets an output
    # query whose sample is discarded, and decode steps share batches with prefill chunks.
    with engine(export, max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True) as llm:
        assert_same(vllm_run(llm, mixed), model, mixed)
    with engine(export) as llm:  # the whole batch in one step
        assert_same(vllm_run(llm, mixed), model, mixed)


def test_prefix_caching_with_shared_prefixes(tiny):
    model, export = tiny
    shared = prompts_of([300], seed=1)[0]
    tails = prompts_of([5, 40, 90], seed=2)
    prompts = [shared + t for t in tails]
    with engine(export, enable_prefix_caching=True) as llm:
        first = vllm_run(llm, prompts[:1])
        rest = vllm_run(llm, prompts[1:])
        # The CPU backend's blocks hold 128 tokens: the 256 tokens of the shared prefix's full blocks.
        assert all(o.num_cached_tokens >= 256 for o in rest), [o.num_cached_tokens for o in rest]
        assert_same(first + rest, model, prompts)


def test_kv_block_pressure_preempts_and_recomputes_exactly(tiny):
    model, export = tiny
    prompts = prompts_of([250, 240, 230, 260, 200, 245], seed=3)
    new = 24
    with engine(export, kv_cache_memory_bytes=10 * 128 * 2 * 2 * 2 * 32 * 4, max_num_batched_tokens=256,
                enable_prefix_caching=False) as llm:
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        need = sum(-(-(len(p) + new) // 128) for p in prompts)
        assert blocks < need, f"{blocks} KV blocks hold every request ({need}): no pressure to test"
        assert_same(vllm_run(llm, prompts, new), model, prompts, new)


@pytest.mark.parametrize(
    "variant",
    [
        dict(qk_norm=True, attention_bias=True, num_key_value_heads=1),  # Qwen2/Qwen3 parts, MQA
        dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}),
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ],
    ids=["qwen-qk-norm-bias-mqa", "tied-linear-rope", "llama3-rope", "yarn-rope"],
)
def test_model_variants_equal_generate(tmp_path, variant):
    ckpt, export = make_orthros(tmp_path, seed=4, **variant)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    prompts = prompts_of([33, 200], seed=5)
    with engine(export) as llm:
        assert_same(vllm_run(llm, prompts), model, prompts)


def test_identity_affine_and_full_window_equals_vllm_llama(tmp_path):
    """gamma = 1, beta = 0, W >= length: the Orthros model is the dense Llama of the same weights."""
    _, export = make_orthros(tmp_path, seed=6, trained_affine=False, sliding_window=1024)
    llama = make_llama_twin(export, tmp_path / "llama")
    prompts = prompts_of([20, 150, 400], seed=7)
    with engine(export) as llm:
        ours = vllm_run(llm, prompts, new=12)
    with engine(llama) as llm:
        theirs = vllm_run(llm, prompts, new=12)
    for a, b in zip(ours, theirs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in eb.items():
                assert tok in ea and abs(ea[tok].logprob - lp.logprob) <= LOGPROB_TOL


def test_unservable_configurations_are_refused_at_start(tiny):
    """The engine refuses what one output token per request per step cannot do, naming the fix."""
    from orthros_train.serve.model import OrthrosServeError, check_serving_config

    _, export = tiny

    class Cfg:  # a VllmConfig-shaped stand-in: building real ones needs a second draft model
        def __init__(self, spec=None, pp=1, tp=1):
            self.speculative_config = spec
            self.parallel_config = type("P", (), {"pipeline_parallel_size": pp, "tensor_parallel_size": tp})()
            hf = type("H", (), {"num_attention_heads": 4, "base_window": 16})()
            self.model_config = type("M", (), {"hf_config": hf})()

    with pytest.raises(OrthrosServeError, match="speculative decoding"):
        check_serving_config(Cfg(spec=object()))
    with pytest.raises(OrthrosServeError, match="pipeline parallelism.*tensor parallelism"):
        check_serving_config(Cfg(pp=2))
    with pytest.raises(OrthrosServeError, match="not divisible by --tensor-parallel-size 3"):
        check_serving_config(Cfg(tp=3))
    check_serving_config(Cfg())
    # vLLM itself refuses pipeline parallelism for a model without its SupportsPP interface.
    with pytest.raises(Exception, match="(?i)pipeline parallelism is not supported"):
        with engine(export, pipeline_parallel_size=2, distributed_executor_backend="mp"):
            pass
