"""Run under torchrun (2 ranks): TP=2 with and without SP equals the reference model.

For each variant: logits, loss and every parameter's gradient (gathered back to the reference
layout) on a pretrain layout with packed documents and on an sft layout; then a checkpoint
round trip across TP sizes (TP=2 -> reference files -> TP=1 and TP=1 files -> TP=2).
Prints one ``RESULT <json>`` line on rank 0 with the worst absolute differences.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist


def reference_grads(ref, cfg):
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    if cfg.tie_word_embeddings:
        grads["lm_head.weight"] = grads["embed_tokens.weight"]
    return grads


def main() -> None:
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel, init_parallel
    from orthros_train.parallel.state_dict import (
        LazyCheckpoint,
        gather_full_grads,
        gather_full_state_dict,
        load_reference_shards,
    )
    from orthros_train.phase import pretrain_layout, sft_layout
    from orthros_train.train.cli import launcher_env
    from orthros_train.train.step import tensor_parallel_grad_norm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    variants = [(False, "orthros"), (True, "orthros"), (True, "dense")]
    if len(sys.argv) > 1:
        variants = variants[:1]
    base_cfg = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        sliding_window=5,
        qk_norm=True,
    )
    init_parallel(
        ParallelConfig(tensor_parallel=world, data_parallel=1),
        OrthrosConfig(**base_cfg),
        launcher_env(),
    )
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    layouts = {
        "pretrain": pretrain_layout(ids, document_ids=torch.tensor([[0] * 7 + [1] * 6, [0] * 13])),
        "sft": sft_layout(ids, [[(3, 6), (9, 12)], [(11, 13)]]),
    }
    results = {}
    for sp, attention_type in variants:
        cfg = OrthrosConfig(**base_cfg, attention_type=attention_type, tie_word_embeddings=not sp)
        torch.manual_seed(0)
        ref = OrthrosForCausalLM(cfg)
        with torch.no_grad():
            for layer in ref.layers:
                layer.self_attn.gamma.normal_(1.0, 0.3)
                layer.self_attn.beta.normal_(0.0, 0.3)
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
        load_reference_shards(model, LazyCheckpoint(ckpt), cfg)
        worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0}
        for layout in layouts.values():
            ref.zero_grad()
            model.zero_grad()
            out_ref = ref.forward_layout(layout)
            out_ref.loss.backward()
            out = model.forward_layout(layout)
            out.loss.backward()
            grads, ref_g = gather_full_grads(model, cfg), reference_grads(ref, cfg)
            assert set(ref_g) <= set(grads), sorted(set(ref_g) - set(grads))
            worst["logits"] = max(worst["logits"], float((out.logits - out_ref.logits).detach().abs().max()))
            worst["loss"] = max(worst["loss"], float((out.loss - out_ref.loss).detach().abs()))
            worst["grad"] = max(worst["grad"], max(float((grads[n] - g).abs().max()) for n, g in ref_g.items()))
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
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
