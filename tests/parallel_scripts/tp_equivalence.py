"""Run under torchrun (2 ranks): TP=2 with and without SP equals the reference model.

For each variant: logits, loss and every parameter's gradient (gathered back to the reference
layout) on a pretrain layout with packed documents and on an sft layout; then a checkpoint
round trip across TP sizes (TP=2 -> reference files -> TP=1 and TP=1 files -> TP=2).
Prints one ``RESULT <json>`` line on rank 0 with the worst absolute differences.

``tp_equivalence sinks=S``: the same variants with ``S`` base-stream sink tokens (the sliding
baseline instead of the dense one, which has no sinks), on layouts with documents longer than W.
``tp_equivalence tail=R`` (with or without ``sinks=S``): the global tail ``R`` on every variant
but the dense one (the SFT layout's answers then have global base queries). Any other argument
runs the first variant only.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist
from fixtures import seeded_model, tiny_config

from parallel_scripts.common import compare_step, print_result, rank_and_world, start_parallel

# Three layers (a middle one that is neither first nor last), query/key norms, a window of 5.
SHAPE = {"num_hidden_layers": 3, "sliding_window": 5, "qk_norm": True}


def main() -> None:
    from orthros_train.common.safetensors_io import SafetensorsReader
    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel
    from orthros_train.parallel.state_dict import gather_full_state_dict, load_reference_shards
    from orthros_train.phase import pretrain_layout, sft_layout
    from orthros_train.train.step import tensor_parallel_grad_norm

    rank, world = rank_and_world()
    variants = [(False, "orthros"), (True, "orthros"), (True, "dense")]
    options = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    sinks, tail = int(options.get("sinks", 0)), int(options.get("tail", 0))
    if sinks:
        variants = [(False, "orthros"), (True, "orthros"), (True, "sliding")]
    elif len(sys.argv) > 1 and not options:
        variants = variants[:1]
    start_parallel(ParallelConfig(tensor_parallel=world, data_parallel=1), tiny_config(64, **SHAPE))
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    layouts = {
        "pretrain": pretrain_layout(ids, document_ids=torch.tensor([[0] * 7 + [1] * 6, [0] * 13])),
        "sft": sft_layout(ids, [[(3, 6), (9, 12)], [(11, 13)]]),
    }
    results = {}
    for sp, attention_type in variants:
        extra = {"base_global_tail": tail} if tail and attention_type != "dense" else {}
        cfg = tiny_config(64, **SHAPE, attention_type=attention_type, tie_word_embeddings=not sp, sink_tokens=sinks,
                          **extra)  # fmt: skip
        ref = seeded_model(cfg, output_affine="resampled")
        # TP=1 weights on disk -> TP=2 model (the reference checkpoint format reshards on load).
        ckpt = tempfile.mkdtemp() if rank == 0 else None
        holder = [ckpt]
        dist.broadcast_object_list(holder, src=0)
        ckpt = holder[0]
        if rank == 0:
            ref.save_pretrained(ckpt)
        dist.barrier()
        model = build_parallel_model(cfg, ParallelConfig(tensor_parallel=world, sequence_parallel=sp))
        # Same parameter names at every TP size: the reference model's.
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        # ... and each rank holds its shards only, never the whole model.
        assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in ref.parameters())
        load_reference_shards(model, SafetensorsReader(ckpt), cfg)
        worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
        for layout in layouts.values():
            diffs, _, _ = compare_step(ref, model, cfg, layout)
            for what, err in diffs.items():
                worst[what] = max(worst[what], err)
            # The norm clipping uses: TP shards counted on every rank, replicated tensors once.
            ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters() if p.grad is not None))
            norm_err = abs(tensor_parallel_grad_norm(model) - float(ref_norm))
            worst["grad_norm"] = max(worst.get("grad_norm", 0.0), norm_err)
        # TP=2 -> reference layout -> a single-device model: same logits.
        full = gather_full_state_dict(model, cfg)
        back = OrthrosForCausalLM(cfg)
        back.load_state_dict(full)
        with torch.no_grad():
            lay = layouts["pretrain"]
            worst["roundtrip_logits"] = float(
                (back.forward_layout(lay).logits - model.forward_layout(lay).logits).abs().max()
            )
        results[f"{'sp' if sp else 'tp'}-{attention_type}"] = worst
    print_result(results, rank)
    destroy_parallel()


if __name__ == "__main__":
    main()
