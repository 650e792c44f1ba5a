"""Run under torchrun (2 ranks): generation on the sharded model equals the reference model.

For TP = 2 (with and without SP) and CP = 2: prefill logits, greedy and seeded sampled
continuations through ``infer.generate`` (prefill + decode with the KV cache) on this rank's
shards against a single-device model with the same weights; and no tensor of the full
``vocab x hidden`` embedding shape is created on a TP rank while it generates.
Prints one ``RESULT <json>`` line on rank 0.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fixtures import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_scripts.common import print_result, start_parallel


class ShapeLog(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


def main() -> None:
    from orthros_train.infer import SamplingParams, generate
    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel
    from orthros_train.parallel.state_dict import gather_full_state_dict

    cfg = tiny_config(48, sliding_window=3, qk_norm=True, attention_backend="reference")
    prompts = [[5, 7, 9, 11, 3, 2], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47]]
    results = {}
    # One process group per run: TP = 2 (with and without SP), or CP = 2 with argument "cp".
    variants = {
        "tp2": ParallelConfig(tensor_parallel=2),
        "tp2_sp": ParallelConfig(tensor_parallel=2, sequence_parallel=True),
    }
    if sys.argv[1:] == ["cp"]:
        variants = {"cp2": ParallelConfig(context_parallel=2)}
    start_parallel(next(iter(variants.values())), cfg)
    for name, pcfg in variants.items():
        model = build_parallel_model(cfg, pcfg, seed=3).eval()
        ref = OrthrosForCausalLM(cfg)
        ref.load_state_dict(gather_full_state_dict(model, cfg))
        ref.eval()
        with torch.no_grad():
            ids = torch.tensor([prompts[0]])
            logit_diff = float((model.prefill(ids)[0] - ref.prefill(ids)[0]).abs().max())
        same = True
        log = ShapeLog()
        for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)):
            for p in prompts:
                with log:
                    mine = generate(model, [p] * 3, params).sequences
                same &= mine == generate(ref, [p] * 3, params).sequences
        full_embedding = (cfg.vocab_size, cfg.hidden_size) in log.shapes
        results[name] = {"logit_diff": logit_diff, "same_tokens": bool(same), "full_embedding": full_embedding}
    rank = dist.get_rank()
    destroy_parallel()
    print_result(results, rank)


if __name__ == "__main__":
    main()
