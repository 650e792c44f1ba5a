"""Run under torchrun: context parallelism (optionally with TP/SP) equals the reference model.

``cp_equivalence.py <tp> [recompute]`` with ``world / tp`` CP ranks. For each variant: logits,
loss and every parameter's gradient (TP shards gathered, CP contributions averaged as
DeepSpeed does over the data x context parallel group) on layouts whose documents and windows
cross the chunk boundaries, one with a window longer than a chunk. Prints one ``RESULT <json>``
line on rank 0 with the worst absolute differences.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from tp_equivalence import reference_grads  # this script's folder is on sys.path


def main() -> None:
    from megatron.core import parallel_state

    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel, init_parallel
    from orthros_train.parallel.state_dict import gather_full_grads, load_reference_shards
    from orthros_train.phase import pretrain_layout, sft_layout
    from orthros_train.train.cli import launcher_env

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    recompute = sys.argv[2] if len(sys.argv) > 2 else "none"
    cp = world // tp
    base_cfg = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        qk_norm=True,
        # YaRN beyond an original length of 16: the parallel model's RoPE is the reference's.
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )
    pcfg = ParallelConfig(tensor_parallel=tp, context_parallel=cp, sequence_parallel=tp > 1, recompute=recompute)
    init_parallel(pcfg, OrthrosConfig(**base_cfg), launcher_env())
    assert parallel_state.get_context_parallel_world_size() == cp
    g = torch.Generator().manual_seed(1)
    # 2 rows x 23 tokens = 46 -> padded to 48 = 4 chunks of 12 at CP=2: the first row's second
    # document (positions 9..22) and the second row cross chunk boundaries.
    ids = torch.randint(0, 64, (2, 23), generator=g)
    layouts = {
        "pretrain": pretrain_layout(ids, document_ids=torch.tensor([[0] * 9 + [1] * 14, [0] * 23])),
        "sft": sft_layout(ids, [[(3, 6), (12, 20)], [(14, 23)]]),
    }
    # (attention type, window): 5 crosses chunk boundaries; 20 is longer than a chunk (12), so
    # a halo reaches back more than one chunk.
    variants = [("orthros", 5), ("orthros", 20), ("dense", 5), ("sliding", 5)]
    results = {}
    for attention_type, window in variants:
        cfg = OrthrosConfig(**base_cfg, attention_type=attention_type, sliding_window=window)
        torch.manual_seed(0)
        ref = OrthrosForCausalLM(cfg)
        with torch.no_grad():
            for layer in ref.layers:
                layer.self_attn.gamma.normal_(1.0, 0.3)
                layer.self_attn.beta.normal_(0.0, 0.3)
        model = build_parallel_model(cfg, pcfg)
        load_reference_shards(model, ref.state_dict(), cfg)
        for name, layout in layouts.items():
            ref.zero_grad()
            model.zero_grad()
            out_ref = ref.forward_layout(layout)
            out_ref.loss.backward()
            out = model.forward_layout(layout)
            out.loss.backward()
            for p in model.parameters():  # what DeepSpeed does over the data x context group
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
                    p.grad /= cp
            grads, ref_g = gather_full_grads(model, cfg), reference_grads(ref, cfg)
            assert set(ref_g) <= set(grads), sorted(set(ref_g) - set(grads))
            results[f"{attention_type}-w{window}-{name}"] = {
                "logits": float((out.logits - out_ref.logits).abs().max()),
                "loss": float((out.loss - out_ref.loss).detach().abs()),
                "grad": max(float((grads[n] - gr).abs().max()) for n, gr in ref_g.items()),
            }
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
