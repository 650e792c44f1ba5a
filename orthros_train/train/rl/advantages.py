"""Advantages of rollouts: given, or from rewards normalised within each group (GRPO).

A group is the rollouts that share a prompt. A sequence reward gives every response token
``(r - mean) / std`` of its group (``scale=False``: ``r - mean``, as in Dr. GRPO); per-token
rewards are normalised over all tokens of the group and summed from each token to the end of
the response (GRPO's process supervision).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.train.rl.rollout import Rollout


def _group_keys(rollouts: Sequence[Rollout]) -> list[Any]:
    """Group of each rollout; rollouts without a group form one group together."""
    return [("group", r.group) if r.group is not None else ("batch",) for r in rollouts]


def compute_advantages(rollouts: Sequence[Rollout], scale: bool = True, eps: float = 1e-6) -> list[torch.Tensor]:
    """Per-response-token advantages ``[len(response)]`` of every rollout.

    ``advantages`` are used as given. Otherwise, within each group: sequence rewards give
    ``(r - mean_group) / (std_group + eps)`` to every token (``scale=False``: ``r - mean``, as
    in Dr. GRPO); per-token rewards are normalised by the mean/std of all token rewards of the
    group and each token gets the sum of the normalised rewards from itself to the end.
    A group must use one kind of reward.
    """
    out: list[torch.Tensor | None] = [None] * len(rollouts)
    groups: dict[Any, list[int]] = {}
    for i, (r, key) in enumerate(zip(rollouts, _group_keys(rollouts))):
        if r.advantages is not None:
            out[i] = torch.as_tensor(r.advantages, dtype=torch.float32).expand(len(r.response_ids)).clone()
        else:
            groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        kinds = {"token" if rollouts[i].token_rewards is not None else "sequence" for i in members}
        if len(kinds) > 1:
            raise UserError(f"group {key[-1]!r} mixes sequence and per-token rewards")
        if kinds == {"sequence"}:
            rewards = torch.tensor([float(rollouts[i].reward) for i in members], dtype=torch.float64)
            centered = rewards - rewards.mean()
            if scale:
                centered = centered / (rewards.std(unbiased=False) + eps)
            for i, a in zip(members, centered.tolist()):
                out[i] = torch.full((len(rollouts[i].response_ids),), a, dtype=torch.float32)
        else:
            flat = torch.cat([torch.as_tensor(rollouts[i].token_rewards, dtype=torch.float64) for i in members])
            mean, std = flat.mean(), flat.std(unbiased=False)
            for i in members:
                norm = torch.as_tensor(rollouts[i].token_rewards, dtype=torch.float64) - mean
                if scale:
                    norm = norm / (std + eps)
                out[i] = torch.flip(torch.cumsum(torch.flip(norm, [0]), 0), [0]).float()  # reward-to-go
    return out  # type: ignore[return-value]
