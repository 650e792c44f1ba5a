"""GRPO as a trainer objective: a step's rollout batches -> layouts whose loss has the GRPO gradient."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from orthros_train.options import LossAverage
from orthros_train.parallel import collectives
from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.config import RLConfig
from orthros_train.train.objective import PreparedStep
from orthros_train.train.rl.batch import OLD_LOGPROBS, REF_LOGPROBS, REWARD
from orthros_train.train.rl.grpo import average_weights, surrogate_layout
from orthros_train.train.rl.policy import Policy


class GRPOObjective:
    """The trainer's objective for RL runs (``Objective``).

    ``policy`` / ``reference`` give the response tokens' log-probs under the current policy and
    the frozen reference (no grad; sharded models, collective calls). The policy's are needed
    only off-policy (rollouts with old log-probs) or with a KL term: an on-policy update without
    KL has ratio 1, and its GRPO gradient is that of the rl layout with weights = advantages
    (times ``1 / len(row)`` in sequence mode).
    """

    watch_loss_spikes = False  # a GRPO loss hovers around 0, of either sign

    def __init__(
        self,
        cfg: RLConfig,
        loss_average: LossAverage | str,
        policy: Policy,
        reference: Policy | None = None,
        group: Any = None,
    ) -> None:
        if cfg.kl_coef > 0 and reference is None:
            raise ValueError("rl.kl_coef > 0 needs the frozen reference model")
        self.cfg = cfg
        self.loss_average = LossAverage(loss_average)
        self.policy = policy
        self.reference = reference
        self.group = group  # data-parallel group the diagnostics are summed over

    def prepare(self, batches: Sequence[OrthrosLayout], units: int) -> PreparedStep:
        """Layouts to train on, each micro-batch's share of the step's GRPO loss, and the step's
        diagnostics (global means over the data-parallel group)."""
        cfg = self.cfg
        objective = dict(clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef)
        layouts, values = [], []
        sums = {"ratio_sum": 0.0, "clipped": 0.0, "neg_logp_sum": 0.0, "kl_sum": 0.0}
        for b in batches:
            advantages = b.loss_weights  # a rollout batch's weights are its advantages
            old_logp = b.output_values.get(OLD_LOGPROBS)
            weights = average_weights(b, self.loss_average, units).to(advantages.device)
            if old_logp is None and cfg.kl_coef == 0:
                out = copy.copy(b)  # ratio 1: dLoss/dlogp = -A * weights
                out.loss_weights = (advantages.double() * weights * max(units, 1)).to(b.loss_weights.dtype)
                value = float(-(advantages.double() * weights).sum())
                stats = {"ratio_sum": float(b.num_outputs), "clipped": 0.0, "neg_logp_sum": math.nan}
            else:
                logp = self.policy.logprobs(b)
                old = old_logp if old_logp is not None else logp
                ref = b.output_values.get(REF_LOGPROBS)
                if cfg.kl_coef > 0 and ref is None:
                    ref = self.reference.logprobs(b)
                out, value, stats = surrogate_layout(b, logp, old, advantages, weights, ref, units=max(units, 1),
                                                     **objective)
            for k, v in stats.items():
                sums[k] += v
            layouts.append(out)
            values.append(value)
        return PreparedStep(layouts, values, self._diagnostics(batches, sums))

    def _diagnostics(self, batches: Sequence[OrthrosLayout], sums: dict[str, float]) -> dict[str, float]:
        rewards = [r for b in batches for r in b.row_values.get(REWARD, [math.nan] * b.num_rows)]
        scored = [r for r in rewards if not math.isnan(r)]  # rollouts given as advantages carry no reward
        tokens = sum(b.num_outputs for b in batches)
        totals = torch.tensor(
            [sum(scored), float(len(scored)), float(len(rewards)), float(tokens), sums["ratio_sum"], sums["clipped"],
             sums["neg_logp_sum"], sums["kl_sum"], float(sum(b.loss_weights.abs().sum() for b in batches))],
            dtype=torch.float64,
            device=batches[0].loss_weights.device,
        )
        if self.group is not None:
            collectives.all_reduce(totals, group=self.group)  # on the group's device
        r_sum, n_scored, n_rollouts, n_tokens, ratio, clipped, neg_logp, kl, adv_abs = totals.tolist()
        stats = {
            "response_len_mean": n_tokens / n_rollouts,
            "loss_tokens": n_tokens,
            "ratio_mean": ratio / n_tokens,
            "clip_fraction": clipped / n_tokens,
            "advantage_abs_mean": adv_abs / n_tokens,
        }
        if n_scored:
            stats["reward_mean"] = r_sum / n_scored
        if not math.isnan(neg_logp):
            stats["entropy_proxy"] = neg_logp / n_tokens
        if self.cfg.kl_coef > 0:
            stats["kl"] = kl / n_tokens
        return stats


__all__ = ["GRPOObjective"]
