"""Run under torchrun (2 ranks): the mixture of experts with expert parallelism equals the
single-device model. Prints ``RESULT <json>`` on rank 0.

* One forward/backward (logits, loss with the router losses, every gradient) for EP = 2 on the two
  data-parallel ranks, TP = 2 + SP with EP = 2 (the EP group is the TP group; all three routing
  policies) and TP = 2 + SP with EP = 1 (every rank holds all experts, each routes its own
  tokens), with a shared expert and the z-loss, on a packed pretrain layout and an sft layout (base tokens
  without an output token). The gradients are reduced as DeepSpeed reduces them (experts: summed
  over the expert-data-parallel group, divided by the data-parallel size).
* Three AdamW steps with gradient clipping through DeepSpeed: EP = 2 on DP = 2 with ZeRO 0, 1
  and 2 and ZeRO-1 with the optimizer offloaded (each rank its own micro batch), and TP = 2 + SP
  with EP = 2 under ZeRO-1, against one process on the same global batch (weights and the
  clipped step's gradient norm).
"""

from __future__ import annotations

import torch
from fixtures import seeded_model, tiny_config

from parallel_scripts.common import compare_step, print_result, rank_and_world, start_parallel


def moe_config(routing: str = "tied"):
    return tiny_config(
        64, sliding_window=4, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=16, router_aux_loss_coef=0.05,
        router_z_loss_coef=0.01, moe_routing=routing,
    )  # fmt: skip


def reduce_like_deepspeed(model) -> None:
    """Expert gradients as DeepSpeed's MoE path reduces them: summed over the expert-data-parallel
    group, divided by the data-parallel size. The dense ones are equal on every rank here (every
    rank ran the same layout), so their data-parallel average is themselves."""
    from megatron.core import parallel_state

    from orthros_train.parallel import collectives
    from orthros_train.parallel.engine import is_expert_parameter

    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    for p in model.parameters():
        if is_expert_parameter(p) and p.grad is not None:
            collectives.all_reduce(p.grad, group=parallel_state.get_expert_data_parallel_group())
            p.grad /= dp


def restart_groups() -> None:
    """megatron's groups of the next layout (the torch.distributed group stays)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def forward_backward(results: dict) -> None:
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig
    from orthros_train.parallel.state_dict import load_reference_shards
    from orthros_train.phase import pretrain_layout, sft_layout

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 11), generator=g)
    layouts = {
        "pretrain": pretrain_layout(tokens, document_ids=torch.tensor([[0] * 6 + [1] * 5, [0] * 11])),
        "sft": sft_layout(tokens, [[(3, 6), (8, 11)], [(5, 11)]]),
    }
    layouts_checked = False
    # The policies meet the parallelism where a position's base and output tokens sit on different
    # ranks (SP): all three there; the default (tied) elsewhere.
    variants = {"ep2": (1, 2, ["tied"]), "tp2-sp-ep2": (2, 2, ["tied", "joint", "independent"]),
                "tp2-sp": (2, 1, ["tied"])}  # fmt: skip
    for name, (tp, ep, policies) in variants.items():
        pcfg = ParallelConfig(tensor_parallel=tp, sequence_parallel=tp > 1, expert_parallel=ep)
        for routing in policies:
            cfg = moe_config(routing)
            start_parallel(pcfg, cfg)
            ref = seeded_model(cfg)
            model = build_parallel_model(cfg, pcfg)
            load_reference_shards(model, ref.state_dict(), cfg)
            if not layouts_checked:  # the sft layout really has base tokens without an output token
                assert layouts["sft"].num_outputs < layouts["sft"].num_tokens
                layouts_checked = True
            for layout_name, layout in layouts.items():
                diffs, out, out_ref = compare_step(ref, model, cfg, layout, reduce_like_deepspeed)
                diffs["router_loss"] = float((out.router_loss - out_ref.router_loss).abs())
                results[f"{name}-{routing}-{layout_name}"] = diffs
            restart_groups()


def steps(results: dict, rank: int, world: int) -> None:
    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.parallel.engine import build_engine
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import ParallelConfig
    from orthros_train.parallel.state_dict import gather_full_state_dict, load_reference_shards
    from orthros_train.phase import pretrain_layout
    from orthros_train.train.config import OptimConfig
    from orthros_train.train.optim import build_optimizer

    cfg = moe_config()
    # A clip that binds on every step (the norm is ~1-3 here), so a miscounted norm shows. Adam's
    # eps raised from 1e-8: experts that few tokens reach have gradient entries of ~1e-7, which
    # Adam's first steps turn into updates of ~lr whatever their size, so summation-order noise
    # of 1e-8 in them would move those weights by ~1e-5; with eps = 1e-3 an update is linear in
    # such a gradient and the weights compare the gradients.
    ocfg = OptimConfig(lr=1e-2, min_lr=1e-2, warmup_steps=0, schedule="constant", grad_clip=0.5, eps=1e-3)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (world, 12), generator=g) for _ in range(3)]
    init = seeded_model(cfg).state_dict()

    def reference(rows_per_forward: int) -> tuple[dict, list[float]]:
        ref = OrthrosForCausalLM(cfg)
        ref.load_state_dict(init)
        opt = build_optimizer(ref, ocfg)
        norms = []
        for batch in batches:
            opt.zero_grad()
            parts = [batch[r : r + rows_per_forward] for r in range(0, world, rows_per_forward)]
            loss = sum(ref.forward_layout(pretrain_layout(p)).loss for p in parts) / len(parts)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), ocfg.grad_clip)))
            opt.step()
        return ref.state_dict(), norms

    per_rank, whole = reference(1), reference(world)
    runs = {
        "dp2-ep2-zero0": (ParallelConfig(data_parallel=world, expert_parallel=2, zero_stage=0), per_rank),
        "dp2-ep2-zero1": (ParallelConfig(data_parallel=world, expert_parallel=2, zero_stage=1), per_rank),
        "dp2-ep2-zero2": (ParallelConfig(data_parallel=world, expert_parallel=2, zero_stage=2), per_rank),
        "dp2-ep2-zero1-offload": (
            ParallelConfig(data_parallel=world, expert_parallel=2, zero_stage=1, offload_optimizer=True), per_rank,
        ),
        "tp2-sp-ep2-zero1": (
            ParallelConfig(tensor_parallel=2, sequence_parallel=True, expert_parallel=2, zero_stage=1), whole,
        ),
    }  # fmt: skip
    for name, (pcfg, (expected, ref_norms)) in runs.items():
        start_parallel(pcfg, cfg)
        model = build_parallel_model(cfg, pcfg)
        load_reference_shards(model, init, cfg)
        engine = build_engine(
            model, pcfg, build_optimizer(model, ocfg), micro_batch_size=1, grad_accum_steps=1, grad_clip=ocfg.grad_clip
        )
        norms = []
        for batch in batches:
            rows = batch[rank : rank + 1] if pcfg.data_parallel == world else batch
            out = engine(pretrain_layout(rows))
            engine.backward(out.loss)
            if pcfg.zero_stage == 0:
                from orthros_train.parallel.engine import global_grad_norm

                norms.append(global_grad_norm(engine.module))
            engine.step()
            if pcfg.zero_stage > 0:
                norms.append(float(engine.get_global_grad_norm()))
        got = gather_full_state_dict(engine.module, cfg)
        results[name] = {
            "weights": max(float((got[k] - expected[k]).abs().max()) for k in expected),
            "grad_norm": max(abs(a - b) for a, b in zip(norms, ref_norms)),
        }
        del engine
        restart_groups()


def main() -> None:
    from orthros_train.parallel.setup import destroy_parallel

    rank, world = rank_and_world()
    results: dict = {}
    forward_backward(results)
    steps(results, rank, world)
    print_result(results, rank)
    destroy_parallel()


if __name__ == "__main__":
    main()
