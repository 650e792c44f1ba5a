"""vLLM serving an Orthros export gives the project's own generate: greedy tokens and top-k logprobs.

Each case runs vLLM's engine (CPU backend, fp32, eager; one case compiled, vLLM's CPU default) on
a tiny `orthros-convert to-hf` export and compares with ``orthros_train.infer.generate`` (prefill +
decode on the project's model):
the base window smaller than the prompts, a mixed-length batch, chunked prefill with a small token
budget, prefix caching over shared prefixes and KV-block pressure (preemption and recompute); and,
with gamma = 1, beta = 0 and W >= length, vLLM's own Llama on the same weights. What the design
cannot serve is refused: settings when the engine's config is built, prompt logprobs per request.

Starting and stopping an engine costs seconds (vLLM collects garbage over every object its imports
made, several times), so cases that can run on the same engine settings share a module-scoped one.
"""

from __future__ import annotations

import contextlib
import gc

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from exports import make_llama_twin, make_orthros  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from orthros_train.infer.generate import decode, generate, prefill  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402
from orthros_train.serve.config import (  # noqa: E402
    PROMPT_LOGPROBS_REFUSAL,
    PROMPT_LOGPROBS_REFUSAL_V2,
    add_prompt_logprobs_refusal,
)

NEW = 6  # tokens generated per request
TOP_K = 4
LOGPROB_TOL = 2e-4  # fp32 on both sides; the CPU kernels sum in another order
ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=32 << 20, seed=0,
                   max_logprobs=TOP_K)
# Ten KV blocks of the CPU backend's 128 tokens for the tiny export (2 layers, 2 kv heads of 32, fp32, K and V).
TEN_BLOCKS = 10 * 128 * 2 * 2 * 2 * 32 * 4


@contextlib.contextmanager
def engine(model_dir, **kwargs):
    """A vLLM engine on ``model_dir`` (fp32, eager, small), shut down afterwards."""
    llm = LLM(model=str(model_dir), **{**ENGINE_ARGS, **kwargs})
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


MIXED = prompts_of([40, 300, 17, 129, 600])  # W = 16 is below every length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny export with W = 16 (every prompt below is longer) and trained-looking gamma/beta."""
    ckpt, export = make_orthros(tmp_path_factory.mktemp("orthros"))
    return OrthrosForCausalLM.from_pretrained(ckpt).eval(), export


@pytest.fixture(scope="module")
def roomy(tiny):
    """The default engine with prefix caching: a whole batch prefills in one step."""
    with engine(tiny[1], enable_prefix_caching=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def tight(tiny):
    """A 64-token step budget and ten KV blocks: prompts arrive in chunks, and requests outgrow
    the cache (preemption, then recompute: prefix caching off so nothing is served from it)."""
    with engine(tiny[1], max_num_batched_tokens=64, kv_cache_memory_bytes=TEN_BLOCKS,
                enable_prefix_caching=False) as llm:
        yield llm


def test_window_smaller_than_prompt_mixed_batch_in_one_step(tiny, roomy):
    model, _ = tiny
    assert_same(vllm_run(roomy, MIXED), model, MIXED)


def test_prefix_caching_with_shared_prefixes(tiny, roomy):
    model, _ = tiny
    shared = prompts_of([300], seed=1)[0]
    tails = prompts_of([5, 40, 90], seed=2)
    prompts = [shared + t for t in tails]
    first = vllm_run(roomy, prompts[:1])
    rest = vllm_run(roomy, prompts[1:])
    # The CPU backend's blocks hold 128 tokens: the 256 tokens of the shared prefix's full blocks.
    assert all(o.num_cached_tokens >= 256 for o in rest), [o.num_cached_tokens for o in rest]
    assert_same(first + rest, model, prompts)


def test_chunked_prefill_on_a_small_token_budget(tiny, tight):
    # Each chunk's last row gets an output query whose sample is discarded, and decode steps share
    # batches with prefill chunks; the 600-token prompt alone takes ten steps.
    model, _ = tiny
    assert max(map(len, MIXED)) > 64 * 9
    assert_same(vllm_run(tight, MIXED), model, MIXED)


def test_kv_block_pressure_preempts_and_recomputes_exactly(tiny, tight):
    model, _ = tiny
    prompts = prompts_of([250, 240, 230, 260, 200, 245], seed=3)
    new = 24
    blocks = tight.llm_engine.vllm_config.cache_config.num_gpu_blocks
    need = sum(-(-(len(p) + new) // 128) for p in prompts)
    assert blocks < need, f"{blocks} KV blocks hold every request ({need}): no pressure to test"
    assert_same(vllm_run(tight, prompts, new), model, prompts, new)


def test_prompt_logprobs_are_refused_per_request(tiny, roomy):
    """Only the last prompt row has an output token: asking for prompt logprobs fails the request
    with the reason, and the engine serves the next one."""
    model, _ = tiny
    prompt = prompts_of([50], seed=8)
    for n in (0, 3):
        with pytest.raises(VLLMValidationError, match="prompt logprobs are not available from an Orthros model"):
            roomy.generate([TokensPrompt(prompt_token_ids=prompt[0])],
                           SamplingParams(max_tokens=2, prompt_logprobs=n), use_tqdm=False)
    assert_same(vllm_run(roomy, prompt), model, prompt)


def test_compiled_engine_equals_generate(tiny, tmp_path, monkeypatch):
    """vLLM's default on CPU compiles the model (one dynamo trace, inductor): the output rows are a
    second dynamic size beside the token count, traced at two rows in the warm-up run, so that one
    request (one row) and a decode step of one token replay the same graph with the same results."""
    from vllm.compilation.counter import compilation_counter
    from vllm.config import CompilationMode

    model, export = tiny
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # compile afresh, not from a cache
    compiles = compilation_counter.num_aot_compiles + compilation_counter.num_models_seen
    with engine(export, enforce_eager=False) as llm:
        assert llm.llm_engine.vllm_config.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
        assert compilation_counter.num_aot_compiles + compilation_counter.num_models_seen > compiles
        for prompts in (MIXED, prompts_of([50], seed=4), prompts_of([7, 300], seed=5)):
            assert_same(vllm_run(llm, prompts), model, prompts)


@pytest.mark.parametrize(
    "variant",
    [
        # Qwen2/Qwen3 parts (q/k norms, q/k/v biases), MQA, with yarn RoPE
        dict(qk_norm=True, attention_bias=True, num_key_value_heads=1,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}),
    ],
    ids=["qwen-qk-norm-bias-mqa-yarn-rope", "tied-linear-rope", "llama3-rope"],
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


def test_two_tensor_parallel_ranks_equal_generate(tiny, monkeypatch):
    """Tensor parallelism from vLLM's parallel layers, gamma/beta split by query heads (2 heads a
    rank, 1 KV head a rank), two CPU worker processes over gloo."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two tensor-parallel CPU workers need two cores to bind their threads to")
    model, export = tiny
    # vLLM's CPU workers bind their threads per NUMA node by default; this machine kind has one.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    with engine(export, tensor_parallel_size=2, kv_cache_memory_bytes=16 << 20) as llm:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        assert_same(vllm_run(llm, MIXED), model, MIXED)


def test_unservable_configurations_are_refused_when_the_config_is_built(tiny):
    """vLLM runs the plugin's config hook when it builds an engine's config: before any engine."""
    _, export = tiny
    base = dict(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024)
    refused = [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
         "speculative decoding is not supported by Orthros"),
        (dict(pipeline_parallel_size=2), "pipeline parallelism is not supported by Orthros.*tensor parallelism"),
        (dict(tensor_parallel_size=3), "num_attention_heads=4 is not divisible by --tensor-parallel-size 3"),
    ]
    for extra, message in refused:
        with pytest.raises(ValueError, match=message):
            EngineArgs(**base, **extra).create_engine_config()
    config = EngineArgs(**base).create_engine_config()
    assert config.model_config.logits_processors == [PROMPT_LOGPROBS_REFUSAL]


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "abc", None])
def test_a_bad_base_window_is_refused_when_the_config_is_built(tiny, tmp_path, window):
    import json
    import shutil

    export = tmp_path / "export"
    shutil.copytree(tiny[1], export)
    config = json.loads((export / "config.json").read_text())
    config["base_window"] = window
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="base_window in config.json must be a positive integer"):
        EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024).create_engine_config()


def test_model_runner_v2_gets_its_own_refusal():
    """Model Runner V2 (GPU) loads only its own logits-processor interface; its front end must
    refuse prompt logprobs the same way (checked here through vLLM's V2 loader, no GPU needed)."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors_params_validator

    class Config:  # the two fields add_prompt_logprobs_refusal reads
        use_v2_model_runner = True
        model_config = type("M", (), {"logits_processors": ["user.module:Theirs"]})()

    config = Config()
    add_prompt_logprobs_refusal(config)
    add_prompt_logprobs_refusal(config)  # idempotent
    assert config.model_config.logits_processors == ["user.module:Theirs", PROMPT_LOGPROBS_REFUSAL_V2]
    validate = build_custom_logits_processors_params_validator([PROMPT_LOGPROBS_REFUSAL_V2])
    validate(SamplingParams(max_tokens=2, logprobs=2))
    with pytest.raises(VLLMValidationError, match="drop prompt_logprobs"):
        validate(SamplingParams(max_tokens=2, prompt_logprobs=1))
    from orthros_train.serve.prompt_logprobs import RefusePromptLogprobsV2

    assert RefusePromptLogprobsV2(None, None).add_request(0, SamplingParams()) is False  # never applied


def test_off_cpu_the_engine_runs_eagerly(tiny, monkeypatch):
    """CUDA graphs are captured per token count and cannot replay the output stream's per-request
    rows: off the CPU the config hook turns on eager mode (as --enforce-eager); on CPU the model
    compiles (vLLM's default there)."""
    import vllm.platforms

    from orthros_train.serve.config import run_eagerly_off_cpu

    _, export = tiny
    assert not EngineArgs(model=str(export), dtype="float32", max_model_len=1024).create_engine_config() \
        .model_config.enforce_eager

    class Gpu:
        device_name = "cuda"

        @staticmethod
        def is_cpu() -> bool:
            return False

    class Config:
        model_config = type("M", (), {"enforce_eager": False})()

    monkeypatch.setattr(vllm.platforms, "current_platform", Gpu())
    config = Config()
    run_eagerly_off_cpu(config)
    assert config.model_config.enforce_eager is True
