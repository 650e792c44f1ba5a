"""Activation recompute (parallel.recompute): same gradients, fewer saved activations."""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_config

from orthros_train.model import OrthrosForCausalLM
from orthros_train.parallel.model import build_parallel_model
from orthros_train.parallel.setup import DistributedEnv, ParallelConfig, destroy_parallel, init_parallel
from orthros_train.parallel.state_dict import gather_full_grads, load_reference_shards
from orthros_train.phase import pretrain_layout

CFG = tiny_config(
    64,
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    sliding_window=16,
    # The plain-torch op keeps its scores/probabilities for the backward, which is what selective
    # recompute drops; the fused SDPA path that "auto" picks on CPU keeps little to drop.
    attention_backend="reference",
)


@pytest.fixture(scope="module")
def one_process_group():
    init_parallel(ParallelConfig(backend="gloo"), CFG, DistributedEnv())
    yield
    destroy_parallel()


def _saved_bytes_and_grads(recompute: str, layout) -> tuple[int, dict[str, torch.Tensor], float]:
    torch.manual_seed(0)
    ref = OrthrosForCausalLM(CFG)
    model = build_parallel_model(CFG, ParallelConfig(recompute=recompute))
    load_reference_shards(model, ref.state_dict(), CFG)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.forward_layout(layout, return_logits=False).loss
    loss.backward()
    return sum(saved), gather_full_grads(model, CFG), float(loss.detach())


def test_recompute_keeps_gradients_and_saves_less(one_process_group):
    ids = torch.randint(0, 64, (1, 256), generator=torch.Generator().manual_seed(0))
    layout = pretrain_layout(ids)
    results = {mode: _saved_bytes_and_grads(mode, layout) for mode in ("none", "selective", "full")}
    none_bytes, none_grads, none_loss = results["none"]
    for mode in ("selective", "full"):
        nbytes, grads, loss = results[mode]
        assert loss == none_loss
        assert max(float((grads[n] - g).abs().max()) for n, g in none_grads.items()) <= 1e-6, mode
    # Selective drops the attention op's internals (scores/probabilities of every chunk); full
    # keeps only each layer's inputs.
    assert results["selective"][0] < 0.8 * none_bytes, (results["selective"][0], none_bytes)
    assert results["full"][0] < 0.5 * results["selective"][0], (results["full"][0], results["selective"][0])
