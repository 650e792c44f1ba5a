"""RoPE angles once per forward, and the regional torch.compile switch (parallel/compile.py):
the same loss and gradients as eager, the same parameter names."""

from __future__ import annotations

import copy

import pytest
import torch
from fixtures import tiny_model

from orthros_train.model.layers import RotaryEmbedding
from orthros_train.parallel.compile import REGIONS, apply_regional_compile
from orthros_train.phase.builders import pretrain_layout


def batch(vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    return pretrain_layout(ids, labels=torch.roll(ids, -1, 1))


def test_rope_angles_are_computed_once_per_forward(monkeypatch) -> None:
    calls = []
    original = RotaryEmbedding.cos_sin
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", lambda self, p: calls.append(p.numel()) or original(self, p))
    model = tiny_model(num_hidden_layers=3, sliding_window=8)
    model.forward_layout(batch())
    # once for the base positions, once for the output positions, whatever the depth
    assert calls == [80, 80], calls


@pytest.mark.slow  # inductor compiles three small graphs (~20 s on one core)
def test_regional_compile_equals_eager() -> None:
    torch.manual_seed(0)
    eager = tiny_model(num_hidden_layers=2, sliding_window=8)
    fused = copy.deepcopy(eager)
    assert apply_regional_compile(fused) == sum(isinstance(m, REGIONS) for m in eager.modules()) > 0
    assert list(fused.state_dict()) == list(eager.state_dict())  # checkpoints do not change
    for seed in (0, 1):  # a second batch of another length: dynamic shapes, no wrong reuse
        layout = batch(seed=seed)
        losses = []
        for model in (eager, fused):
            model.zero_grad()
            loss = model.forward_layout(layout).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for (name, a), (_, b) in zip(eager.named_parameters(), fused.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
