"""Run under torchrun: context parallelism (optionally with TP/SP) equals the reference model.

``cp_equivalence <tp> [recompute]`` with ``world / tp`` CP ranks. For each variant: logits,
loss and every parameter's gradient (TP shards gathered, CP contributions averaged as
DeepSpeed does over the data x context parallel group) on layouts whose documents and windows
cross the chunk boundaries, one with a window longer than a chunk. Prints one ``RESULT <json>``
line on rank 0 with the worst absolute differences.

``cp_equivalence <tp> <recompute> tail=R``: every variant but the dense one with the global tail
``R`` (the SFT layout's answers then have global base queries).

``cp_equivalence <tp> <recompute> sinks=S``: the base stream with ``S`` sink tokens instead; the
variants are orthros (sink keys taken from the output stream's full gather), the sliding
baseline (sink keys gathered alone) and a mixture-of-experts orthros model. The documents that
cross chunk boundaries start on the other rank, so their sink keys live there.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from fixtures import seeded_model, tiny_config

from parallel_scripts.common import compare_step, print_result, rank_and_world, start_parallel

# Three layers, query/key norms, and YaRN beyond an original length of 16: the parallel model's
# RoPE is the reference's.
SHAPE = {
    "num_hidden_layers": 3,
    "qk_norm": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


def main() -> None:
    from megatron.core import parallel_state

    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel
    from orthros_train.parallel.state_dict import load_reference_shards
    from orthros_train.phase import pretrain_layout, sft_layout

    rank, world = rank_and_world()
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    recompute = sys.argv[2] if len(sys.argv) > 2 else "none"
    options = dict(a.split("=", 1) for a in sys.argv[3:])
    sinks, tail = int(options.get("sinks", 0)), int(options.get("tail", 0))
    cp = world // tp
    pcfg = ParallelConfig(tensor_parallel=tp, context_parallel=cp, sequence_parallel=tp > 1, recompute=recompute)
    start_parallel(pcfg, tiny_config(64, **SHAPE))
    assert parallel_state.get_context_parallel_world_size() == cp
    g = torch.Generator().manual_seed(1)
    # 2 rows x 23 tokens = 46 -> padded to 48 = 4 chunks of 12 at CP=2: the first row's second
    # document (positions 9..22) and the second row cross chunk boundaries.
    ids = torch.randint(0, 64, (2, 23), generator=g)
    layouts = {
        "pretrain": pretrain_layout(ids, document_ids=torch.tensor([[0] * 9 + [1] * 14, [0] * 23])),
        "sft": sft_layout(ids, [[(3, 6), (12, 20)], [(14, 23)]]),
    }

    def average_over_context_ranks(model) -> None:  # what DeepSpeed does over the data x context group
        from orthros_train.parallel.engine import is_expert_parameter

        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        for p in model.parameters():
            if p.grad is None:
                continue
            if is_expert_parameter(p):
                # DeepSpeed's MoE reduction: summed over the expert-data-parallel group (with TP+SP
                # every TP rank routes its own tokens through its copy of the experts), / dp
                dist.all_reduce(p.grad, group=parallel_state.get_expert_data_parallel_group())
                p.grad /= dp
            else:
                dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
                p.grad /= cp

    # (attention type, window): 5 crosses chunk boundaries; 20 is longer than a chunk (12), so
    # a halo reaches back more than one chunk.
    variants = [("orthros", 5), ("orthros", 20), ("dense", 5), ("sliding", 5)]
    if sinks:
        variants = [("orthros", 5), ("orthros", 20), ("sliding", 5), ("moe", 5)]
    results = {}
    for attention_type, window in variants:
        extra = {"sink_tokens": sinks} if sinks else {}
        if tail and attention_type != "dense":
            extra["base_global_tail"] = tail
        if attention_type == "moe":
            # EP = 1: every CP rank holds all experts. No router loss: each CP rank balances its own
            # chunk's routing by design, which is not the single-device sequence's balance.
            extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.0)
        kind = "orthros" if attention_type == "moe" else attention_type
        cfg = tiny_config(64, **SHAPE, attention_type=kind, sliding_window=window, **extra)
        ref = seeded_model(cfg, output_affine="resampled")
        model = build_parallel_model(cfg, pcfg)
        load_reference_shards(model, ref.state_dict(), cfg)
        for name, layout in layouts.items():
            diffs, _, _ = compare_step(ref, model, cfg, layout, reduce_grads=average_over_context_ranks)
            results[f"{attention_type}-w{window}-{name}"] = diffs
    print_result(results, rank)
    destroy_parallel()


if __name__ == "__main__":
    main()
