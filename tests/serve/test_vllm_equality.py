"""vLLM serving an Orthros export gives the project's own generate: greedy tokens and top-k logprobs.

Each case runs vLLM's engine (CPU backend, fp32, eager; one case compiled, vLLM's CPU default) on
a tiny `orthros-convert to-hf` export and compares with ``orthros_train.infer.generate`` (prefill +
decode on the project's model):
the base window smaller than the prompts, a mixed-length batch, chunked prefill with a small token
budget, prefix caching over shared prefixes and KV-block pressure (preemption and recompute); and,
with gamma = 1, beta = 0 and W >= length, vLLM's own Llama on the same weights; prompt logprobs
against the project's full-sequence log-probs, and speculative decoding (n-gram, a draft model)
against plain greedy decoding. What the design cannot serve is refused when the engine's config is
built.

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
    PROMPT_LOGPROBS_REFUSAL_V2,
    PROMPT_LOGPROBS_ROWS,
    add_prompt_logprobs_rows,
)
from orthros_train.serve.refusal import OrthrosServeError  # noqa: E402

NEW = 6  # tokens generated per request
# Refused when the engine's config is built: the plugin hook's one-line error, or the export's config
# class's own ValueError where it rejects a value first.
REFUSED = (ValueError, OrthrosServeError)
TOP_K = 4
PROMPT_TOP_K = 5  # prompt_logprobs=5, as lm-eval and the OpenAI API ask
LOGPROB_TOL = 2e-4  # fp32 on both sides; the CPU kernels sum in another order
ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=32 << 20, seed=0,
                   max_logprobs=PROMPT_TOP_K)
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


def full_sequence_logprobs(model, prompt):
    """The project's log-softmax at every position of ``prompt`` (the pretraining layout)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits.float().reshape(len(prompt), -1)
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs(out, model, prompt):
    """vLLM's prompt logprobs (top-5 and the prompt token's own) equal the full-sequence ones; returns
    the largest difference."""
    want = full_sequence_logprobs(model, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for i, entry in enumerate(got[1:]):  # entry i scores prompt token i + 1 from position i
        top = torch.topk(want[i], PROMPT_TOP_K).indices.tolist()
        assert set(top) <= set(entry), f"position {i}: top-{PROMPT_TOP_K} ids differ"
        assert prompt[i + 1] in entry
        for tok, lp in entry.items():
            worst = max(worst, abs(lp.logprob - float(want[i, tok])))
    assert worst <= LOGPROB_TOL, worst
    return worst


def test_prompt_logprobs_equal_full_sequence_logprobs_beside_plain_requests(tiny, roomy):
    """A request with prompt_logprobs=5 gets an output token at every prompt position (that request
    only): its values are the project's full-sequence log-probs, and the plain requests of the same
    step answer as without it (tokens and logprobs equal generate)."""
    model, _ = tiny
    prompts = prompts_of([40, 300, 129, 17], seed=8)  # W = 16 below every length
    asks = [True, False, True, False]
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True,
                             prompt_logprobs=PROMPT_TOP_K if a else None) for a in asks]
    outs = roomy.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    for out, prompt, a in zip(outs, prompts, asks):
        if a:
            assert_prompt_logprobs(out, model, prompt)
        else:
            assert out.prompt_logprobs is None
    assert_same(outs, model, prompts)


def test_prompt_logprobs_over_prefill_chunks(tiny, tight):
    """Under a 64-token step budget a 300-token prompt arrives in five chunks: every chunk's rows get
    output tokens, beside another request's chunks and decode steps."""
    model, _ = tiny
    prompts = prompts_of([300, 150], seed=9)
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True,
                             prompt_logprobs=PROMPT_TOP_K),
              SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True)]
    outs = tight.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert_prompt_logprobs(outs[0], model, prompts[0])
    assert_same(outs, model, prompts)


def run_speculative_engine(export, spec, prompts, new):
    """(tokens, per-step logprobs, acceptance counters) of an engine with ``spec``, run in its own
    process (``spec_engine.py`` says why)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "spec_engine.py"
    proc = subprocess.run([sys.executable, str(script), str(export), json.dumps(spec), json.dumps(prompts), str(new),
                           str(TOP_K)], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    return result["tokens"], result["logprobs"], result["counts"]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_the_greedy_tokens(tiny, tmp_path, method):
    """A verification step gives every draft position an output token (the last 1 + k rows of each
    request); vLLM's rejection sampler then accepts what the target's greedy choice agrees with, so
    the tokens and their logprobs are generate's. Drafts are proposed and some accepted (the rate
    is printed; bench/serve.py --speculative reports it at scale)."""
    model, export = tiny
    g = torch.Generator().manual_seed(10)
    motif = torch.randint(1, 384, (12,), generator=g).tolist()
    prompts = [motif * 5, *prompts_of([200, 33], seed=11), motif[:5] * 9]  # repeats for the n-gram lookup
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:  # the export's dense Llama twin drafts (no window, no affine: it often disagrees)
        spec = {"method": "draft_model", "model": str(make_llama_twin(export, tmp_path / "draft")),
                "num_speculative_tokens": 3}
    tokens, logprobs, counts = run_speculative_engine(export, spec, prompts, new=24)
    want_tokens, want_lp = reference(model, prompts, new=24)
    assert tokens == want_tokens
    for i, steps in enumerate(logprobs):
        for step, (entry, lp) in enumerate(zip(steps, want_lp[i])):
            for tok in torch.topk(lp, TOP_K).indices.tolist():
                assert abs(entry[str(tok)] - float(lp[tok])) <= LOGPROB_TOL, (i, step, tok)
    assert counts["draft_tokens"] > 0 and counts["accepted"] > 0, counts
    print(f"{method}: accepted {counts['accepted']} of {counts['draft_tokens']} draft tokens "
          f"({counts['accepted'] / counts['draft_tokens']:.0%})")


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
        (dict(pipeline_parallel_size=2), "pipeline parallelism is not supported by Orthros.*tensor parallelism"),
        (dict(tensor_parallel_size=3), "num_attention_heads=4 is not divisible by --tensor-parallel-size 3"),
    ]
    for extra, message in refused:
        with pytest.raises(REFUSED, match=message):
            EngineArgs(**base, **extra).create_engine_config()
    config = EngineArgs(**base).create_engine_config()
    assert config.model_config.logits_processors == [PROMPT_LOGPROBS_ROWS]
    # Methods whose drafts read the target's hidden states (vLLM checks their draft model first, so
    # the hook is called here on the built config with the method swapped in).
    from orthros_train.serve.config import check_serving_config

    for method in ("eagle", "eagle3", "mtp", "medusa"):
        config.speculative_config = type("S", (), {"method": method})()
        with pytest.raises(REFUSED, match=f"speculative decoding with method '{method}' is not supported by "
                                             "Orthros.*ngram, ngram_gpu, suffix, draft_model"):
            check_serving_config(config)
    # Speculative decoding: vLLM takes no custom logits processor, so none is added.
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = EngineArgs(**base, speculative_config=spec).create_engine_config()
    assert not config.model_config.logits_processors


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.mark.parametrize(
    "routing",
    [dict(moe_routing="tied", shared_expert_intermediate_size=32), dict(moe_routing="joint"),
     dict(moe_routing="independent", norm_topk_prob=False, decoder_sparse_step=2)],
    ids=["tied-shared-expert", "joint", "independent-unnormalised-every-second-layer"],
)
def test_mixture_of_experts_equals_generate(tmp_path, routing):
    """Sparse layers on vLLM's fused MoE layer with the checkpoint's routing policy: an output token
    paired with its base token's routing as the project's model pairs them (prefill: the last prompt
    token; decode: every new token)."""
    ckpt, export = make_orthros(tmp_path, seed=12, **MOE, **routing)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    assert model.config.sparse_layers
    prompts = prompts_of([40, 300, 17], seed=13)
    with engine(export) as llm:
        assert_same(vllm_run(llm, prompts), model, prompts)


def test_mixture_of_experts_compiled_engine_equals_generate(tmp_path, monkeypatch):
    """The routing (the pairing of output and base rows) is traced with the rest of the model."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    ckpt, export = make_orthros(tmp_path, seed=14, **MOE, moe_routing="tied")
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    with engine(export, enforce_eager=False) as llm:
        for prompts in (prompts_of([40, 300, 17], seed=15), prompts_of([50], seed=16)):
            assert_same(vllm_run(llm, prompts), model, prompts)


@pytest.mark.parametrize("window", [0, -3, "abc", None, 2.5, True])
def test_a_bad_base_window_is_refused_when_the_config_is_built(tiny, tmp_path, window):
    import json
    import shutil

    export = tmp_path / "export"
    shutil.copytree(tiny[1], export)
    config = json.loads((export / "config.json").read_text())
    config["base_window"] = window
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(REFUSED, match="base_window in config.json must be a positive integer"):
        EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024).create_engine_config()


def test_model_runner_v2_refuses_prompt_logprobs():
    """Model Runner V2 (GPU) tells logits processors about requests only after the forward, too late
    for the model to give their prompts output tokens: its front end refuses prompt logprobs (checked
    here through vLLM's V2 loader, no GPU needed) and names the V1 runner that serves them."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors_params_validator

    class Config:  # the fields add_prompt_logprobs_rows reads
        use_v2_model_runner = True
        speculative_config = None
        model_config = type("M", (), {"logits_processors": ["user.module:Theirs"]})()

    config = Config()
    add_prompt_logprobs_rows(config)
    add_prompt_logprobs_rows(config)  # idempotent
    assert config.model_config.logits_processors == ["user.module:Theirs", PROMPT_LOGPROBS_REFUSAL_V2]
    validate = build_custom_logits_processors_params_validator([PROMPT_LOGPROBS_REFUSAL_V2])
    validate(SamplingParams(max_tokens=2, logprobs=2))
    with pytest.raises(VLLMValidationError, match="VLLM_USE_V2_MODEL_RUNNER=0.*drop prompt_logprobs"):
        validate(SamplingParams(max_tokens=2, prompt_logprobs=1))
    from orthros_train.serve.prompt_logprobs import RefusePromptLogprobsV2

    assert RefusePromptLogprobsV2(None, None).add_request(0, SamplingParams()) is False  # never applied


def test_output_attention_splits_piecewise_cuda_graphs(tiny):
    """Off the CPU the engine keeps vLLM's CUDA graphs (no forced eager mode): the output attention is
    one of the splitting ops of piecewise graphs, as vLLM's own attention is (checked on the config
    vLLM builds for piecewise compilation, no GPU needed); a user's own list gets it appended."""
    from vllm.config import CompilationConfig, CompilationMode

    from orthros_train.serve.config import (
        BASE_ATTENTION_OP,
        GLOBAL_ATTENTION_OP,
        OUTPUT_ATTENTION_OP,
        split_graphs_at_output_attention,
    )

    _, export = tiny
    assert not EngineArgs(model=str(export), dtype="float32", max_model_len=1024).create_engine_config() \
        .model_config.enforce_eager
    assert OUTPUT_ATTENTION_OP in CompilationConfig._attention_ops
    piecewise = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    piecewise.set_splitting_ops_for_v1(all2all_backend="naive")
    assert {OUTPUT_ATTENTION_OP, BASE_ATTENTION_OP, GLOBAL_ATTENTION_OP} <= set(piecewise.splitting_ops)
    assert "vllm::unified_attention_with_output" in piecewise.splitting_ops

    class Config:
        compilation_config = type("C", (), {"splitting_ops": ["vllm::unified_attention_with_output"]})()

    config = Config()
    split_graphs_at_output_attention(config)
    split_graphs_at_output_attention(config)  # idempotent
    assert config.compilation_config.splitting_ops == ["vllm::unified_attention_with_output", OUTPUT_ATTENTION_OP,
                                                       BASE_ATTENTION_OP, GLOBAL_ATTENTION_OP]


SINKS = 4  # a converted model's usual choice; W = 16 is below every prompt, so every long row needs them


@pytest.fixture(scope="module")
def sinky():
    """A tiny export with sink tokens (``sink_tokens = 4`` in config.json, W = 16)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as root:
        ckpt, export = make_orthros(Path(root), seed=20, sink_tokens=SINKS)
        yield OrthrosForCausalLM.from_pretrained(ckpt).eval(), export


def test_sink_tokens_change_what_the_model_says(sinky):
    """The equality tests below are evidence only if the sinks matter: without them the same weights
    say something else."""
    model, _ = sinky
    with_sinks = generate(model, MIXED, max_new_tokens=NEW).sequences
    model.config.sink_tokens = 0
    try:
        without = generate(model, MIXED, max_new_tokens=NEW).sequences
    finally:
        model.config.sink_tokens = SINKS
    assert with_sinks != without


@pytest.fixture(scope="module")
def sink_compiled(sinky, tmp_path_factory):
    """The export with sinks as users run it on CPU (compiled, prefix caching): the base stream's op
    inside vLLM's compiled model."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        with engine(sinky[1], enforce_eager=False, enable_prefix_caching=True) as llm:
            yield llm


def test_sink_tokens_mixed_batch_compiled_equals_generate(sinky, sink_compiled):
    model, _ = sinky
    assert sink_compiled.llm_engine.model_config.hf_config.sink_tokens == SINKS
    for prompts in (MIXED, prompts_of([50], seed=21)):
        assert_same(vllm_run(sink_compiled, prompts), model, prompts)


def test_sink_tokens_with_prefix_caching_and_prompt_logprobs(sinky, sink_compiled):
    """A cached prefix holds the sinks of every request that shares it; prompt logprobs run the
    request's prompt in the pretraining layout over a base stream with sinks."""
    model, _ = sinky
    shared = prompts_of([300], seed=22)[0]
    prompts = [shared + t for t in prompts_of([5, 40], seed=23)]
    first = vllm_run(sink_compiled, prompts[:1])
    rest = vllm_run(sink_compiled, prompts[1:])
    assert rest[0].num_cached_tokens >= 256
    assert_same(first + rest, model, prompts)
    prompt = prompts_of([129], seed=24)[0]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True,
                            prompt_logprobs=PROMPT_TOP_K)
    out = sink_compiled.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    assert_prompt_logprobs(out[0], model, prompt)
    assert_same(out, model, [prompt])


def test_sink_tokens_chunked_prefill_and_block_pressure_equal_generate(sinky):
    """64-token steps (a 600-token prompt in ten chunks: later chunks read the sinks from the cache,
    beside decode steps) and ten KV blocks (preemption and recompute)."""
    model, export = sinky
    with engine(export, max_num_batched_tokens=64, kv_cache_memory_bytes=TEN_BLOCKS,
                enable_prefix_caching=False) as llm:
        assert_same(vllm_run(llm, MIXED), model, MIXED)
        prompts = prompts_of([250, 240, 230, 260, 200, 245], seed=25)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert blocks < sum(-(-(len(p) + 24) // 128) for p in prompts), "no block pressure to test"
        assert_same(vllm_run(llm, prompts, 24), model, prompts, 24)
