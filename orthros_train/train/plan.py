"""What a dry run prints (``trainer.dry_run=true``): the plan of a run, nothing built but a
meta-device model."""

from __future__ import annotations

from typing import Any

import torch

from orthros_train.model import OrthrosForCausalLM
from orthros_train.ops.route import describe_routes
from orthros_train.options import Device, Precision
from orthros_train.parallel.setup import check_parallel_layout
from orthros_train.train.config import RunConfig
from orthros_train.train.memory import memory_summary
from orthros_train.train.metrics import PEAK_BF16_TFLOPS, TERA, layout_flops, model_flops_per_token

# The MFU a cluster run is planned at (the figure the plan's expected throughput assumes).
PLANNED_MFU = 0.40


def plan_summary(cfg: RunConfig) -> dict[str, Any]:
    """Figures a dry run prints: parameters, tokens per step, steps, FLOPs per token."""
    check_parallel_layout(cfg.parallel, cfg.model)
    with torch.device("meta"):
        model = OrthrosForCausalLM(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    t = cfg.trainer
    flops = model_flops_per_token(cfg.model, t.seq_len)
    distill = _distill_plan(cfg) if cfg.distill.enabled else None
    if distill is not None:  # the teacher's forward runs every micro batch: part of a step's work
        flops += distill["teacher_flops_per_token"]
    summary: dict[str, Any] = {
        "attention_type": cfg.model.attention_type,
        "parameters": params,
        "non_embedding_parameters": params - cfg.model.vocab_size * cfg.model.hidden_size,
        "parallel": {
            "tensor_parallel": cfg.parallel.tensor_parallel,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "context_parallel": cfg.parallel.context_parallel,
            "expert_parallel": cfg.parallel.expert_parallel,
            "data_parallel": cfg.parallel.data_parallel,
            "zero_stage": cfg.parallel.zero_stage,
            "recompute": cfg.parallel.recompute,
            "world_size": cfg.parallel.world_size,
        },
        # derived from the world size (orthros_train/train/config.py resolve_batch_geometry)
        "global_batch_size": cfg.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": t.grad_accum_steps,
        "tokens_per_step": cfg.tokens_per_step,
        "total_steps": t.max_steps,
        "total_tokens": t.max_steps * cfg.tokens_per_step,
        "recipe_token_budget": t.total_tokens,
        "flops_per_token": flops,
        "total_flops": flops * t.max_steps * cfg.tokens_per_step,
        "seq_len": t.seq_len,
        "sliding_window": cfg.model.sliding_window,
        # sink tokens: S more keys per base query beyond its window (S/W more base-stream attention
        # work, in flops_per_token), no extra KV memory
        "sink_tokens": cfg.model.sink_tokens,
        "base_attention_work": 1 + cfg.model.base_sink_tokens / cfg.model.sliding_window,
        # the global tail: R base queries per prompt (and each generated token) see the whole
        # document: x(1 + R/(W+S)) the base-stream attention of a long prefill; in training only
        # SFT/RL answers and their prompt tails: the live MFU counts them (layout_flops of each
        # batch); flops_per_token above is a pretraining layout's, which has no tail
        "base_global_tail": cfg.model.base_global_tail,
        "prefill_base_attention_work": 1 + cfg.model.base_global_tail / (cfg.model.sliding_window
                                                                          + cfg.model.base_sink_tokens),
        "init_from": cfg.init.init_from,
        # What a cluster would do: H100 bf16 peak (or trainer.peak_tflops) at the planned MFU.
        "expected_at_40pct_mfu": _expected_throughput(cfg, flops, PLANNED_MFU),
        "memory_per_gpu": memory_summary(cfg),  # analytic model, per sequence-length stage
        "attention_route": attention_routes(cfg),
    }
    m = cfg.model
    if m.num_experts:  # a mixture of experts: what a token uses of it
        inactive = sum(m.mlp_parameters(i) - m.mlp_parameters(i, active=True) for i in range(m.num_hidden_layers))
        summary["experts"] = {
            "num_experts": m.num_experts,
            "top_k": m.num_experts_per_tok,
            "sparse_layers": len(m.sparse_layers),
            "routing": m.moe_routing,
            "active_parameters": params - inactive,
            "experts_per_rank": m.num_experts // cfg.parallel.expert_parallel,
        }
    if distill is not None:
        summary["distill"] = distill
    if cfg.rl is not None:  # an RL recipe: what one step samples and trains on
        rows = cfg.rl.prompts_per_step * cfg.rl.group_size
        summary["rl"] = {"task": cfg.task.name, "rollouts_per_step": rows,
                         "max_response_tokens_per_step": rows * cfg.rl.max_new_tokens}
    return summary


def attention_routes(cfg: RunConfig, device_type: str | None = None) -> dict[str, dict[str, str]]:
    """The attention kernel each kind of layout of this run takes (``ops/route.py``), per device
    type: ``device_type``, else the recipe's device (``auto``: both, a dry run may plan a GPU job
    from a machine without one)."""
    m, t = cfg.model, cfg.trainer
    if device_type is not None:
        devices = [device_type]
    else:
        devices = {Device.cpu: ["cpu"], Device.cuda: ["cuda"]}.get(t.device, ["cuda", "cpu"])
    if m.attention_backend != "auto":
        return {d: {"every layout": f"{m.attention_backend} (model.attention_backend)"} for d in devices}
    dtype = torch.bfloat16 if t.precision == Precision.bf16 else torch.float32
    return {
        d: describe_routes(d, dtype, m.head_dim, m.attention_type.value, m.sliding_window, t.seq_len,
                           m.base_sink_tokens, t.deterministic)
        for d in devices
    }


def _distill_plan(cfg: RunConfig) -> dict[str, Any]:
    """What distillation adds to a run: the teacher, its size and the FLOPs of its forward."""
    from orthros_train.phase.builders import pretrain_layout
    from orthros_train.train.teacher import planned_teacher_config

    d = cfg.distill
    teacher, source = planned_teacher_config(cfg)
    with torch.device("meta"):
        params = sum(p.numel() for p in OrthrosForCausalLM(teacher).parameters())
    layout = pretrain_layout(torch.zeros((1, cfg.trainer.seq_len), dtype=torch.long))
    return {
        "teacher": d.teacher,
        "teacher_config": source,
        "teacher_parameters": params,  # frozen, outside DeepSpeed: replicated over ZeRO (docs/memory.md)
        "teacher_flops_per_token": layout_flops(teacher, layout, training=False) / cfg.trainer.seq_len,
        "alpha": d.alpha,
        "temperature": d.temperature,
        "beyond_window_only": d.beyond_window_only,
        "align": d.align,
        "align_steps": d.align_steps,
    }


def _expected_throughput(cfg: RunConfig, flops_per_token: float, mfu: float) -> dict[str, float]:
    peak = cfg.trainer.peak_tflops or PEAK_BF16_TFLOPS["H100"]
    tokens_per_s = mfu * peak * TERA * cfg.parallel.world_size / flops_per_token
    return {
        "peak_tflops_per_device": peak,
        "devices": cfg.parallel.world_size,
        "tokens_per_s": tokens_per_s,
        "step_time_s": cfg.tokens_per_step / tokens_per_s,
        "days_for_run": cfg.trainer.max_steps * cfg.tokens_per_step / tokens_per_s / 86400,
    }


__all__ = ["attention_routes", "plan_summary"]
