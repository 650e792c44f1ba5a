"""Reward functions for rollouts we sample ourselves: ``reward_fn(prompt_ids, response_ids,
reference_ids or None) -> one reward or one per response token`` (``rollout.RewardFn``)."""

from __future__ import annotations

import importlib

from orthros_train.errors import UserError
from orthros_train.train.rl.rollout import RewardFn


def reference_match_reward(
    prompt_ids: list[int], response_ids: list[int], reference_ids: list[int] | None
) -> list[float]:
    """Per-token reward: 1 where response token ``i`` equals reference token ``i`` (a simple
    verifiable reward for prompt sets with reference answers, e.g. ``orthros-data rl --reference-field``).
    Tokens past the reference earn 0, so stopping on time pays."""
    if reference_ids is None:
        raise UserError("reference_match_reward needs prompts with a reference answer")
    return [1.0 if i < len(reference_ids) and t == reference_ids[i] else 0.0 for i, t in enumerate(response_ids)]


def load_reward(spec: str) -> RewardFn:
    """``module:function`` -> the function."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"task.reward must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise UserError(f"task.reward {spec!r}: {module} has no function {attr!r}")
    return fn
