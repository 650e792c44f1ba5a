"""Where an RL run's rollouts come from: one optimizer step's rollouts for this data-parallel rank,
advantages computed.

* ``GeneratedRollouts``: prompts (the toy ``PatternTask``, or an ``orthros-data rl`` prompt set)
  sampled in-process with the current policy and scored by a reward function;
* ``FileRollouts``: an external engine's rollouts, the JSONL format of ``Rollout``, in file order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.train.config import RLConfig
from orthros_train.train.rl.advantages import compute_advantages
from orthros_train.train.rl.generation import RolloutGenerator
from orthros_train.train.rl.policy import Policy
from orthros_train.train.rl.rollout import Rollout, load_rollouts

log = logging.getLogger(__name__)

# slots -> (prompt token ids, reference answer ids or None per prompt)
PromptFn = Callable[[list[int]], tuple[list[list[int]], "list[Any] | None"]]


class RolloutSource(Protocol):
    def step_rollouts(self, step: int) -> tuple[list[Rollout], list[torch.Tensor]]:
        """This rank's rollouts of optimizer step ``step`` and their per-token advantages."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class GeneratedRollouts:
    """Prompts sampled with the current policy: each step's ``prompts_per_step`` prompts (global
    slots ``step * prompts_per_step + i``) are dealt round-robin over the DP ranks, as
    ``ResumableSampler`` deals samples, a whole group per prompt, so the group baselines are
    computed where the group was sampled."""

    def __init__(
        self,
        prompts: PromptFn,
        generator: RolloutGenerator,
        policy: Policy,
        cfg: RLConfig,
        dp_rank: int,
        dp_size: int,
        state: Callable[[], dict] | None = None,
        load_state: Callable[[dict], None] | None = None,
    ) -> None:
        if cfg.prompts_per_step % dp_size:
            raise UserError(
                f"rl.prompts_per_step={cfg.prompts_per_step} does not split over {dp_size} data-parallel ranks: "
                "pick a multiple of parallel.data_parallel (each rank samples whole groups)"
            )
        self.prompts = prompts
        self.generator = generator
        self.policy = policy
        self.cfg = cfg
        self.per_rank = cfg.prompts_per_step // dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._state = state
        self._load_state = load_state

    def step_rollouts(self, step: int) -> tuple[list[Rollout], list[torch.Tensor]]:
        first = step * self.cfg.prompts_per_step + self.dp_rank
        slots = [first + j * self.dp_size for j in range(self.per_rank)]
        prompts, references = self.prompts(slots)
        with self.policy.sampling() as model:  # every rank of the TP group decodes the same rows on its shards
            rollouts = self.generator(model, prompts, slots, references)
        return rollouts, compute_advantages(rollouts, scale=self.cfg.scale_advantages)

    def state_dict(self) -> dict[str, Any]:
        return self._state() if self._state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._load_state is not None:
            self._load_state(state)


class FileRollouts:
    """An external engine's rollouts (JSONL), ``rows_per_step`` per step in file order. Advantages
    are computed over a step's whole batch (its groups may span ranks), then each rank takes its
    share."""

    def __init__(
        self, path: str, cfg: RLConfig, draws: int, dp_rank: int, dp_size: int, vocab_size: int | None = None
    ) -> None:
        self.rollouts = load_rollouts(path, vocab_size)  # checked at read time, not mid-run in the embedding
        kinds: dict[Any, dict[str, int]] = {}  # group -> reward kind -> first record (1-based)
        for i, r in enumerate(self.rollouts, 1):
            if r.advantages is None and r.group is not None:
                kind = "token_rewards" if r.token_rewards is not None else "reward"
                kinds.setdefault(r.group, {}).setdefault(kind, i)
        for group, seen in kinds.items():
            if len(seen) > 1:  # compute_advantages would stop on it at that group's step, naming no file
                raise UserError(
                    f"{path}: group {group!r} mixes reward (rollout {seen['reward']}) and token_rewards (rollout "
                    f"{seen['token_rewards']}); a group's baseline needs one kind of reward"
                )
        self.rows = cfg.prompts_per_step * cfg.group_size
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        steps = len(self.rollouts) // self.rows
        self._check_group_sizes(path, min(steps, draws))
        if steps < draws:
            updates = steps // cfg.minibatches * cfg.minibatches * cfg.ppo_epochs
            raise UserError(
                f"{path} holds {len(self.rollouts)} rollouts: {steps} steps of rl.prompts_per_step x rl.group_size = "
                f"{self.rows}, fewer than the run needs ({draws}); set trainer.max_steps={updates}"
            )

    def _check_group_sizes(self, path: str, steps: int) -> None:
        """A step's groups (the baseline of their rewards) are meant to hold rl.group_size rollouts:
        a group of one has no baseline, and a group cut by the step boundary or sharing another's id
        compares answers to different prompts. External engines may group otherwise on purpose, so
        this is said (naming the groups), not refused."""
        wrong: list[str] = []
        for step in range(steps):
            first = step * self.rows
            sizes: dict[Any, list[int]] = {}  # group -> the 1-based records in this step
            for i, r in enumerate(self.rollouts[first : first + self.rows], first + 1):
                if r.advantages is None and r.group is not None:
                    sizes.setdefault(r.group, []).append(i)
            wrong += [f"step {step + 1}: group {g!r} has {len(records)} (rollouts {records[0]}..{records[-1]})"
                      for g, records in sizes.items() if len(records) != self.cfg.group_size]
        if wrong:
            log.warning(
                "WARNING: %s: %d group(s) whose size is not rl.group_size=%d: %s%s. Each group's rewards are "
                "compared with its own mean; if the file groups rl.group_size responses per prompt, fix it",
                path, len(wrong), self.cfg.group_size, "; ".join(wrong[:3]), " ..." if len(wrong) > 3 else "",
                extra=RANK_ZERO,
            )

    def step_rollouts(self, step: int) -> tuple[list[Rollout], list[torch.Tensor]]:
        batch = self.rollouts[step * self.rows : (step + 1) * self.rows]
        advantages = compute_advantages(batch, scale=self.cfg.scale_advantages)
        share = self.rows // self.dp_size
        mine = slice(self.dp_rank * share, (self.dp_rank + 1) * share)
        return batch[mine], advantages[mine]

    def state_dict(self) -> dict[str, Any]:
        return {}  # the position is the step count RolloutData keeps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


__all__ = ["FileRollouts", "GeneratedRollouts", "RolloutSource"]
