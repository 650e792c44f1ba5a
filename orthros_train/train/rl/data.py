"""An RL run's rollouts, served to the trainer like any other data.

``RolloutData`` wraps a ``RolloutSource`` in the interface the trainer reads every phase through
(``next_batch``, ``valid_batches``, ``consumed_samples``, ``state_dict``, ``tokenizer``): it
splits the rank's rollouts of a step into ``grad_accum_steps`` micro-batches of
``micro_batch_size`` rollouts, each an rl ``OrthrosLayout`` (``batch.rollout_layout``). Its state
(steps drawn, the prompt sampler's position) goes into checkpoints with the data state of every
other phase, so a resumed run draws the same prompts and samples the same responses.
"""

from __future__ import annotations

from typing import Any

from orthros_train.data import DataConfig
from orthros_train.errors import UserError
from orthros_train.options import RLTask
from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.config import RLConfig, TaskConfig
from orthros_train.train.rl.batch import OLD_LOGPROBS, rollout_layout
from orthros_train.train.rl.generation import RolloutGenerator
from orthros_train.train.rl.pattern_task import PatternTask
from orthros_train.train.rl.policy import Policy
from orthros_train.train.rl.rewards import load_reward
from orthros_train.train.rl.sources import FileRollouts, GeneratedRollouts, RolloutSource


class RolloutData:
    """The trainer's data for an RL run (see the module docstring).

    With ``rl.minibatches x rl.ppo_epochs > 1`` a rollout batch serves several optimizer steps:
    ``minibatches`` draws of one step's rollouts each, passed over ``ppo_epochs`` times in order.
    The sampling policy's log-probs (the current policy's, before the batch's first update)
    become the old log-probs of the ratio, and the batch goes into the data state until its last
    update, so a run resumed in the middle of one continues it exactly.
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
        policy: Policy | None = None,
        dp_rank: int = 0,
    ) -> None:
        rows = cfg.prompts_per_step * cfg.group_size
        if rows != micro_batch_size * grad_accum_steps * dp_size:
            raise UserError(
                f"rl.prompts_per_step x rl.group_size = {rows} rollouts per step, but trainer.micro_batch_size x "
                f"trainer.grad_accum_steps x parallel.data_parallel = {micro_batch_size} x {grad_accum_steps} x "
                f"{dp_size}; set trainer.micro_batch_size={rows // (grad_accum_steps * dp_size)}"
                if rows % (grad_accum_steps * dp_size) == 0
                else f"rl.prompts_per_step x rl.group_size = {rows} rollouts per step do not split into "
                f"trainer.grad_accum_steps={grad_accum_steps} micro-batches on {dp_size} data-parallel ranks"
            )
        self.updates_per_batch = cfg.minibatches * cfg.ppo_epochs
        if self.updates_per_batch > 1 and policy is None:
            raise UserError("several updates per rollout batch need the policy's log-probs (policy=...)")
        self.source = source
        self.cfg = cfg
        self.micro_batch_size = micro_batch_size
        self.rows_per_step = rows
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eod_token_id = eod_token_id
        self.policy = policy
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.steps = 0  # optimizer steps served
        self._batch: list[list[OrthrosLayout]] | None = None  # per minibatch, this rank's micro-batches
        self._pending: list[OrthrosLayout] = []

    def _draw(self, index: int) -> list[list[OrthrosLayout]]:
        """Rollout batch ``index``: ``minibatches`` step-sized draws from the source."""
        m, out = self.micro_batch_size, []
        for k in range(self.cfg.minibatches):
            rollouts, advantages = self.source.step_rollouts(index * self.cfg.minibatches + k)
            recompute = self.cfg.recompute_old_logprobs
            out.append([rollout_layout(rollouts[i : i + m], advantages[i : i + m], recompute)
                        for i in range(0, len(rollouts), m)])
        if self.updates_per_batch > 1:  # later updates are off-policy: keep the sampling policy's log-probs
            for minibatch in out:
                for layout in minibatch:
                    if OLD_LOGPROBS not in layout.output_values:
                        layout.output_values[OLD_LOGPROBS] = self.policy.logprobs(layout).float().cpu()
        return out

    def next_batch(self) -> OrthrosLayout:
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
            raise UserError(
                f"this checkpoint is in the middle of a rollout batch sampled on data-parallel rank {state['dp']}; "
                f"resume it with parallel.data_parallel={state['dp'][1]} (or from a checkpoint at a multiple of "
                f"rl.minibatches x rl.ppo_epochs = {self.updates_per_batch} steps)"
            )


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
    rl: RLConfig,
    task: TaskConfig,
    data: DataConfig,
    *,
    vocab_size: int,
    init_from: str | None,
    seed: int,
    max_steps: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    policy: Policy,
    dp_rank: int,
    dp_size: int,
) -> RolloutData:
    """The RL recipe's ``task`` as trainer data; ``policy`` is the current policy to sample with
    and to read log-probs from (collective calls)."""
    tokenizer = _tokenizer(init_from, data.tokenizer, vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    if task.name == RLTask.pattern:
        pattern = PatternTask(vocab_size, task.low, task.prompt_len, task.response_len, task.token_rewards, seed=seed)
        source: RolloutSource = GeneratedRollouts(
            lambda slots: (pattern.prompts(slots), None), RolloutGenerator(pattern.reward, rl), policy, rl,
            dp_rank, dp_size,
        )
    elif task.name == RLTask.prompts:
        source = _prompt_set_source(rl, task, data, seed, policy, dp_rank, dp_size, eos)
    else:
        draws = -(-max_steps // (rl.minibatches * rl.ppo_epochs)) * rl.minibatches
        source = FileRollouts(task.rollouts, rl, draws, dp_rank, dp_size, vocab_size)
    return RolloutData(source, rl, micro_batch_size, grad_accum_steps, dp_size, tokenizer, eos, policy, dp_rank)


def _tokenizer(init_from: str | None, data_tokenizer: str | None, vocab_size: int):
    from orthros_train.common.tokenizer import load_tokenizer

    for path in (init_from, data_tokenizer):
        if path:
            tokenizer = load_tokenizer(path, required=False, pad_with_eos=True)
            if tokenizer is not None:
                return tokenizer
    return numbered_tokenizer(vocab_size)


def _prompt_set_source(rl: RLConfig, task: TaskConfig, data: DataConfig, seed: int, policy: Policy, dp_rank: int,
                       dp_size: int, eos: int | None) -> GeneratedRollouts:
    from orthros_train.data.indexed import resolve_prefixes
    from orthros_train.data.rl import PromptSet
    from orthros_train.options import DataSource

    if data.source != DataSource.indexed:
        raise UserError("task.name=prompts reads an `orthros-data rl` set: data.source=indexed, data.paths")
    prefixes = [p for path in data.paths for p in resolve_prefixes(path)]
    if rl.prompts_per_step % dp_size:
        raise UserError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of parallel.data_parallel")
    prompt_set = PromptSet(prefixes, rl.prompts_per_step // dp_size, seed, dp_rank, dp_size)
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


__all__ = ["RolloutData", "build_rollout_data", "numbered_tokenizer"]
