"""Generation through prefill + decode against step-by-step ``forward``; the KV cache; sampling."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model

from orthros_train.errors import UserError
from orthros_train.infer import SamplingParams, filter_logits, generate, prefill, sample_next
from orthros_train.infer.generate import as_rows, cut_at_stop
from orthros_train.model import KVCache, OrthrosForCausalLM
from orthros_train.phase.builders import prefill_layout

VOCAB = 61


def make_model(**overrides) -> OrthrosForCausalLM:
    """The tiny model with window 5 and a non-trivial output-stream query affine, in eval mode;
    initializer_range 0.2 spreads the logits out, so an argmax never hinges on float noise."""
    settings = {"sliding_window": 5, "initializer_range": 0.2, **overrides}
    return tiny_model(VOCAB, output_affine="resampled", **settings).eval()


def reference_greedy(model, prompt: list[int], steps: int, stop: int | None = None) -> list[int]:
    """Re-run the whole sequence through ``forward`` for every new token (no cache)."""
    seq, new = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            tok = int(model(torch.tensor(seq)[None]).logits[0, -1].argmax())
            new.append(tok)
            seq.append(tok)
            if tok == stop:
                break
    return new


PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 43], [1, 41, 42], [27, 18, 28, 18, 28, 45, 9, 0]]


@pytest.mark.parametrize("attention_type", ["orthros", "dense", "sliding"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_greedy_generation_equals_stepwise_forward_on_ragged_batch(attention_type, chunk):
    model = make_model(attention_type=attention_type)
    steps = 14  # prompts + steps run well past the window (5)
    out = generate(model, PROMPTS, max_new_tokens=steps, prefill_chunk_size=chunk)
    for prompt, seq, reason in zip(PROMPTS, out.sequences, out.finish_reasons):
        assert seq == reference_greedy(model, prompt, steps)
        assert reason == "length"
    assert out.decode_steps == steps - 1
    cfg = model.config
    assert out.cache_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert out.cache_nbytes == out.cache_bytes_per_token * (sum(map(len, PROMPTS)) + 3 * (steps - 1))


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_prefill_equals_one_shot(chunk):
    model = make_model()
    rows = [torch.tensor(p) for p in PROMPTS]
    full, cache_full = prefill(model, rows)
    chunked, cache = prefill(model, rows, chunk_size=chunk)
    assert (full - chunked).abs().max() <= 1e-4
    assert cache.lengths.tolist() == [len(p) for p in PROMPTS]
    for layer in range(model.config.num_hidden_layers):
        for r in range(len(rows)):
            ka, va = cache_full.row(layer, r)
            kb, vb = cache.row(layer, r)
            assert (ka - kb).abs().max() <= 1e-4 and (va - vb).abs().max() <= 1e-4
    # The last position's logits equal the full forward's.
    with torch.no_grad():
        for r, p in enumerate(PROMPTS):
            assert (model(torch.tensor(p)[None]).logits[0, -1] - chunked[r]).abs().max() <= 1e-4


def test_left_and_right_padded_batches_equal_ragged():
    model = make_model()
    t = max(map(len, PROMPTS))
    pad = 0
    left = torch.full((3, t), pad)
    right = torch.full((3, t), pad)
    mask_l, mask_r = torch.zeros(3, t, dtype=torch.long), torch.zeros(3, t, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        left[i, t - len(p) :], mask_l[i, t - len(p) :] = torch.tensor(p), 1
        right[i, : len(p)], mask_r[i, : len(p)] = torch.tensor(p), 1
    ragged = generate(model, PROMPTS, max_new_tokens=6).sequences
    assert generate(model, left, attention_mask=mask_l, max_new_tokens=6).sequences == ragged
    assert generate(model, right, attention_mask=mask_r, max_new_tokens=6).sequences == ragged
    assert [r.tolist() for r in as_rows(left, mask_l)] == PROMPTS


def test_stop_tokens_and_max_tokens():
    model = make_model()
    free = generate(model, PROMPTS, max_new_tokens=12).sequences
    stop = free[0][4]  # row 0 emits this at step 4 (maybe earlier too)
    out = generate(model, PROMPTS, max_new_tokens=12, stop_token_ids=[stop])
    for seq_free, seq, reason in zip(free, out.sequences, out.finish_reasons):
        if stop in seq_free:
            cut = seq_free.index(stop) + 1
            assert seq == seq_free[:cut] and reason == "stop_token"
        else:
            assert seq == seq_free and reason == "length"
    assert out.finish_reasons[0] == "stop_token"
    # The other rows keep decoding exactly as without the stop (rows leave the batch cleanly).
    assert generate(model, PROMPTS, max_new_tokens=0).sequences == [[], [], []]
    assert [len(s) for s in generate(model, PROMPTS, max_new_tokens=1).sequences] == [1, 1, 1]
    # A stop callback: stop row 1 once it has 2 tokens.
    out = generate(model, PROMPTS, max_new_tokens=8, stop_fn=lambda row, new: row == 1 and len(new) == 2)
    assert out.sequences[1] == free[1][:2] and out.finish_reasons[1] == "stop_fn"
    assert out.sequences[0] == free[0][:8] and out.sequences[2] == free[2][:8]


def test_sampling_is_seeded_and_top_p_small_is_greedy():
    model = make_model()
    greedy = generate(model, PROMPTS, max_new_tokens=8).sequences
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=1).sequences == greedy
    assert generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_k=1, seed=1).sequences == greedy
    a = generate(model, PROMPTS, max_new_tokens=8, temperature=2.0, seed=7).sequences
    b = generate(model, PROMPTS, max_new_tokens=8, temperature=2.0, seed=7).sequences
    c = generate(model, PROMPTS, max_new_tokens=8, temperature=2.0, seed=8).sequences
    assert a == b and a != c


def test_filter_logits_top_p_and_top_k():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = torch.isfinite(filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = torch.isfinite(filter_logits(logits, top_p=0.81))
    assert kept.tolist() == [[True, True, True, False], [False, True, True, True]]
    kept = torch.isfinite(filter_logits(logits, top_k=1))
    assert kept.tolist() == [[True, False, False, False], [False, False, False, True]]
    # Sampling only ever returns kept tokens.
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.7)
    draws = torch.stack([sample_next(logits, params, g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {0, 1} and set(draws[:, 1].tolist()) == {2, 3}


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=-1)):
        with pytest.raises(UserError):
            SamplingParams(**bad)
    with pytest.raises(UserError, match="empty"):
        generate(make_model(), [[1, 2], []], max_new_tokens=2)


def test_cut_at_stop():
    assert cut_at_stop("Paris.\nQuestion: x", ["\n", "Question:"]) == "Paris."
    assert cut_at_stop("abc", []) == "abc"
    assert cut_at_stop("abXcdY", ["Y", "X"]) == "ab"


# -- the cache ---------------------------------------------------------------------------------


def test_cache_writes_in_place_grows_and_keeps_rows():
    cache = KVCache(num_layers=2, num_rows=2)
    rows = {0: [], 1: []}
    torch.manual_seed(0)
    for new in [(3, 1), (0, 2), (1, 1), (5, 0), (1, 1)]:
        new = torch.tensor(new)
        cu, index = cache.key_space(new)
        assert int(cu[-1]) == 2 * cache.capacity
        k_new = torch.randn(int(new.sum()), 1, 2)
        for layer in range(2):
            k, v = cache.extend(layer, k_new + layer, -k_new, new)
            assert k.shape[0] == 2 * cache.capacity
            assert torch.equal(k[index], k_new + layer)  # key_space's indices are where they landed
        for r, chunk in zip((0, 1), k_new.split(new.tolist())):
            rows[r].append(chunk)
        cache.advance(new)
        for r in (0, 1):
            want = torch.cat(rows[r])
            k, v = cache.row(1, r)
            assert torch.equal(k, want + 1) and torch.equal(v, -want)
    assert cache.lengths.tolist() == [10, 5]
    assert cache.nbytes() == 15 * 2 * 2 * 2 * 4  # tokens x layers x (K,V) x Hkv*D x fp32
    assert cache.allocated_nbytes() >= cache.nbytes()


def test_cache_reserve_avoids_regrowth_and_select_view():
    cache = KVCache(num_layers=1, num_rows=3)
    cache.reserve(16)
    cache.key_space(torch.tensor([2, 3, 1]))
    k, v = cache.extend(0, torch.ones(6, 1, 2), torch.ones(6, 1, 2), torch.tensor([2, 3, 1]))
    cache.advance(torch.tensor([2, 3, 1]))
    buf = cache.k[0]
    view = cache.select([0, 2])
    assert view.num_rows == 2 and view.lengths.tolist() == [2, 1]
    cu, index = view.key_space(torch.tensor([1, 2]))
    assert index.tolist() == [2, 33, 34]  # row 0 slot 2, row 2 slots 1..2 (capacity 16)
    view.extend(0, torch.full((3, 1, 2), 7.0), torch.zeros(3, 1, 2), torch.tensor([1, 2]))
    view.advance(torch.tensor([1, 2]))
    assert cache.lengths.tolist() == [3, 3, 3]
    assert cache.k[0] is buf  # written in place, no reallocation
    assert cache.row(0, 2)[0][1:].eq(7).all() and cache.row(0, 1)[0].eq(1).all()
    with pytest.raises(ValueError, match="sorted"):
        cache.select([2, 0])
    with pytest.raises(ValueError, match="rows"):
        cache.key_space(torch.tensor([1, 1]))


def test_generation_reserves_the_cache_once():
    model = make_model()
    allocations = []
    original = KVCache._buffers

    def spy(self, layer, like):
        before = self.k[layer]
        out = original(self, layer, like)
        if out[0] is not before:
            allocations.append(layer)
        return out

    KVCache._buffers = spy
    try:
        generate(model, PROMPTS, max_new_tokens=10, prefill_chunk_size=4)
    finally:
        KVCache._buffers = original
    assert allocations == list(range(model.config.num_hidden_layers))  # one allocation per layer


def test_cache_clone_is_independent_and_decodes_alike():
    model = make_model()
    logits, cache = prefill(model, [torch.tensor(p) for p in PROMPTS])
    copy = cache.clone(capacity=64)
    assert copy.capacity == 64 and copy.lengths.tolist() == cache.lengths.tolist()
    for layer in range(model.config.num_hidden_layers):
        for r in range(3):
            assert torch.equal(copy.row(layer, r)[0], cache.row(layer, r)[0])
    from orthros_train.infer import decode

    nxt = logits.argmax(-1)
    a, b = decode(model, nxt, cache), decode(model, nxt, copy)
    assert (a - b).abs().max() <= 1e-5
    assert cache.k[0] is not copy.k[0] and cache.lengths.tolist() == copy.lengths.tolist()


def test_chunked_prefill_bounds_the_queries_of_every_forward(monkeypatch):
    """No forward of a chunked prefill sees more than chunk base queries (+ one output) per row."""
    import orthros_train.model.orthros as orthros_module

    seen = []
    real = orthros_module.orthros_attention

    def spy(q, k, v, q_index, q_window, cu_seqlens, **kw):
        seen.append(q.shape[0])
        return real(q, k, v, q_index, q_window, cu_seqlens, **kw)

    monkeypatch.setattr(orthros_module, "orthros_attention", spy)
    model = make_model()
    prompt = torch.randint(0, VOCAB, (50,))
    logits, _ = prefill(model, [prompt], chunk_size=8)
    assert max(seen) <= 8 + 1 and len(seen) == 7 * model.config.num_hidden_layers
    with torch.no_grad():
        assert (model(prompt[None]).logits[0, -1] - logits[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("attention_type", ["orthros", "dense"])
def test_chunked_prefill_puts_the_output_query_on_the_last_chunk_only(monkeypatch, attention_type):
    """T=100 in chunks of 16 is 7 forwards; only the last carries an output token (per row)."""
    model = make_model(attention_type=attention_type)
    outputs = []
    real = model.forward_layout

    def spy(layout, cache=None, **kw):
        outputs.append(layout.row_of_output.tolist())
        return real(layout, cache, **kw)

    monkeypatch.setattr(model, "forward_layout", spy)
    rows = [torch.randint(0, VOCAB, (100,)), torch.randint(0, VOCAB, (20,)), torch.randint(0, VOCAB, (40,))]
    logits, _ = prefill(model, rows, chunk_size=16)
    # Row 1 ends in chunk 2 (offset 16) and row 2 in chunk 3 (offset 32): their output queries
    # come there; row 0 (100 tokens) gets its one output query in the 7th chunk.
    assert outputs == [[], [1], [1], [], [], [], [0]]
    with torch.no_grad():
        for r, prompt in enumerate(rows):
            assert (real(prefill_layout(prompt[None])).logits[0] - logits[r]).abs().max() <= 1e-4


def test_auto_prefill_chunks_orthros_and_sliding_but_not_dense():
    from orthros_train.infer.generate import PREFILL_CHUNK, resolve_chunk_size

    assert resolve_chunk_size(make_model(), "auto") == PREFILL_CHUNK
    assert resolve_chunk_size(make_model(attention_type="sliding"), "auto") == PREFILL_CHUNK
    assert resolve_chunk_size(make_model(attention_type="dense"), "auto") is None
    assert resolve_chunk_size(make_model(), None) is None and resolve_chunk_size(make_model(), 7) == 7
    assert SamplingParams().prefill_chunk_size == "auto"
    with pytest.raises(UserError, match="prefill_chunk_size"):
        SamplingParams(prefill_chunk_size="big")


def test_tokenizer_of_a_checkpoint_with_yarn_scaling_loads(tmp_path):
    """AutoTokenizer reads config.json too, and transformers' RoPE checks fail on an Orthros config
    with YaRN scaling (a context-extended checkpoint): the tokenizer still loads, special tokens kept."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.model import OrthrosConfig

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(tmp_path)
    cfg = OrthrosConfig(vocab_size=3, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=1024,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    tok = load_tokenizer(tmp_path, pad_with_eos=True)
    assert tok("a b a")["input_ids"] == [0, 1, 0]
    assert tok.eos_token == "<eos>" and tok.pad_token_id == 2
