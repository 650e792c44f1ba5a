"""AdamW with the usual decay/no-decay split and a warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from orthros_train.errors import UserError
from orthros_train.train.config import OptimConfig


class AdamW(torch.optim.AdamW):
    """AdamW whose param groups may be held still for their first ``frozen_steps`` updates.

    A held group steps at learning rate 0: its moments still follow its gradients, its weights do
    not move. The count is the group's AdamW ``step`` state, which a checkpoint restores, so a
    resumed run continues it; where a wrapper keeps that state elsewhere, the updates counted here.
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        held = []
        for group in self.param_groups:
            frozen = group.get("frozen_steps", 0)
            state = self.state.get(group["params"][0], {}) if group["params"] else {}
            if frozen and int(state.get("step", group.get("updates", 0))) < frozen:
                held.append((group, group["lr"]))
                group["lr"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, lr in held:
                group["lr"] = lr
            for group in self.param_groups:
                group["updates"] = group.get("updates", 0) + 1


def freeze_untrainable(model: nn.Module, pattern: str | None) -> None:
    """``optim.trainable``: every parameter whose name ``pattern`` does not match stops requiring
    a gradient, so autograd skips its weight gradient and the optimizer holds no state for it."""
    if pattern is None:
        return
    rule = re.compile(pattern)
    named = list(model.named_parameters())
    if not any(rule.search(name) for name, _ in named):
        raise UserError(
            f"optim.trainable={pattern!r} matches no parameter of the model (names look like "
            f"{named[0][0]!r}); fix the pattern or leave it unset"
        )
    for name, p in named:
        if not rule.search(name):
            p.requires_grad_(False)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    # Norm weights, biases and the output-stream query affine (gamma/beta) are scales and shifts:
    # decaying them towards 0 would fight their initialisation (1/0), as for norms in Llama.
    freeze_untrainable(model, cfg.trainable)
    decay, no_decay, affine = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith(("gamma", "beta")):
            affine.append(p)
        elif p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    # optim.frozen_steps: a converted model's first updates move only the output-stream affine,
    # the one part conversion adds; every pretrained weight waits (docs/convert.md).
    held = {"frozen_steps": cfg.frozen_steps} if cfg.frozen_steps else {}
    groups = [
        {"name": "decay", "params": decay, "weight_decay": cfg.weight_decay, **held},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0, **held},
        {"name": "affine", "params": affine, "weight_decay": 0.0},
    ]
    # (allreduce=False: DeepSpeed's mark of an MoE parameter, parallel/moe.py sets it)
    if any(getattr(p, "allreduce", True) is False for p in decay + no_decay):
        # Experts split over ranks: DeepSpeed's own split into MoE param groups (one per expert
        # group and decay setting), which ZeRO partitions over the expert-data-parallel group.
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    groups = [g for g in groups if g["params"]]
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then decay to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
