"""Run under torchrun: TP (with/without SP) logits, loss and grads == the reference model."""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.parallel.model import ParallelOrthrosForCausalLM, megatron_config
    from orthros_train.parallel.setup import DistributedEnv, ParallelConfig, destroy_parallel, init_parallel
    from orthros_train.parallel.state_dict import gather_full_grads, shard_state_dict
    from orthros_train.phase import pretrain_layout, sft_layout

    sp = sys.argv[1] == "sp"
    attention_type = sys.argv[2] if len(sys.argv) > 2 else "orthros"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pcfg = ParallelConfig(tensor_parallel=world, sequence_parallel=sp, data_parallel=1)
    cfg = OrthrosConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        sliding_window=5,
        qk_norm=True,
        tie_word_embeddings=(attention_type == "orthros"),
        attention_type=attention_type,
    )
    init_parallel(pcfg, cfg, DistributedEnv(rank=rank, world_size=world, launched=True))
    torch.manual_seed(0)
    ref = OrthrosForCausalLM(cfg)
    with torch.no_grad():
        for layer in ref.layers:
            layer.self_attn.gamma.normal_(1.0, 0.3)
            layer.self_attn.beta.normal_(0.0, 0.3)
    model = ParallelOrthrosForCausalLM(cfg, megatron_config(cfg, world, sp, torch.float32))
    missing, unexpected = model.load_state_dict(shard_state_dict(ref.state_dict(), cfg, world, rank), strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    layouts = {
        "pretrain": pretrain_layout(ids, document_ids=torch.tensor([[0] * 7 + [1] * 6, [0] * 13])),
        "sft": sft_layout(ids, [[(3, 6), (9, 12)], [(11, 13)]]),
    }
    worst = {}
    for name, layout in layouts.items():
        ref.zero_grad()
        model.zero_grad()
        out_ref = ref.forward_layout(layout)
        out_ref.loss.backward()
        out = model.forward_layout(layout)
        out.loss.backward()
        grads = gather_full_grads(model, cfg)
        ref_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
        if cfg.tie_word_embeddings:
            ref_grads["lm_head.weight"] = ref_grads["embed_tokens.weight"]
        errs = {
            "logits": float((out.logits - out_ref.logits).detach().abs().max()),
            "loss": float((out.loss - out_ref.loss).detach().abs()),
        }
        missing_grads = sorted(set(ref_grads) - set(grads))
        assert not missing_grads, missing_grads
        errs["grad"] = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
        errs["worst_grad"] = max(ref_grads, key=lambda n: float((grads[n] - ref_grads[n]).abs().max()))
        worst[name] = errs
    if rank == 0:
        print("RESULT " + json.dumps(worst))
    destroy_parallel()


if __name__ == "__main__":
    main()
