"""Where an RL run's rollouts come from, served to the trainer like any other data.

A ``RolloutSource`` yields the rollouts of one optimizer step for this data-parallel rank,
advantages computed:

* ``GeneratedRollouts``: prompts (the toy ``PatternTask``, or an ``orthros-data rl`` prompt set)
  sampled in-process with the current weights and scored by a reward function;
* ``FileRollouts``: an external engine's rollouts, the JSONL format of ``Rollout``, in file order.

``RolloutData`` wraps a source in the interface the trainer reads every phase through
(``next_batch``, ``valid_batches``, ``consumed_samples``, ``state_dict``, ``tokenizer``): it
splits the rank's rollouts of a step into ``grad_accum_steps`` micro-batches of
``micro_batch_size`` rollouts (``RolloutBatch``). Its state (steps drawn, the prompt sampler's
position) goes into checkpoints with the data state of every other phase, so a resumed run
draws the same prompts and samples the same responses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.config import RLConfig, RunConfig, TaskConfig
from orthros_train.train.rl import (
    PatternTask,
    Rollout,
    RolloutBatch,
    RolloutGenerator,
    compute_advantages,
    load_rollouts,
)

# The current policy to sample with, for the length of a ``with`` block (entering is collective):
# the trainer's own sharded model, never a second copy of it.
PolicyFn = Callable[[], AbstractContextManager[torch.nn.Module]]


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
        prompts: Callable[[list[int]], tuple[list[list[int]], list[Any] | None]],
        generator: RolloutGenerator,
        policy: PolicyFn,
        cfg: RLConfig,
        dp_rank: int,
        dp_size: int,
        state: Callable[[], dict] | None = None,
        load_state: Callable[[dict], None] | None = None,
    ) -> None:
        if cfg.prompts_per_step % dp_size:
            raise ValueError(
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
        with self.policy() as policy:  # every rank of the TP group decodes the same rows on its shards
            rollouts = self.generator(policy, prompts, slots, references)
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
                raise ValueError(
                    f"{path}: group {group!r} mixes reward (rollout {seen['reward']}) and token_rewards (rollout "
                    f"{seen['token_rewards']}); a group's baseline needs one kind of reward"
                )
        self.rows = cfg.prompts_per_step * cfg.group_size
        self.cfg = cfg
        self.dp_rank, self.dp_size = dp_rank, dp_size
        steps = len(self.rollouts) // self.rows
        if steps < draws:
            updates = steps // cfg.minibatches * cfg.minibatches * cfg.ppo_epochs
            raise ValueError(
                f"{path} holds {len(self.rollouts)} rollouts: {steps} steps of rl.prompts_per_step x rl.group_size = "
                f"{self.rows}, fewer than the run needs ({draws}); set trainer.max_steps={updates}"
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


class RolloutData:
    """The trainer's data for an RL run (see the module docstring).

    With ``rl.minibatches x rl.ppo_epochs > 1`` a rollout batch serves several optimizer steps:
    ``minibatches`` draws of one step's rollouts each, passed over ``ppo_epochs`` times in order.
    The sampling policy's log-probs (``logprobs``: the current policy's, before the batch's first
    update) become the old log-probs of the ratio, and the batch goes into the data state until
    its last update, so a run resumed in the middle of one continues it exactly.
    """

    def __init__(
        self,
        source: RolloutSource,
        cfg: RLConfig,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_size: int,
        tokenizer: Any,
        eod_token_id: int | None,
        logprobs: Callable[[OrthrosLayout], torch.Tensor] | None = None,
        dp_rank: int = 0,
    ) -> None:
        rows = cfg.prompts_per_step * cfg.group_size
        if rows != micro_batch_size * grad_accum_steps * dp_size:
            raise ValueError(
                f"rl.prompts_per_step x rl.group_size = {rows} rollouts per step, but trainer.micro_batch_size x "
                f"trainer.grad_accum_steps x parallel.data_parallel = {micro_batch_size} x {grad_accum_steps} x "
                f"{dp_size}; set trainer.micro_batch_size={rows // (grad_accum_steps * dp_size)}"
                if rows % (grad_accum_steps * dp_size) == 0
                else f"rl.prompts_per_step x rl.group_size = {rows} rollouts per step do not split into "
                f"trainer.grad_accum_steps={grad_accum_steps} micro-batches on {dp_size} data-parallel ranks"
            )
        self.updates_per_batch = cfg.minibatches * cfg.ppo_epochs
        if self.updates_per_batch > 1 and logprobs is None:
            raise ValueError("several updates per rollout batch need the policy's log-probs (logprobs=...)")
        self.source = source
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.rows_per_step = rows
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eod_token_id = eod_token_id
        self.logprobs = logprobs
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.steps = 0  # optimizer steps served
        self._batch: list[list[RolloutBatch]] | None = None  # per minibatch, this rank's micro-batches
        self._pending: list[RolloutBatch] = []

    def _draw(self, index: int) -> list[list[RolloutBatch]]:
        """Rollout batch ``index``: ``minibatches`` step-sized draws from the source."""
        m, out = self.micro_batch_size, []
        for k in range(self.cfg.minibatches):
            rollouts, advantages = self.source.step_rollouts(index * self.cfg.minibatches + k)
            recompute = self.cfg.recompute_old_logprobs
            out.append([RolloutBatch.of(rollouts[i : i + m], advantages[i : i + m], recompute)
                        for i in range(0, len(rollouts), m)])
        if self.updates_per_batch > 1:  # later updates are off-policy: keep the sampling policy's log-probs
            for minibatch in out:
                for b in minibatch:
                    if b.old_logp is None:
                        b.old_logp = self.logprobs(b.layout).float().cpu()
        return out

    def next_batch(self) -> RolloutBatch:
        if not self._pending:
            index, update = divmod(self.steps, self.updates_per_batch)
            if update == 0:
                self._batch = self._draw(index)
            elif self._batch is None:
                raise RuntimeError(f"step {self.steps} is inside rollout batch {index}, whose rollouts are gone")
            self._pending = list(self._batch[update % self.cfg.minibatches])
            self.steps += 1
            if self.steps % self.updates_per_batch == 0:
                self._batch = None  # its last update: the next step draws anew
        return self._pending.pop(0)

    def valid_batches(self, n: int) -> list:
        return []  # an RL run is judged by its rewards (logged every step)

    @property
    def consumed_samples(self) -> int:
        """Rollouts drawn so far, over all ranks."""
        draws = -(-self.steps // self.updates_per_batch) * self.cfg.minibatches
        return draws * self.rows_per_step

    def state_dict(self) -> dict[str, Any]:
        if self._pending:
            raise RuntimeError("RL data state asked for in the middle of a step")
        state = {"steps": self.steps, "source": self.source.state_dict()}
        if self._batch is not None:  # in the middle of a rollout batch: its rollouts travel along
            state.update(batch=self._batch, dp=[self.dp_rank, self.dp_size])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.source.load_state_dict(dict(state.get("source") or {}))
        self._pending = []
        self._batch = state.get("batch")
        if self._batch is not None and list(state["dp"]) != [self.dp_rank, self.dp_size]:
            raise ValueError(
                f"this checkpoint is in the middle of a rollout batch sampled on data-parallel rank {state['dp']}; "
                f"resume it with parallel.data_parallel={state['dp'][1]} (or from a checkpoint at a multiple of "
                f"rl.minibatches x rl.ppo_epochs = {self.updates_per_batch} steps)"
            )


def load_reward(spec: str):
    """``module:function`` -> the function."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task.reward must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"task.reward {spec!r}: {module} has no function {attr!r}")
    return fn


def numbered_tokenizer(vocab_size: int):
    """A tokenizer whose token ``i`` is the word ``str(i)``: for token-id tasks (the toy task,
    rollouts of a model without a tokenizer), so checkpoints and samples stay readable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def build_rollout_data(
    cfg: RunConfig,
    policy: PolicyFn,
    dp_rank: int,
    dp_size: int,
    logprobs: Callable[[OrthrosLayout], torch.Tensor] | None = None,
) -> RolloutData:
    """The RL recipe's ``task`` as trainer data; ``policy`` lends the current policy to sample
    with, ``logprobs`` gives its log-probs of a layout's labels (both collective)."""
    rl, task, t = cfg.rl, cfg.task, cfg.trainer
    assert rl is not None and task is not None
    tokenizer = _tokenizer(cfg)
    eos = getattr(tokenizer, "eos_token_id", None)
    if task.name == "pattern":
        rl.max_new_tokens = task.response_len
        pattern = PatternTask(cfg.model.vocab_size, task.low, task.prompt_len, task.response_len,
                              task.token_rewards, seed=t.seed)
        source: RolloutSource = GeneratedRollouts(
            lambda slots: (pattern.prompts(slots), None), RolloutGenerator(pattern.reward, rl), policy, rl,
            dp_rank, dp_size,
        )
    elif task.name == "prompts":
        source = _prompt_set_source(cfg, task, policy, dp_rank, dp_size, eos)
    else:
        draws = -(-t.max_steps // (rl.minibatches * rl.ppo_epochs)) * rl.minibatches
        source = FileRollouts(task.rollouts, rl, draws, dp_rank, dp_size, cfg.model.vocab_size)
    return RolloutData(source, rl, t.micro_batch_size, t.grad_accum_steps, dp_size, tokenizer, eos, logprobs, dp_rank)


def _tokenizer(cfg: RunConfig):
    from orthros_train.infer.loading import load_tokenizer

    for path in (cfg.init.init_from, cfg.data.tokenizer):
        if path:
            tokenizer = load_tokenizer(path, required=False)
            if tokenizer is not None:
                return tokenizer
    return numbered_tokenizer(cfg.model.vocab_size)


def _prompt_set_source(cfg: RunConfig, task: TaskConfig, policy: PolicyFn, dp_rank: int, dp_size: int, eos):
    from orthros_train.data.indexed import resolve_prefixes
    from orthros_train.data.rl import PromptSet

    rl = cfg.rl
    if cfg.data.source != "indexed":
        raise ValueError("task.name=prompts reads an `orthros-data rl` set: data.source=indexed, data.paths")
    prefixes = [p for path in cfg.data.paths for p in resolve_prefixes(path)]
    if rl.prompts_per_step % dp_size:
        raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of parallel.data_parallel")
    prompt_set = PromptSet(prefixes, rl.prompts_per_step // dp_size, cfg.trainer.seed, dp_rank, dp_size)
    stops = task.stop_token_ids if task.stop_token_ids is not None else ([eos] if eos is not None else [])

    def prompts(slots: list[int]):
        if prompt_set.sampler.positions() != slots:  # the sampler's state and the step count disagree
            raise RuntimeError(f"RL prompt sampler at positions {prompt_set.sampler.positions()}, expected {slots}")
        batch = prompt_set.next_prompts()
        return [p.input_ids.tolist() for p in batch], [p.reference_ids for p in batch]

    return GeneratedRollouts(
        prompts, RolloutGenerator(load_reward(task.reward), rl, stops), policy, rl, dp_rank, dp_size,
        state=prompt_set.state_dict, load_state=prompt_set.load_state_dict,
    )


__all__ = [
    "FileRollouts",
    "GeneratedRollouts",
    "RolloutData",
    "RolloutSource",
    "build_rollout_data",
    "load_reward",
    "numbered_tokenizer",
]
