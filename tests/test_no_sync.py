"""The per-layer hot path never reads a device value (no host-device sync).

On a GPU every ``.item()``, ``int(tensor)``, ``bool(tensor)``, ``.tolist()`` or ``nonzero`` of a
CUDA tensor blocks the host until the device catches up, so a layer that does one per call
serialises the whole step. This CPU test counts such calls made from the package's own code
while layers run (forward and backward; training, prefill, decode with a KV cache, and the
context-parallel attention), by patching the tensor methods. It fails as soon as one is added.
Triton's interpreter internals are not counted (on a GPU they are kernel launches).
``tests/test_no_sync.py::test_layer_is_sync_free_on_cuda`` runs the same under CUDA's own sync
detector when a GPU is present.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import pytest
import torch
from fixtures import tiny_model

from orthros_train.model.cache import KVCache
from orthros_train.model.orthros import OrthrosForCausalLM, plan_for_layout
from orthros_train.ops import triton_attention as ta
from orthros_train.ops.reference import UNBOUNDED
from orthros_train.parallel.context import context_plan
from orthros_train.phase.builders import decode_layout, prefill_layout, pretrain_layout

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(ta.__file__)))  # .../orthros_train
_METHODS = ("item", "tolist", "numpy", "nonzero", "__int__", "__float__", "__bool__", "__index__")


class SyncCounter:
    """Counts value reads of tensors issued by orthros_train code while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[str] = []

    def _record(self, name: str) -> None:
        if not self.active:
            return
        frame = sys._getframe(2)
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            self.calls.append(f"{name} at {os.path.relpath(path, PACKAGE)}:{frame.f_lineno} ({frame.f_code.co_name})")

    @contextmanager
    def patched(self):
        originals = {name: getattr(torch.Tensor, name) for name in _METHODS}
        original_nonzero = torch.nonzero

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self._record(name)
                return fn(*args, **kwargs)

            return counted

        try:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, wrap(name, fn))
            torch.nonzero = wrap("torch.nonzero", original_nonzero)
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            torch.nonzero = original_nonzero

    @contextmanager
    def counting(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _model(attention_type: str = "orthros") -> OrthrosForCausalLM:
    return tiny_model(64, head_dim=16, sliding_window=8, attention_type=attention_type, attention_backend="triton")


def _count_layers(model: OrthrosForCausalLM, counter: SyncCounter):
    """Activate the counter inside every layer's forward (hooks), return the handles."""
    handles = []
    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(lambda *_: setattr(counter, "active", True)))
        handles.append(layer.register_forward_hook(lambda *_: setattr(counter, "active", False)))
    return handles


@pytest.mark.parametrize("attention_type", ["orthros", "dense"])
def test_training_layers_forward_backward_read_no_device_value(attention_type):
    model = _model(attention_type)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    layout = pretrain_layout(ids, document_ids=docs)
    counter = SyncCounter()
    with counter.patched():
        handles = _count_layers(model, counter)
        hidden = model.hidden_states(layout)
        for h in handles:
            h.remove()
        with counter.counting():  # the whole backward: every layer's, attention's included
            hidden.float().pow(2).sum().backward()
    assert counter.calls == [], "device value reads in the hot path:\n" + "\n".join(counter.calls)


def test_prefill_and_decode_layers_read_no_device_value():
    model = _model().eval()
    counter = SyncCounter()
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 5)]
    cache = KVCache(model.config.num_hidden_layers, len(prompts))
    with counter.patched(), torch.no_grad():
        handles = _count_layers(model, counter)
        logits = model.forward_layout(prefill_layout(prompts), cache).logits
        for _ in range(3):
            layout = decode_layout(logits.argmax(-1), cache.lengths)
            logits = model.forward_layout(layout, cache).logits
        for h in handles:
            h.remove()
    assert counter.calls == [], "device value reads in the hot path:\n" + "\n".join(counter.calls)


@pytest.mark.parametrize("attention_type", ["orthros", "dense"])
def test_context_parallel_attention_reads_no_device_value(attention_type):
    """CP attention of one rank (the all-gather simulated), forward and backward."""
    cfg = _model(attention_type).config
    cfg.sliding_window = 6
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    layout = pretrain_layout(ids, document_ids=torch.tensor([[0] * 13 + [1] * 27]))
    plans = [context_plan(cfg, layout, r, 2) for r in range(2)]
    c = plans[0].chunk_len
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randn(2 * c, 4, 16, generator=g) for _ in plans]

    def gather(x):  # what the CP all-gather returns: every rank's rows, rank-major
        if x.shape[0] == 2 * c:
            return torch.cat(kvs)
        tail = x.shape[0] // 2
        return torch.cat([torch.cat([y[c - tail : c], y[2 * c - tail :]]) for y in kvs])

    plan = plans[0]
    plan.gather = gather
    n_q = plan.num_base + plan.num_outputs
    q = torch.randn(n_q, 4, 16, generator=g, requires_grad=True)
    kv = kvs[0].clone().requires_grad_()
    counter = SyncCounter()
    with counter.patched(), counter.counting():
        out = plan.attend(q, kv[:, :2], kv[:, 2:], True, backend="triton")
        out.sum().backward()
    assert counter.calls == [], "device value reads in CP attention:\n" + "\n".join(counter.calls)


def test_the_counter_sees_a_sync():
    """Guard against a counter that cannot fail: the reference op (a ground truth, not a hot-path
    backend) chunks its queries on the host, and those reads are seen."""
    model = _model()
    model.config.attention_backend = "reference"
    counter = SyncCounter()
    with counter.patched():
        handles = _count_layers(model, counter)
        model.hidden_states(pretrain_layout(torch.randint(0, 64, (1, 16))))
        for h in handles:
            h.remove()
    assert counter.calls and all("ops/reference.py" in c for c in counter.calls)


@pytest.mark.gpu
def test_layer_is_sync_free_on_cuda():
    """CUDA's own detector: any synchronising call inside the layers raises."""
    model = _model().cuda().to(torch.bfloat16)
    layout = pretrain_layout(torch.randint(0, 64, (2, 256))).to("cuda")

    def step():
        plan = plan_for_layout(model.config, layout)
        x = model.embed_tokens(layout.input_ids)
        y = x[layout.output_index]
        for layer in model.layers:
            x, y = layer(x, y, plan)
        return x.float().sum() + y.float().sum()

    step().backward()  # first call: the autotuners benchmark (they synchronise), once
    torch.cuda.synchronize()
    loss = step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_tile_plan_is_built_once_per_forward_and_reused_by_the_backward(monkeypatch):
    """One sort per distinct query set of a forward (Orthros: [base; output] in the first layers,
    output only in the last), none in any later layer or in the backward."""
    model = _model()
    calls = []
    original = ta.prepare

    def counted(q_index, q_window, cu_seqlens, n_k, n_band=None, **kw):
        calls.append(n_band)
        return original(q_index, q_window, cu_seqlens, n_k, n_band, **kw)

    monkeypatch.setattr(ta, "prepare", counted)
    layout = pretrain_layout(torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1)))
    hidden = model.hidden_states(layout)
    assert calls == [layout.num_tokens, 0]  # host count of windowed queries given, never read
    hidden.float().sum().backward()
    assert len(calls) == 2


def test_launch_grids_come_from_host_counts():
    q_index = torch.cat([torch.arange(40), torch.arange(40)])
    q_window = torch.cat([torch.full((40,), 8), torch.full((40,), UNBOUNDED)])
    cu = torch.tensor([0, 40], dtype=torch.int32)
    known = ta.prepare(q_index, q_window, cu, 40, n_band=40)
    assert known.launches() == [("band", 40), ("full", 40)]
    assert ta.prepare(q_index, q_window, cu, 40, n_band=80).launches() == [("band", 80)]
    unknown = ta.prepare(q_index, q_window, cu, 40)  # nothing counted: both launches cover all rows
    assert unknown.n_band is None and unknown.launches() == [("band", 80), ("full", 80)]
    assert ta.prepare(q_index, q_window, cu, 40, count_on_cpu=True).launches() == [("band", 40), ("full", 40)]


def test_prepared_metadata_for_other_queries_is_refused():
    q_index, q_window = torch.arange(10), torch.full((10,), 4)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    prepared = ta.plan_forward(q_index, q_window, cu, 10, n_band=10)
    q, k = torch.zeros(8, 2, 16), torch.zeros(10, 1, 16)
    with pytest.raises(ValueError, match="prepare it for this call"):
        ta.attention_triton(q, k, k, q_index[:8], q_window[:8], cu, prepared=prepared)
