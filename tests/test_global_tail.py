"""The global tail (``model.base_global_tail = R``): the base queries of a prompt's last R tokens
and of generated tokens see their whole document (``ops/keys.py``).

Every executor against the rule's own mask (``keys.allowed_keys`` through ``attention_naive``),
forward and backward; then the model: a prompt read whole, in chunks or a token at a time gives
the same logits, an SFT layout gives the logits ``generate`` gives the same tokens (train ==
prefill == decode), batched rows of different lengths each get their own tail, the static decode
step equals the eager one, and bad values of R are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model

from orthros_train.errors import UserError
from orthros_train.infer.generate import decode, generate, prefill
from orthros_train.model.cache import KVCache
from orthros_train.ops.attention import attention_with_lse, orthros_attention, prepare_attention
from orthros_train.ops.keys import UNBOUNDED, KeyRule, allowed_keys, answer_tail_flags, prompt_tail_flags
from orthros_train.ops.reference import attention_naive
from orthros_train.phase.builders import prefill_layout, sft_layout

H, HKV, D, W = 4, 2, 8, 5
LENGTHS = [3, 14, 9]  # shorter than W, several windows, a little over W
FWD_TOL = {"atol": 2e-6, "rtol": 1e-5}


# -- the rule ---------------------------------------------------------------------------------------


def test_tail_flags_follow_the_prompt_end_not_the_chunk():
    whole = prompt_tail_flags(10, 0, 10, 3)
    chunks = torch.cat([prompt_tail_flags(4, s, 10, 3) for s in (0, 4)] + [prompt_tail_flags(2, 8, 10, 3)])
    assert whole.tolist() == [False] * 7 + [True] * 3 and torch.equal(whole, chunks)
    assert prompt_tail_flags(1, 12, 10, 3).tolist() == [True]  # a generated token
    assert prompt_tail_flags(5, 0, 5, 0) is None  # R = 0: the paper's layer


def test_answer_flags_stop_at_the_document_start_and_before_the_last_answer_token():
    """Answers (8, 12) in a document starting at 6 and (3, 5) in one starting at 0: outputs sit at
    7..10 and 2..3 (an output predicts the next token)."""
    cu = torch.tensor([0, 6, 14])
    outputs = torch.tensor([2, 3, 7, 8, 9, 10])
    flags = answer_tail_flags(outputs, cu, 14, 4)
    want = torch.zeros(14, dtype=torch.bool)
    want[6:11] = True  # doc 2 starts at 6: the tail is cut there; the last answer token (11) is not fed back
    want[0:4] = True  # answer (3, 5): prompt tail 0..2, generated token 3
    assert torch.equal(flags, want)
    assert answer_tail_flags(outputs, cu, 14, 0) is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_bad_tail_values_are_refused_in_one_line(bad):
    with pytest.raises(UserError, match="base_global_tail must be an integer >= 0"):
        KeyRule(8, 0, bad)
    with pytest.raises(UserError, match="base_global_tail"):
        tiny_model(sliding_window=8, base_global_tail=bad)


def test_a_tail_where_it_means_nothing_is_refused():
    from orthros_train.train.config import run_config_from_dict

    with pytest.raises(UserError, match="model.base_global_tail=4 on a dense model.*set model.base_global_tail=0"):
        run_config_from_dict({"model": {"attention_type": "dense", "base_global_tail": 4}})
    # a dense twin of a model with a tail (a distillation teacher, a baseline) ignores it
    twin = tiny_model(attention_type="dense", base_global_tail=4)
    assert torch.equal(twin.config.key_rule.base_windows(torch.ones(3, dtype=torch.bool), torch.arange(3)),
                       torch.full((3,), UNBOUNDED))
    with pytest.raises(UserError, match="window already covers every position"):
        tiny_model(sliding_window=64, max_position_embeddings=64, base_global_tail=4)


# -- every executor against the rule ------------------------------------------------------------------


def _queries(sinks: int, seed: int = 0):
    """Base queries of every token (a random third of them global) then output queries at a few
    positions, packed over ``LENGTHS``."""
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    g = torch.Generator().manual_seed(seed)
    flags = torch.rand(n, generator=g) < 0.35
    base = KeyRule(W, sinks, 3).base_windows(flags, torch.arange(n))
    outs = torch.tensor([n - 1, 2, 16, 9])
    return torch.cat([torch.arange(n), outs]), torch.cat([base, torch.full((4,), UNBOUNDED)]), cu, flags


def test_global_queries_see_their_whole_document_in_the_rule():
    q_index, q_window, cu, flags = _queries(sinks=2)
    mask = allowed_keys(q_index, q_window, cu, int(cu[-1]), sink_tokens=2)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(LENGTHS))
    for row, i in enumerate(q_index.tolist()[: int(cu[-1])]):
        seen = mask[row].nonzero().flatten()
        if flags[i]:
            assert seen.tolist() == [j for j in range(i + 1) if doc[j] == doc[i]]
        else:
            assert seen.numel() <= W + 2


def _check(run, sinks, d=D):
    q_index, q_window, cu, _ = _queries(sinks)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(q_index.numel(), H, d, generator=g, requires_grad=True)
    k = torch.randn(int(cu[-1]), HKV, d, generator=g, requires_grad=True)
    v = torch.randn(int(cu[-1]), HKV, d, generator=g, requires_grad=True)
    grad = torch.randn(q.shape, generator=g)
    ref, _ = attention_naive(q, k, v, q_index, q_window, cu, sink_tokens=sinks)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = run(q, k, v, q_index, q_window, cu)
    torch.testing.assert_close(out, ref, **FWD_TOL)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), grad), ref_grads):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton", "triton_atomic"])
def test_every_backend_equals_the_rule_forward_and_backward(backend, sinks):
    def run(q, k, v, q_index, q_window, cu):
        n_k = int(cu[-1])
        prepared = prepare_attention(q_index, q_window, cu, n_k, backend, sink_tokens=sinks,
                                     n_band=int((q_window < UNBOUNDED).sum()))  # fmt: skip
        out = orthros_attention(q, k, v, q_index, q_window, cu, backend=backend, prepared=prepared, sink_tokens=sinks)
        lse_out, _ = attention_with_lse(q, k, v, q_index, q_window, cu, backend=backend, sink_tokens=sinks)
        torch.testing.assert_close(out, lse_out, **FWD_TOL)
        return out

    _check(run, sinks, d=16 if backend.startswith("triton") else D)


# -- the model ------------------------------------------------------------------------------------------


def tail_model(backend="auto", tail=3, sinks=2, window=4, vocab=61, **kw):
    return tiny_model(vocab, output_affine="resampled", sliding_window=window, sink_tokens=sinks,
                      base_global_tail=tail, attention_backend=backend, **kw).double().eval()  # fmt: skip


PROMPTS = [torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]), torch.tensor([2, 7, 1, 8, 2, 8, 1])]


@torch.no_grad()
def test_the_tail_changes_what_a_long_prompt_predicts_and_nothing_within_the_window():
    with_tail, without = tail_model(), tail_model(tail=0)
    long_prompt = PROMPTS[0]
    assert (prefill(with_tail, [long_prompt])[0] - prefill(without, [long_prompt])[0]).abs().max() > 1e-3
    short = long_prompt[:4]  # within W: every query already sees its whole document
    assert torch.allclose(prefill(with_tail, [short])[0], prefill(without, [short])[0], atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
@torch.no_grad()
def test_a_prompt_read_whole_in_chunks_or_token_by_token_gives_the_same_logits(backend):
    model = tail_model(backend) if backend != "triton" else tail_model(backend).float()
    tol = 1e-6 if backend != "triton" else 2e-5  # the reference op's math is fp32
    whole, cache_w = prefill(model, PROMPTS, chunk_size=None)
    nxt = whole.argmax(-1)
    step = decode(model, nxt, cache_w)
    for chunk in (1, 4):
        chunked, cache_c = prefill(model, PROMPTS, chunk_size=chunk)
        assert (chunked - whole).abs().max() < tol, chunk
        assert (decode(model, nxt, cache_c) - step).abs().max() < tol, chunk


@torch.no_grad()
def test_sft_layout_gives_the_logits_generate_gives_the_same_tokens():
    """train == prefill == decode with the tail: a prompt and its answer trained as one SFT row
    see the keys a generation of that answer sees (prompt tail global, answer tokens global)."""
    model = tail_model()
    prompt, answer = PROMPTS[0][:11], PROMPTS[0][11:]
    logits, cache = prefill(model, [prompt])
    steps = [logits[0]]
    for token in answer[:-1]:
        steps.append(decode(model, token.view(1), cache)[0])
    row = torch.cat([prompt, answer])
    layout = sft_layout([row], [[(11, 15)]])
    trained = model.forward_layout(layout).logits
    assert (trained - torch.stack(steps)).abs().max() < 1e-10
    # read as a layout whose outputs are not answers (no global token) the answers see other keys
    layout.answers = False
    assert (model.forward_layout(layout).logits - torch.stack(steps)).abs().max() > 1e-4


@torch.no_grad()
def test_batched_rows_of_different_lengths_each_get_their_own_tail():
    model = tail_model()
    batched = generate(model, PROMPTS, max_new_tokens=5)
    for i, prompt in enumerate(PROMPTS):
        assert generate(model, [prompt], max_new_tokens=5).sequences[0] == batched.sequences[i]


@pytest.mark.parametrize("backend", ["auto", "triton"])
@torch.no_grad()
def test_static_decode_steps_equal_eager_steps_with_the_tail(backend):
    from orthros_train.infer.static_decode import StaticDecoder

    model = tail_model(backend).float()
    caches = []
    for _ in range(2):
        cache = KVCache(model.config.num_hidden_layers, len(PROMPTS))
        cache.reserve(24)
        caches.append(prefill(model, PROMPTS, cache)[1])
    eager, static = caches
    decoder = StaticDecoder(model, static)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, 61, (2,), generator=g)
        assert (decoder.step([0, 1], ids) - decode(model, ids, eager)).abs().max() < 2e-5, step
    decoder.close()


def test_decode_rows_fold_equal_windows_into_one_read():
    from orthros_train.ops.decode_rows import decode_rows_torch, decode_rows_triton

    g = torch.Generator().manual_seed(0)
    b, cap = 3, 12
    q = torch.randn(2 * b, H, 16, generator=g)
    k, v = (torch.randn(b * cap, HKV, 16, generator=g) for _ in range(2))
    lengths = torch.tensor([11, 0, 6])
    for windows in ((UNBOUNDED, UNBOUNDED), (W, UNBOUNDED)):
        want = decode_rows_torch(q, k, v, lengths, cap, windows, sink_tokens=2)
        torch.testing.assert_close(decode_rows_triton(q, k, v, lengths, cap, windows, sink_tokens=2), want,
                                   atol=2e-6, rtol=1e-5)  # fmt: skip


def test_prefill_layout_marks_each_rows_tail():
    lay = prefill_layout([torch.arange(6), torch.arange(2)], start_positions=[0, 4], global_tail=3,
                         prompt_lengths=[6, 9])  # fmt: skip
    assert lay.base_global.tolist() == [False, False, False, True, True, True, False, False]
    assert lay.num_global == 3


@torch.no_grad()
def test_a_two_turn_chat_with_the_cache_kept_is_what_its_sft_layout_trains():
    """Turn 1 (prompt, answer) then turn 2 (a question appended to the kept cache, its answer):
    the SFT layout of the whole conversation gives the logits of both generations."""
    model = tail_model()
    p1, a1, p2, a2 = PROMPTS[0][:8], PROMPTS[0][8:11], PROMPTS[1][:5], PROMPTS[1][5:]
    steps = []
    logits, cache = prefill(model, [p1])
    steps.append(logits[0])
    for token in a1[:-1]:
        steps.append(decode(model, token.view(1), cache)[0])
    logits, cache = prefill(model, [torch.cat([a1[-1:], p2])], cache)  # the last answer token opens turn 2
    steps.append(logits[0])
    for token in a2[:-1]:
        steps.append(decode(model, token.view(1), cache)[0])
    row = torch.cat([p1, a1, p2, a2])
    s1, s2 = 8, 8 + 3 + 5
    trained = model.forward_layout(sft_layout([row], [[(s1, s1 + 3), (s2, s2 + 2)]])).logits
    assert (trained - torch.stack(steps)).abs().max() < 1e-10


def test_the_flop_model_counts_the_keys_the_rule_gives():
    """layout_flops' attention pairs are the rule's visible keys: an SFT layout whose answers have
    global queries costs more than the same layout read by a model without the tail, by exactly
    the extra keys ``allowed_keys`` gives its global base queries."""
    from orthros_train.model.orthros import plan_for_layout
    from orthros_train.train.metrics import layout_flops

    with_tail, without = tail_model().config, tail_model(tail=0).config
    row = torch.cat([PROMPTS[0], PROMPTS[1]])
    layout = sft_layout([row], [[(11, 15)]])
    extra = layout_flops(with_tail, layout, training=False) - layout_flops(without, layout, training=False)
    masks = []
    for cfg in (with_tail, without):
        _, q_index, q_window = plan_for_layout(cfg, layout).queries(True)
        base = slice(0, layout.num_tokens)
        masks.append(allowed_keys(q_index[base], q_window[base], layout.cu_seqlens, layout.num_tokens, 2).sum())
    per_pair = 4 * with_tail.num_attention_heads * with_tail.head_dim
    assert extra == per_pair * (with_tail.num_hidden_layers - 1) * float(masks[0] - masks[1]) > 0
