"""The global tail served by vLLM (``base_global_tail = R > 0`` in config.json): the base rows of each
request's last ``R`` prompt tokens and of its generated tokens attend every key of the request.

On a tiny export with ``W = 16``, ``S = 4`` and ``R = 24`` (prompts longer than ``W``): greedy
tokens and top-k logprobs equal the package's ``generate`` on a mixed batch, under chunked prefill
(a 64-token budget, prompts whose tail crosses a chunk boundary) and KV-block pressure; prompt
logprobs equal the package's full-sequence ones with the prompt's tail global; the GPU path's
kernel composition equals the key rule under the Triton interpreter; prefix caching is turned off
with a warning; what cannot learn the prompt lengths in time is refused in one line; ``R = 0``
serves as before.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from exports import make_orthros  # noqa: E402
from test_vllm_equality import (  # noqa: E402
    MIXED,
    NEW,
    PROMPT_TOP_K,
    TEN_BLOCKS,
    TOP_K,
    assert_same,
    engine,
    prompts_of,
    vllm_run,
)
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from orthros_train.errors import first_line  # noqa: E402
from orthros_train.infer.generate import generate  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402
from orthros_train.ops.keys import UNBOUNDED, allowed_keys, prompt_tail_flags  # noqa: E402
from orthros_train.phase.builders import positions_layout  # noqa: E402
from orthros_train.serve.config import (  # noqa: E402
    PROMPT_LENGTHS,
    PROMPT_LOGPROBS_ROWS,
    check_tail_serving,
    served_global_tail,
)
from orthros_train.serve.refusal import OrthrosServeError  # noqa: E402

W, S, R = 16, 4, 24
LOGPROB_TOL = 2e-4


def with_tail(export: Path, tail: int) -> None:
    """Write ``base_global_tail`` into an export's config.json (as ``to-hf`` does for a model with a tail)."""
    path = export / "config.json"
    config = json.loads(path.read_text())
    config["base_global_tail"] = tail
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def tailed(tmp_path_factory):
    """(model, export) with W = 16, S = 4, R = 24: every prompt below is longer than the window."""
    ckpt, export = make_orthros(tmp_path_factory.mktemp("tail"), seed=30, sink_tokens=S, base_global_tail=R)
    with_tail(export, R)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    assert model.config.base_global_tail == R
    return model, export


def test_the_tail_changes_what_the_model_says(tailed):
    """The equality tests below are evidence only if the tail matters."""
    model, _ = tailed
    with_tail_tokens = generate(model, MIXED, max_new_tokens=NEW).sequences
    model.config.base_global_tail = 0
    try:
        without = generate(model, MIXED, max_new_tokens=NEW).sequences
    finally:
        model.config.base_global_tail = R
    assert with_tail_tokens != without


@pytest.fixture(scope="module")
def roomy(tailed):
    """vLLM's defaults (prefix caching asked for): a whole batch prefills in one step."""
    with engine(tailed[1], enable_prefix_caching=True) as llm:
        yield llm


def test_mixed_batch_equals_generate(tailed, roomy):
    model, _ = tailed
    config = roomy.llm_engine.vllm_config
    assert config.model_config.logits_processors == [PROMPT_LOGPROBS_ROWS, PROMPT_LENGTHS]
    assert_same(vllm_run(roomy, MIXED), model, MIXED)
    # Requests that arrive one by one (decode steps beside a prefill of another request).
    singles = prompts_of([50, 17], seed=31)
    assert_same(vllm_run(roomy, singles[:1]) + vllm_run(roomy, singles[1:]), model, singles)


def test_prefix_caching_is_turned_off_and_a_shared_prefix_is_read_afresh(tailed, roomy):
    """A cached block would hold K/V computed for another request's tail or answer: with R > 0 the
    engine runs without prefix caching, so a request that shares a prefix (a chat's next turn: the
    earlier prompt and its answer) reads it afresh, and answers as ``generate`` on the whole prompt."""
    model, _ = tailed
    assert roomy.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    shared = prompts_of([300], seed=32)[0]
    first = vllm_run(roomy, [shared])
    turn = shared + list(first[0].outputs[0].token_ids) + prompts_of([20], seed=33)[0]
    prompts = [shared, turn, shared + prompts_of([5], seed=34)[0]]
    rest = vllm_run(roomy, prompts[1:])
    assert all(o.num_cached_tokens == 0 for o in rest), [o.num_cached_tokens for o in rest]
    assert_same(first + rest, model, prompts)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_prefix_caching_decision_is_logged_when_the_config_is_built(tailed):
    """Asked for or vLLM's default (the hook sees the same flag): off, with the reason in the log."""
    _, export = tailed
    records, log = Records(), logging.getLogger("orthros_train.serve.config")
    log.addHandler(records)
    try:
        for asked in (True, None):
            config = EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024,
                                enable_prefix_caching=asked).create_engine_config()
            assert config.cache_config.enable_prefix_caching is False
    finally:
        log.removeHandler(records)
    said = [m for m in records.messages if "base_global_tail=24: prefix caching is turned off" in m]
    assert len(said) == 2 and "only its last 24 tokens are the tail" in said[0]


def tail_full_sequence_logprobs(model, prompt):
    """The package's log-softmax at every position of ``prompt`` with the prompt's last R base tokens
    global: what a request with prompt logprobs reads (the pretraining layout, with the prefill's tail)."""
    ids = torch.tensor([prompt])
    layout = positions_layout(ids)
    layout = replace(layout, base_global=prompt_tail_flags(len(prompt), 0, len(prompt), R))
    layout.validate()
    with torch.no_grad():
        logits = model.forward_layout(layout).logits.float().reshape(len(prompt), -1)
    return torch.log_softmax(logits, dim=-1)


def assert_tail_prompt_logprobs(out, model, prompt):
    want = tail_full_sequence_logprobs(model, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for i, entry in enumerate(got[1:]):
        top = torch.topk(want[i], PROMPT_TOP_K).indices.tolist()
        assert set(top) <= set(entry), f"position {i}: top-{PROMPT_TOP_K} ids differ"
        for tok, lp in entry.items():
            worst = max(worst, abs(lp.logprob - float(want[i, tok])))
    assert worst <= LOGPROB_TOL, worst


def test_prompt_logprobs_equal_the_full_sequence_with_the_tail(tailed, roomy):
    model, _ = tailed
    prompts = prompts_of([129, 40], seed=35)
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True,
                             prompt_logprobs=PROMPT_TOP_K),
              SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True)]
    outs = roomy.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert_tail_prompt_logprobs(outs[0], model, prompts[0])
    # Without the tail the last R positions would differ: the reference is not the plain forward's.
    plain = torch.log_softmax(model(torch.tensor([prompts[0]])).logits.float().reshape(129, -1), dim=-1)
    assert not torch.allclose(plain[-R:], tail_full_sequence_logprobs(model, prompts[0])[-R:], atol=1e-3)
    assert_same(outs, model, prompts)


def test_chunked_prefill_and_block_pressure_equal_generate(tailed):
    """64-token steps: 129 = 64 + 64 + 1 and 600 = 9 x 64 + 24 end in a chunk shorter than R, so the
    chunk before holds tail rows; ten KV blocks preempt and recompute (generated tokens stay global)."""
    model, export = tailed
    with engine(export, max_num_batched_tokens=64, kv_cache_memory_bytes=TEN_BLOCKS) as llm:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        assert_same(vllm_run(llm, MIXED), model, MIXED)
        prompt = prompts_of([150], seed=36)[0]
        params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=TOP_K, ignore_eos=True,
                                prompt_logprobs=PROMPT_TOP_K)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        assert_tail_prompt_logprobs(out[0], model, prompt)
        prompts = prompts_of([250, 240, 230, 260, 200, 245], seed=37)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        assert blocks < sum(-(-(len(p) + 24) // 128) for p in prompts), "no block pressure to test"
        assert_same(vllm_run(llm, prompts, 24), model, prompts, 24)


def test_zero_tail_serves_as_before(tailed, tmp_path):
    """R = 0 (or absent, or a max_model_len within the window): no prompt-length processor, prefix
    caching as asked, the model's path without the global op."""
    _, export = tailed
    zero = tmp_path / "zero"
    shutil.copytree(export, zero)
    with_tail(zero, 0)
    config = EngineArgs(model=str(zero), dtype="float32", enforce_eager=True, max_model_len=1024,
                        enable_prefix_caching=True).create_engine_config()
    assert config.model_config.logits_processors == [PROMPT_LOGPROBS_ROWS]
    assert config.cache_config.enable_prefix_caching is True
    assert served_global_tail(config.model_config.hf_config, 1024) == 0
    absent = tmp_path / "absent"  # an export from before the key: served as R = 0
    shutil.copytree(export, absent)
    raw = json.loads((absent / "config.json").read_text())
    del raw["base_global_tail"]
    (absent / "config.json").write_text(json.dumps(raw))
    old = EngineArgs(model=str(absent), dtype="float32", enforce_eager=True, max_model_len=1024,
                     enable_prefix_caching=True).create_engine_config()
    assert old.model_config.logits_processors == [PROMPT_LOGPROBS_ROWS] and old.cache_config.enable_prefix_caching
    assert served_global_tail(SimpleNamespace(base_window=16), 1024) == 0  # absent: 0
    assert served_global_tail(SimpleNamespace(base_window=16, base_global_tail=8), 1024) == 8
    assert served_global_tail(SimpleNamespace(base_window=16, base_global_tail=8), 16) == 0  # within W
    within = EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=W,
                        enable_prefix_caching=True).create_engine_config()
    assert within.cache_config.enable_prefix_caching is True
    assert PROMPT_LENGTHS not in (within.model_config.logits_processors or [])


@pytest.mark.parametrize("tail", [-1, 2.5, True, "4", None])
def test_a_bad_tail_is_refused_naming_the_config(tailed, tmp_path, tail):
    bad = tmp_path / "export"
    shutil.copytree(tailed[1], bad)
    with_tail(bad, tail)
    with pytest.raises(OrthrosServeError) as info:
        EngineArgs(model=str(bad), dtype="float32", enforce_eager=True, max_model_len=1024).create_engine_config()
    message = first_line(info.value)
    assert message.startswith(f"{bad / 'config.json'}: base_global_tail must be an integer >= 0")
    assert message.endswith("re-export the checkpoint with `orthros-convert to-hf`")


def test_what_cannot_learn_the_prompt_lengths_is_refused(tailed):
    _, export = tailed
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(OrthrosServeError, match="speculative decoding is not supported with base_global_tail > 0"
                                                ".*drop the speculative config"):
        EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024,
                   speculative_config=spec).create_engine_config()
    with pytest.raises(OrthrosServeError, match="prompt embeddings are not supported with base_global_tail > 0"):
        EngineArgs(model=str(export), dtype="float32", enforce_eager=True, max_model_len=1024,
                   enable_prompt_embeds=True).create_engine_config()

    class V2:  # the fields check_tail_serving reads, under Model Runner V2 (a GPU default)
        speculative_config = None
        use_v2_model_runner = True
        model_config = SimpleNamespace(hf_config=SimpleNamespace(base_global_tail=R), enable_prompt_embeds=False)

    with pytest.raises(OrthrosServeError, match="Model Runner V2 cannot serve base_global_tail > 0.*"
                                                "VLLM_USE_V2_MODEL_RUNNER=0"):
        check_tail_serving(V2())


def test_gpu_composition_equals_the_key_rule():
    """The GPU path (``paged_global_rows`` over the windowed result of ``paged_window_attention``,
    rows marked by ``tail_row_keys``) under the Triton interpreter, against ``allowed_keys`` with the
    tail's per-query windows: chunks whose tail starts in an earlier chunk, decode rows, padding."""
    from test_sink_serving import paged_caches, requests_case

    from orthros_train.serve.output_rows import every_row
    from orthros_train.serve.paged_attention import paged_global_rows, paged_window_attention
    from orthros_train.serve.tail_rows import tail_row_keys

    tail = 10
    lengths, new = [40, 9, 23, 30], [7, 9, 1, 4]  # cached + scheduled tokens per request
    prompts = [45, 9, 20, 33]  # a chunk before the prompt's end, a whole prompt, a decode step, a chunk
    case = requests_case(lengths, new)
    n = case["slots"].shape[0]
    key_cache, value_cache = paged_caches(case)
    m = int(case["qsl"][-1])
    request, keys = every_row(case["qsl"], m + 2, n, max(new)).row_requests(case["seq"])
    q = torch.cat([case["q"], torch.randn(2, 4, 32)])
    out = paged_window_attention(q, key_cache, value_cache, case["table"], request, keys, W // 2, S)
    tail_keys = tail_row_keys(request, keys, torch.tensor(prompts, dtype=torch.int32), tail)
    assert int((tail_keys > 0).sum()) > 0 and int((tail_keys == 0)[:m].sum()) > 0
    paged_global_rows(q, key_cache, value_cache, case["table"], request, tail_keys, out)
    # The rule: each scheduled row's window is W/2, or UNBOUNDED where prompt_tail_flags marks it.
    flags = torch.cat([prompt_tail_flags(q_r, n_r - q_r, p, tail) for n_r, q_r, p in zip(lengths, new, prompts)])
    windows = torch.where(flags, UNBOUNDED, W // 2)
    mask = allowed_keys(case["q_index"], windows, case["cu"], n, sink_tokens=S)
    k = case["k"].repeat_interleave(2, dim=1)
    v = case["v"].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", case["q"], k) / math.sqrt(32)
    probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
    want = torch.einsum("hqk,khd->qhd", probs, v)
    torch.testing.assert_close(out[:m], want, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(out[m:]) == 0


def test_compiled_engine_with_chunks_equals_generate(tailed, tmp_path, monkeypatch):
    """vLLM's CPU default compiles the model: the global op is an opaque op inside the traced graph,
    writing over the base rows the windowed op wrote (64-token chunks, so steps mix tails and chunks)."""
    model, export = tailed
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # compile afresh
    with engine(export, enforce_eager=False, max_num_batched_tokens=64) as llm:
        for prompts in (MIXED, prompts_of([50], seed=38)):
            assert_same(vllm_run(llm, prompts), model, prompts)


def test_prompt_lengths_follow_the_runner_batch():
    """Requests joining (with their prompt ids), leaving and moving, as the V1 runner reports them
    before each forward; an index the runner never reported is an error naming the fix."""
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from orthros_train.serve.prompt_lengths import PromptLengths, lengths_of

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    tracker = PromptLengths(config, torch.device("cpu"), False)
    params = SamplingParams(max_tokens=1)
    added = [(0, params, [1] * 40, []), (1, params, [2] * 9, []), (2, params, [3] * 5, [])]
    tracker.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=added))
    assert lengths_of(id(config)).host(3).tolist() == [40, 9, 5]
    tracker.update_state(None)  # an unchanged batch
    move = [(2, 1, MoveDirectionality.UNIDIRECTIONAL)]
    tracker.update_state(BatchUpdate(batch_size=2, removed=[1], added=[], moved=move))
    assert lengths_of(id(config)).host(2).tolist() == [40, 5]
    tracker.update_state(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert lengths_of(id(config)).host(2).tolist() == [5, 40]
    with pytest.raises(OrthrosServeError, match="no prompt length is known for batch index 2.*V1 runner"):
        lengths_of(id(config)).host(3)
