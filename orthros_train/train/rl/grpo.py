"""The GRPO math on rl layouts.

The loss (``grpo_loss``) is the PPO clipped surrogate on per-token advantages
``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with ``r = exp(logp - logp_old)``, plus
``kl_coef * KL(policy || reference)`` (the non-negative ``k3`` estimator
``exp(ref - logp) - (ref - logp) - 1``), averaged over all response tokens of the step's global
batch (``data.loss_average=token``) or per response and then over responses (``sequence``, the
GRPO paper's form): ``average_weights``.

The trainer runs RL with the loss it runs everywhere, ``sum(w * CE) / units`` over the step's
global batch: ``surrogate_layout`` gives a copy of the layout with weights ``w = -units *
dLoss/dlogp``, whose gradient is exactly the GRPO gradient.
"""

from __future__ import annotations

import copy

import torch

from orthros_train.data.sft import average_per_sequence
from orthros_train.options import LossAverage
from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.global_loss import loss_units


def average_weights(layout: OrthrosLayout, loss_average: LossAverage | str, units: int | None = None) -> torch.Tensor:
    """Per-token factor ``[N]`` that turns a sum over tokens into the chosen average.

    token: ``1 / units`` (every response token counts the same); sequence: ``1 / (len(row) *
    units)`` (every response counts the same). ``units`` are the response tokens, or responses,
    of the whole batch the average runs over (default: this layout's own; the trainer passes the
    step's global count, ``orthros_train.train.global_loss``).
    """
    loss_average = LossAverage.parse(loss_average, "loss_average")
    units = loss_units(layout, loss_average) if units is None else units
    ones = copy.copy(layout)
    ones.loss_weights = torch.ones_like(layout.loss_weights, dtype=torch.float64)
    per_token = average_per_sequence(ones).loss_weights if loss_average == LossAverage.sequence else ones.loss_weights
    return per_token / max(units, 1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_t weights_t * (-min(r_t A_t, clip(r_t) A_t) + kl_coef * k3_t)`` and diagnostics
    (sums over the tokens: ``ratio_sum``, ``clipped``, ``neg_logp_sum``, ``kl_sum``).

    All tensors are per response token ``[N]``; ``weights`` come from ``average_weights``.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
    loss = (per_token * weights).sum()
    with torch.no_grad():
        stats = {
            "ratio_sum": float(ratio.sum()),
            "clipped": float((clipped != unclipped).float().sum()),
            "neg_logp_sum": float(-logp.sum()),  # entropy proxy: negative log-prob of the sampled tokens
        }
        if kl is not None:
            stats["kl_sum"] = float(kl.sum())
    return loss, stats


def surrogate_layout(
    layout: OrthrosLayout,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    units: int | None = None,
    **objective: float,
) -> tuple[OrthrosLayout, float, dict[str, float]]:
    """A copy of ``layout`` whose weighted cross entropy has exactly the GRPO gradient at ``logp``,
    with the GRPO loss there and its diagnostics.

    ``logp`` is the policy's current log-prob (no grad). With ``c = dLoss/dlogp`` the layout
    loss ``sum(w * CE) / units = -sum(w * logp) / units`` has gradient ``sum(c * dlogp)`` when
    ``w = -c * units`` (``units`` defaults to the layout's labelled tokens, the model's default
    ``loss_normalizer``).
    """
    units = layout.num_loss_tokens if units is None else units
    leaf = logp.detach().double().clone().requires_grad_(True)
    loss, stats = grpo_loss(leaf, old_logp.detach().double(), advantages.double(), weights.double(),
                            None if ref_logp is None else ref_logp.detach().double(), **objective)
    (coeff,) = torch.autograd.grad(loss, leaf)
    out = copy.copy(layout)
    out.loss_weights = (-coeff * units).to(layout.loss_weights.dtype)
    return out, float(loss.detach()), stats
