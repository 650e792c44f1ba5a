"""What the torchrun scripts share: this rank's place in the launch, the process groups, the
reference model's gradients in the layout the sharded model gathers to, one forward/backward
compared on both models, and the ``RESULT <json>`` line the tests read (``fixtures.result_of``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch


def rank_and_world() -> tuple[int, int]:
    """This rank and the world size, as torchrun sets them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def start_parallel(pcfg, cfg) -> None:
    """torch.distributed and megatron's groups for ``pcfg`` with the launcher's variables."""
    from orthros_train.parallel.setup import init_parallel
    from orthros_train.train.cli import launcher_env

    init_parallel(pcfg, cfg, launcher_env())


def reference_grads(ref, cfg) -> dict[str, torch.Tensor]:
    """The single-device model's gradients by name (zeros where none flowed), with the tied LM
    head's under its own name as the gathered sharded model has it."""
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    if cfg.tie_word_embeddings:
        grads["lm_head.weight"] = grads["embed_tokens.weight"]
    return grads


def compare_step(ref, model, cfg, layout, reduce_grads: Callable[[object], None] | None = None):
    """One forward and backward of ``layout`` on the reference and on the sharded model (its
    gradients passed through ``reduce_grads`` first, when the test stands in for DeepSpeed's
    reduction). Returns the worst absolute differences of logits, loss and gathered gradients, and
    both outputs."""
    from orthros_train.parallel.state_dict import gather_full_grads

    ref.zero_grad()
    model.zero_grad()
    out_ref = ref.forward_layout(layout)
    out_ref.loss.backward()
    out = model.forward_layout(layout)
    out.loss.backward()
    if reduce_grads is not None:
        reduce_grads(model)
    grads, ref_g = gather_full_grads(model, cfg), reference_grads(ref, cfg)
    assert set(ref_g) <= set(grads), sorted(set(ref_g) - set(grads))
    diffs = {
        "logits": float((out.logits - out_ref.logits).detach().abs().max()),
        "loss": float((out.loss - out_ref.loss).detach().abs()),
        "grad": max(float((grads[n] - g).abs().max()) for n, g in ref_g.items()),
    }
    return diffs, out, out_ref


def print_result(results: dict, rank: int) -> None:
    """The ``RESULT <json>`` line, from rank 0 only."""
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
