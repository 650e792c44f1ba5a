"""Sequence-length schedule: the training sequence grows in stages at constant tokens per step.

``trainer.seq_len_schedule: [[start_step, seq_len], ...]`` (first stage at step 0, steps and
lengths increasing). ``trainer.seq_len x trainer.micro_batch_size`` are the tokens of one micro
batch; a stage of length ``s`` reads ``seq_len * micro_batch_size / s`` sequences per micro batch,
so tokens per micro batch, per optimizer step (``grad_accum_steps`` is unchanged) and the
activation memory of the token-wise layers stay the same in every stage.

Each stage reads its own data object from ``build_data`` at its length. The switch is a pure
function of the optimizer step (micro batches served // grad_accum_steps), and the state saved
with a checkpoint holds that count and every started stage's sampler position: a resumed run lands
in the same stage at the same sample. A new stage starts its sample stream at the tokens already
consumed (converted to samples of the new length), so it continues through the data instead of
re-reading it from the start; the samples of different lengths are shuffled differently, so
documents near the boundary may be repeated or skipped once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from orthros_train.errors import UserError


def check_seq_len_schedule(
    schedule: Sequence[Sequence[int]], seq_len: int, micro_batch_size: int, max_steps: int | None = None
) -> list[tuple[int, int]]:
    """Validated ``[(start_step, seq_len), ...]``; errors name ``trainer.seq_len_schedule``."""
    stages: list[tuple[int, int]] = []
    for entry in schedule:
        if len(entry) != 2:
            raise UserError(f"trainer.seq_len_schedule entries are [start_step, seq_len], got {list(entry)!r}")
        stages.append((int(entry[0]), int(entry[1])))
    if not stages or stages[0][0] != 0:
        raise UserError("trainer.seq_len_schedule must start with a stage at step 0, e.g. [[0, 32768], ...]")
    for (s0, l0), (s1, l1) in zip(stages, stages[1:]):
        if s1 <= s0:
            raise UserError(f"trainer.seq_len_schedule start steps must increase, got {s0} then {s1}")
        if l1 <= l0:
            raise UserError(f"trainer.seq_len_schedule lengths must increase, got {l0} then {l1}")
    if max_steps is not None and stages[-1][0] >= max_steps:
        raise UserError(
            f"trainer.seq_len_schedule stage at step {stages[-1][0]} never runs (trainer.max_steps={max_steps})"
        )
    tokens = seq_len * micro_batch_size
    for _, length in stages:
        if length < 1 or tokens % length:
            raise UserError(
                f"trainer.seq_len_schedule length {length} does not divide the tokens of a micro batch "
                f"(trainer.seq_len x trainer.micro_batch_size = {tokens}); pick lengths that divide it"
            )
    return stages


class SeqLenScheduledData:
    """The ``build_data`` interface over one data object per stage (see the module docstring)."""

    def __init__(
        self,
        build: Callable[[int, int], Any],
        stages: list[tuple[int, int]],
        seq_len: int,
        micro_batch_size: int,
        grad_accum_steps: int,
    ) -> None:
        self._build = build  # (stage seq_len, stage micro batch) -> a build_data object
        self.stages = stages
        self.tokens_per_micro_batch = seq_len * micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.micro_batches = 0  # served since step 0 (all ranks serve the same count)
        self._data: dict[int, Any] = {}
        self._saved: dict[int, dict] = {}  # states of stages not built yet in this process
        self._consumed_tokens: dict[int, int] = {}  # per stage, global over data-parallel ranks
        self.current = self._stage_data(0)

    # -- which stage -------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.micro_batches // self.grad_accum_steps

    def stage_index(self, step: int) -> int:
        return max(i for i, (start, _) in enumerate(self.stages) if start <= step)

    @property
    def seq_len(self) -> int:
        return self.stages[self.stage_index(self.step)][1]

    def _stage_data(self, index: int) -> Any:
        if index not in self._data:
            length = self.stages[index][1]
            data = self._build(length, self.tokens_per_micro_batch // length)
            if index in self._saved:
                data.load_state_dict(self._saved.pop(index))
            elif index > 0:
                # Continue through the data: skip the samples the earlier stages' tokens covered.
                skip = sum(self._consumed_tokens.values()) // length
                data.load_state_dict({**data.state_dict(), "consumed_samples": skip})
            self._data[index] = data
        return self._data[index]

    # -- the build_data interface -------------------------------------------------------------
    def next_batch(self):
        index = self.stage_index(self.step)
        self.current = self._stage_data(index)
        before = self.current.consumed_samples
        layout = self.current.next_batch()
        self._consumed_tokens[index] = (
            self._consumed_tokens.get(index, 0) + (self.current.consumed_samples - before) * self.stages[index][1]
        )
        self.micro_batches += 1
        return layout

    def valid_batches(self, n: int):
        return self._stage_data(self.stage_index(self.step)).valid_batches(n)

    @property
    def consumed_samples(self) -> int:
        """Samples of the current stage's length read so far in that stage."""
        return self.current.consumed_samples

    @property
    def consumed_tokens(self) -> int:
        return sum(self._consumed_tokens.values())

    def __getattr__(self, name: str) -> Any:
        # tokenizer, vocab_size, eod_token_id, ...: the same for every stage
        if name.startswith("_") or name in ("current", "stages"):
            raise AttributeError(name)
        return getattr(self.current, name)

    def state_dict(self) -> dict:
        stages = {**self._saved, **{i: d.state_dict() for i, d in self._data.items()}}
        return {
            "micro_batches": self.micro_batches,
            "seq_len_schedule": [list(s) for s in self.stages],
            "consumed_tokens": dict(self._consumed_tokens),
            "stages": stages,
        }

    def load_state_dict(self, state: dict) -> None:
        if "stages" not in state:
            raise UserError(
                "the checkpoint's data state has no seq_len_schedule stages: it was written without "
                "trainer.seq_len_schedule; resume with the schedule it was written with"
            )
        saved = [tuple(s) for s in state.get("seq_len_schedule", [])]
        if saved and saved != [tuple(s) for s in self.stages]:
            raise UserError(
                f"the checkpoint was written with trainer.seq_len_schedule={[list(s) for s in saved]}, "
                f"this run has {[list(s) for s in self.stages]}; resume with the same schedule"
            )
        self.micro_batches = int(state["micro_batches"])
        self._consumed_tokens = {int(k): int(v) for k, v in state.get("consumed_tokens", {}).items()}
        self._data.clear()
        self._saved = {int(k): dict(v) for k, v in state["stages"].items()}
        self.current = self._stage_data(self.stage_index(self.step))


def build_scheduled_data(
    data_cfg: Any,
    seq_len: int,
    micro_batch_size: int,
    schedule: Sequence[Sequence[int]] | None,
    grad_accum_steps: int,
    seed: int,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> Any:
    """``build_data(...)`` itself without a schedule, else a :class:`SeqLenScheduledData`."""
    from orthros_train.data import build_data  # here: orthros_train.data imports its modules lazily too

    if not schedule:
        return build_data(data_cfg, seq_len, micro_batch_size, seed, dp_rank=dp_rank, dp_size=dp_size)
    stages = check_seq_len_schedule(schedule, seq_len, micro_batch_size)

    def build(length: int, micro: int) -> Any:
        return build_data(data_cfg, length, micro, seed, dp_rank=dp_rank, dp_size=dp_size)

    return SeqLenScheduledData(build, stages, seq_len, micro_batch_size, grad_accum_steps)
