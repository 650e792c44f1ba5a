"""The rollout format: one sampled response to one prompt, as a line of a rollouts JSONL file.

Rollouts come from our own generation (``generation.py``) or from an external engine (vLLM,
SGLang, ...) as JSON lines of ``Rollout`` records (``load_rollouts``). Every field is checked by
type when it is read, so a bad file is named with its line before anything trains on it.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orthros_train.errors import UserError

# reward_fn(prompt_ids, response_ids, reference_ids or None) -> one reward or one per response token
RewardFn = Callable[[list[int], list[int], "list[int] | None"], "float | Sequence[float]"]


def _token_ids(name: str, ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray | torch.Tensor):
        raise UserError(f"{name} must be a list of integer token ids, got {ids!r:.80}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool) or isinstance(t, np.bool_):
                raise TypeError
            value = operator.index(t)
        except TypeError:
            raise UserError(f"{name} holds {t!r}, not an integer token id") from None
        if value < 0:
            raise UserError(f"{name} holds {value}: token ids are >= 0")
        out.append(value)
    return out


def _finite_number(name: str, value: Any) -> None:
    # bool is an int to Python, but `true` as a reward is a bug in whatever wrote the file
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be a number, got {value!r:.80}")
    if not math.isfinite(value):
        raise UserError(f"{name} is {value}: rewards and advantages must be finite")


def _finite_numbers(name: str, values: Any) -> None:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise UserError(f"{name} must be a list of numbers, got {values!r:.80}")
    for v in values:
        _finite_number(name, v)


@dataclass
class Rollout:
    """One sampled response to one prompt (a line of a rollouts JSONL file).

    prompt_ids     token ids the policy was conditioned on (chat template already applied)
    response_ids   the sampled tokens (a stop token, when sampled, included: it is trained too)
    reward         one number for the whole response (outcome reward), or
    token_rewards  one number per response token (process reward), or
    advantages     the advantage itself: one number or one per response token (used as is)
    group          rollouts of the same prompt share a group id (GRPO's baseline is the group)
    logprobs       log-prob of each response token under the sampling (old) policy; None: the
                   current policy's, i.e. on-policy (or set ``RLConfig.recompute_old_logprobs``)
    ref_logprobs   log-prob of each response token under the reference policy; None: computed
                   from the reference model when ``kl_coef > 0``
    """

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | None = None
    token_rewards: list[float] | None = None
    advantages: float | list[float] | None = None
    group: int | str | None = None
    logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        # Ids must already be integers: int() would turn 4.5 into 4 and "7" into 7, training on
        # tokens nobody sampled. operator.index takes ints, numpy and 0-d torch integers only.
        self.prompt_ids = _token_ids("prompt_ids", self.prompt_ids)
        self.response_ids = _token_ids("response_ids", self.response_ids)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Types, lengths and values of every field; ``vocab_size``: ids must lie in ``[0, vocab_size)``."""
        if not self.prompt_ids or not self.response_ids:
            raise UserError("a rollout needs a non-empty prompt_ids and response_ids")
        if vocab_size is not None:
            for name in ("prompt_ids", "response_ids"):
                bad = [t for t in getattr(self, name) if t >= vocab_size]
                if bad:
                    raise UserError(
                        f"{name} holds token id {bad[0]}, outside the model's vocabulary of {vocab_size} "
                        "(model.vocab_size): the rollouts were tokenized for another model"
                    )
        n = len(self.response_ids)
        given = [k for k in ("reward", "token_rewards", "advantages") if getattr(self, k) is not None]
        if len(given) != 1:
            # two of them would leave one silently unused (advantages win over rewards)
            raise UserError(
                "a rollout needs exactly one of reward, token_rewards or advantages"
                + (f", got {' and '.join(given)}" if given else "")
            )
        if self.reward is not None:
            _finite_number("reward", self.reward)
        if isinstance(self.advantages, (list, tuple)):
            _finite_numbers("advantages", self.advantages)
        elif self.advantages is not None:
            _finite_number("advantages", self.advantages)
        for name in ("token_rewards", "logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _finite_numbers(name, value)
        for name in ("token_rewards", "logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise UserError(f"{name} has {len(value)} entries for {n} response tokens")
        if isinstance(self.advantages, (list, tuple)) and len(self.advantages) != n:
            raise UserError(f"advantages has {len(self.advantages)} entries for {n} response tokens")
        for name in ("logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and any(v > 1e-4 for v in value):
                raise UserError(f"{name} must be log-probabilities (<= 0)")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, (int, str))):
            raise UserError(f"group must be an integer or a string, got {self.group!r}")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def load_rollouts(path: str | Path, vocab_size: int | None = None) -> list[Rollout]:
    """Rollouts from a JSONL file (one ``Rollout`` object per line), every field checked by type
    (``vocab_size``: ids inside the model's vocabulary); errors name the file and line."""
    out = []
    known = set(Rollout.__dataclass_fields__)
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"task.rollouts={path}: {'is a directory' if path.is_dir() else 'no such file'}; "
            "point it at a JSONL file of rollouts (one JSON object per line, docs/sft_rl.md)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    # NaN/Infinity are not JSON, but Python's json reads them: refuse them here by name
                    record = json.loads(line, parse_constant=_reject_constant)
                    if not isinstance(record, dict):
                        raise UserError("expected a JSON object")
                    unknown = sorted(set(record) - known)
                    if unknown:
                        raise UserError(f"unknown field(s) {unknown}; valid: {sorted(known)}")
                    missing = sorted({"prompt_ids", "response_ids"} - set(record))
                    if missing:
                        raise UserError(f"missing field(s) {missing}")
                    rollout = Rollout(**record)
                    rollout.validate(vocab_size)
                    out.append(rollout)
                except (UserError, ValueError, TypeError) as e:  # ValueError: json's own, a bad line
                    raise UserError(f"{path}:{lineno}: bad rollout: {e}") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); task.rollouts takes a JSONL file") from e
    except OSError as e:
        raise UserError(f"task.rollouts={path}: cannot read it ({e.strerror or e})") from e
    if not out:
        raise UserError(f"{path}: no rollouts (the file is empty)")
    return out


def _reject_constant(name: str) -> float:
    raise UserError(f"{name} is not a number: rewards, advantages and log-probs must be finite")


def save_rollouts(path: str | Path, rollouts: Iterable[Rollout]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rollouts:
            f.write(json.dumps(r.to_json()) + "\n")


def rollout_reward(r: Rollout) -> float:
    """The total reward of a rollout (sum of per-token rewards), for logging."""
    if r.reward is not None:
        return float(r.reward)
    if r.token_rewards is not None:
        return float(sum(r.token_rewards))
    return float("nan")
