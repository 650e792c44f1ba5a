"""Rollouts from our own generation: prompts sampled with the current policy (prefill + decode)
and scored by a reward function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from orthros_train.errors import UserError
from orthros_train.train.config import RLConfig
from orthros_train.train.rl.rollout import RewardFn, Rollout


class RolloutGenerator:
    """Samples ``group_size`` responses per prompt with the policy (prefill + decode) and scores them.

    Each prompt is sampled on its own with a seed of its own (``rl.seed`` and the prompt's global
    slot), so a rollout does not depend on which rank or batch its prompt landed in: a run on
    any number of data-parallel ranks samples the same rollouts.
    """

    def __init__(self, reward_fn: RewardFn, cfg: RLConfig, stop_token_ids: Sequence[int] = ()) -> None:
        self.reward_fn = reward_fn
        self.cfg = cfg
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)

    @torch.no_grad()
    def __call__(
        self,
        policy: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        references: Sequence[Sequence[int] | None] | None = None,
    ) -> list[Rollout]:
        """``group_size`` scored rollouts per prompt; prompt ``i`` is group ``slots[i]``."""
        from orthros_train.infer import SamplingParams, generate

        cfg = self.cfg
        refs = list(references) if references is not None else [None] * len(prompts)
        rollouts = []
        for prompt, slot, ref in zip(prompts, slots, refs):
            params = SamplingParams(
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                stop_token_ids=self.stop_token_ids,
                seed=int(np.random.SeedSequence([cfg.seed, int(slot)]).generate_state(1)[0]),
            )
            result = generate(policy, [list(prompt)] * cfg.group_size, params)
            for response in result.sequences:
                if not response:  # max_new_tokens >= 1 and prompts are non-empty: cannot happen
                    continue
                reward = self.reward_fn(list(prompt), list(response), None if ref is None else [int(t) for t in ref])
                kw: dict[str, Any] = {}
                if isinstance(reward, (int, float)):
                    kw["reward"] = float(reward)
                else:
                    kw["token_rewards"] = [float(x) for x in reward]
                try:
                    rollouts.append(Rollout(list(prompt), list(response), group=int(slot), **kw))
                except UserError as e:  # e.g. a NaN reward: name the function, not a non-finite loss later
                    raise UserError(f"the reward function {getattr(self.reward_fn, '__name__', self.reward_fn)!r} "
                                     f"returned {reward!r}: {e}") from e
        return rollouts
