"""Run under torchrun (2 ranks, DP=2): three optimizer steps with DeepSpeed ZeRO 1/2/3 equal a
single process that sees the same global batch. Prints ``RESULT <json>`` on rank 0."""

from __future__ import annotations

import torch
from fixtures import seeded_model, tiny_config

from parallel_scripts.common import print_result, rank_and_world, start_parallel


def main() -> None:
    import deepspeed

    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.parallel.engine import build_engine
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig, destroy_parallel
    from orthros_train.parallel.state_dict import gather_full_state_dict, load_reference_shards
    from orthros_train.phase import pretrain_layout
    from orthros_train.train.config import OptimConfig
    from orthros_train.train.optim import build_optimizer

    rank, world = rank_and_world()
    cfg = tiny_config(64, sliding_window=4, tie_word_embeddings=True)
    ocfg = OptimConfig(lr=1e-2, min_lr=1e-2, warmup_steps=0, schedule="constant", grad_clip=1.0)
    start_parallel(ParallelConfig(tensor_parallel=1, data_parallel=world), cfg)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (world, 12), generator=g) for _ in range(3)]

    init = seeded_model(cfg).state_dict()
    ref = OrthrosForCausalLM(cfg)
    ref.load_state_dict(init)
    opt = build_optimizer(ref, ocfg)
    for batch in batches:
        opt.zero_grad()
        loss = sum(ref.forward_layout(pretrain_layout(batch[r : r + 1])).loss for r in range(world)) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ocfg.grad_clip)
        opt.step()
    expected = ref.state_dict()

    results = {}
    for stage, offload in ((0, False), (1, False), (2, False), (3, False), (2, True)):
        pcfg = ParallelConfig(tensor_parallel=1, data_parallel=world, zero_stage=stage, offload_optimizer=offload)
        model = build_parallel_model(cfg, pcfg)
        load_reference_shards(model, init, cfg)
        engine = build_engine(
            model, pcfg, build_optimizer(model, ocfg), micro_batch_size=1, grad_accum_steps=1, grad_clip=ocfg.grad_clip
        )
        losses = []
        for batch in batches:
            out = engine(pretrain_layout(batch[rank : rank + 1]))
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss))
        if stage == 3:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                got = {k: v.clone() for k, v in gather_full_state_dict(engine.module, cfg).items()}
        else:
            got = gather_full_state_dict(engine.module, cfg)
        results[f"zero{stage}" + ("_offload" if offload else "")] = max(
            float((got[k] - expected[k]).abs().max()) for k in expected
        )
        del engine
    print_result(results, rank)
    destroy_parallel()


if __name__ == "__main__":
    main()
