"""The static decode step (infer/static_decode.py); its attention op is tests/test_decode_rows.py's.

On CPU the step runs without a graph: it must equal the eager decode (logits and tokens), issue
the same ops on the same shapes at every length and read nothing back (what a CUDA graph replay
requires), and refuse what it cannot serve. The capture itself is the GPU test at the end.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from orthros_train.errors import UserError
from orthros_train.infer.generate import decode, generate, prefill
from orthros_train.infer.static_decode import StaticDecoder
from orthros_train.model.cache import KVCache

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1], [8, 2, 8, 1, 8, 2, 8]]  # ragged, one past W

# (attention type, window, sink tokens, backend): the Orthros layer with and without sinks on both
# ops, and the two baselines (one stream: windowed, unbounded).
MODELS = [
    ("orthros", 4, 0, "auto"),
    ("orthros", 4, 2, "auto"),
    ("orthros", 4, 2, "triton"),
    ("sliding", 4, 1, "auto"),
    ("dense", 4, 0, "auto"),
]


def model_of(kind: str, window: int, sinks: int, backend: str):
    return tiny_model(97, output_affine="resampled", attention_type=kind, sliding_window=window,
                      sink_tokens=sinks, attention_backend=backend).eval()  # fmt: skip


# -- the step against the eager decode ----------------------------------------------------------------


def prefilled(model, capacity: int) -> KVCache:
    cache = KVCache(model.config.num_hidden_layers, len(PROMPTS))
    cache.reserve(capacity)
    return prefill(model, [torch.tensor(p) for p in PROMPTS], cache)[1]


@pytest.mark.parametrize("kind,window,sinks,backend", MODELS)
def test_static_steps_equal_eager_steps(kind, window, sinks, backend):
    model = model_of(kind, window, sinks, backend)
    eager, static = prefilled(model, 20), prefilled(model, 20)
    decoder = StaticDecoder(model, static)
    g = torch.Generator().manual_seed(1)
    rows = [0, 1, 2]
    for step in range(7):
        if step == 3:
            rows = [0, 2]  # row 1 finished: it stays in the batch, frozen
        ids = torch.randint(0, 97, (len(rows),), generator=g)
        want = decode(model, ids, eager, rows)
        got = decoder.step(rows, ids)
        assert (got - want).abs().max() < 2e-5, step
    decoder.close()
    assert torch.equal(static.lengths, eager.lengths)
    for layer in range(model.config.num_hidden_layers):  # every written K/V where the eager one is
        for r in range(len(PROMPTS)):
            assert (static.row(layer, r)[0] - eager.row(layer, r)[0]).abs().max() < 1e-5
    # the cache goes on eagerly after a static stretch
    ids = torch.tensor([5, 6])
    assert (decode(model, ids, static, [0, 2]) - decode(model, ids, eager, [0, 2])).abs().max() < 2e-5


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_row_that_filled_its_capacity_keeps_its_cache_while_the_others_decode(backend):
    model = model_of("orthros", 4, 2, backend)
    eager, static = prefilled(model, 12), prefilled(model, 12)  # row 0 (11 tokens) fills at the first step
    decoder = StaticDecoder(model, static)
    ids = torch.tensor([1, 2, 3])
    decode(model, ids, eager)
    decoder.step([0, 1, 2], ids)
    for step in range(3):  # row 0 sits at length == capacity: its query and its write stay in its row
        ids = torch.tensor([4 + step, 5 + step])
        want = decode(model, ids, eager, [1, 2])
        got = decoder.step([1, 2], ids)
        assert torch.isfinite(got).all() and (got - want).abs().max() < 2e-5, step
    decoder.close()
    for layer in range(model.config.num_hidden_layers):
        for r in range(len(PROMPTS)):
            for got, want in zip(static.row(layer, r), eager.row(layer, r)):
                assert (got - want).abs().max() < 1e-5, (layer, r)


@pytest.mark.parametrize("kind,window,sinks,backend", [MODELS[1], MODELS[4]])
def test_generate_with_cuda_graph_gives_the_eager_tokens(kind, window, sinks, backend):
    model = model_of(kind, window, sinks, backend)
    for params in ({"stop_token_ids": (3,)}, {"temperature": 1.0, "top_k": 20, "seed": 7}):
        eager = generate(model, PROMPTS, max_new_tokens=9, **params)
        static = generate(model, PROMPTS, max_new_tokens=9, cuda_graph=True, **params)
        assert static.sequences == eager.sequences and static.finish_reasons == eager.finish_reasons
        assert static.cache_nbytes == eager.cache_nbytes and static.decode_steps == eager.decode_steps
        # building (on CUDA: capturing) the step is timed apart from the decode
        assert static.decode_setup_seconds > 0 and eager.decode_setup_seconds == 0
    # every row stops on its first token: no step is built (nor, on CUDA, captured)
    done = generate(model, PROMPTS, max_new_tokens=9, cuda_graph=True, stop_fn=lambda row, tokens: True)
    assert done.decode_steps == 0 and done.decode_setup_seconds == 0 and all(len(s) == 1 for s in done.sequences)


# -- what a graph replay needs: the same ops on the same shapes, nothing read back --------------------


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind,window,sinks,backend", [MODELS[1], MODELS[2], MODELS[4]])
def test_every_step_issues_the_same_ops_and_reads_nothing_back(kind, window, sinks, backend):
    model = model_of(kind, window, sinks, backend)
    decoder = StaticDecoder(model, prefilled(model, 24))
    recorded = []
    for step, rows in enumerate(([0, 1, 2], [0, 1, 2], [0, 2])):
        ids = torch.full((len(rows),), step + 1)
        with OpRecorder() as rec:
            decoder._forward()  # the step a graph captures, at lengths that differ every time
        decoder.step(rows, ids)  # advance
        recorded.append(rec.ops)
    assert recorded[0] == recorded[1] == recorded[2]
    syncs = [op for op, _ in recorded[0] if "_local_scalar_dense" in op or "item" in op or "nonzero" in op]
    assert not syncs, syncs


# -- refusals ------------------------------------------------------------------------------------------


def test_what_a_static_step_cannot_serve_is_refused():
    moe = tiny_model(97, num_experts=4, num_experts_per_tok=2).eval()
    with pytest.raises(UserError, match="mixture-of-experts"):
        generate(moe, PROMPTS, max_new_tokens=3, cuda_graph=True)
    model = model_of("orthros", 4, 0, "auto")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        StaticDecoder(model, prefilled(model, 20), graph=True)
    with pytest.raises(ValueError, match="prefilled cache"):
        StaticDecoder(model, KVCache(2, 3, capacity=8))
    with pytest.raises(UserError, match="cuda_graph must be true or false"):
        generate(model, PROMPTS, max_new_tokens=3, cuda_graph="yes")
    decoder = StaticDecoder(model, prefilled(model, 12))  # the longest prompt (11) leaves one slot
    decoder.step([0, 1, 2], torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="a row is full"):
        decoder.step([0, 1, 2], torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="not a subset"):
        decoder.step([1, 4], torch.tensor([1, 2]))


# -- the capture ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind,window,sinks", [("orthros", 64, 4), ("dense", 64, 0)])
def test_captured_steps_equal_eager_steps_on_cuda(kind, window, sinks):
    model = tiny_model(97, attention_type=kind, sliding_window=window, sink_tokens=sinks).cuda().eval()
    prompts = [torch.randint(0, 97, (n,)) for n in (300, 17)]
    caches = []
    for _ in range(2):
        cache = KVCache(model.config.num_hidden_layers, 2)
        cache.reserve(340)
        caches.append(prefill(model, prompts, cache)[1])
    decoder = StaticDecoder(model, caches[1], graph=True)
    rows = [0, 1]
    for step in range(12):
        rows = [0] if step >= 6 else rows
        ids = torch.randint(0, 97, (len(rows),), device="cuda")
        want = decode(model, ids, caches[0], rows)
        got = decoder.step(rows, ids)
        # TF32 dots in the decode kernel (fp32 inputs) and another split of the keys than the eager step's
        assert (got - want).abs().max() < 1e-2, step
    assert decoder._graph is not None
    decoder.close()
    assert torch.equal(caches[0].lengths, caches[1].lengths)
