"""RL fine-tuning: the GRPO math on rl layouts (docs/sft_rl.md).

A *rollout* is a prompt, a sampled response and how good it was. Rollouts come from a source
(``orthros_train/train/rollouts.py``): our own generation with the current weights
(``RolloutGenerator``: prefill + decode with sampling) or an external engine (vLLM, SGLang, ...)
as JSON lines in the format of ``Rollout`` (``load_rollouts``).

A batch of rollouts becomes one ``rl_layout``: every prompt + response is one document of the
packed base stream (sliding-window attention only), and output tokens sit only on the positions
that predict a response token. So the full-attention work of a step grows with the response
tokens, not with the prompt length. The same layout gives

* the log-probabilities of the response tokens under the policy, the old (sampling) policy and
  a frozen reference policy (``response_logprobs``), and
* the GRPO loss (``grpo_loss``): the PPO clipped surrogate on per-token advantages
  ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with ``r = exp(logp - logp_old)``, plus
  ``kl_coef * KL(policy || reference)`` (the non-negative ``k3`` estimator
  ``exp(ref - logp) - (ref - logp) - 1``), averaged over all response tokens of the step's
  global batch (``data.loss_average=token``) or per response and then over responses
  (``sequence``, the GRPO paper's form).

Advantages (``compute_advantages``): given per rollout, or from rewards normalised within each
group of rollouts that share a prompt (GRPO): a sequence reward gives every response token
``(r - mean) / std`` of its group; per-token rewards are normalised over all tokens of the group
and summed from each token to the end of the response (GRPO's process supervision).

The trainer (megatron TP/SP/CP + DeepSpeed) runs RL with the loss it runs everywhere,
``sum(w * CE) / units`` over the step's global batch: ``GRPOObjective`` turns each micro-batch
of rollouts into the same rl layout with weights ``w = -units * dLoss/dlogp`` (``surrogate_layout``),
whose gradient is exactly the GRPO gradient. ``PatternTask`` is the CPU toy task.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from orthros_train.data.rl import rl_batch
from orthros_train.data.sft import average_per_sequence
from orthros_train.parallel import collectives
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout
from orthros_train.train.config import RLConfig
from orthros_train.train.global_loss import loss_units

# reward_fn(prompt_ids, response_ids, reference_ids or None) -> one reward or one per response token
RewardFn = Callable[[list[int], list[int], "list[int] | None"], "float | Sequence[float]"]


# -- the rollout format ---------------------------------------------------------------------------
def _token_ids(name: str, ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray | torch.Tensor):
        raise ValueError(f"{name} must be a list of integer token ids, got {ids!r:.80}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool) or isinstance(t, np.bool_):
                raise TypeError
            value = operator.index(t)
        except TypeError:
            raise ValueError(f"{name} holds {t!r}, not an integer token id") from None
        if value < 0:
            raise ValueError(f"{name} holds {value}: token ids are >= 0")
        out.append(value)
    return out


def _finite_number(name: str, value: Any) -> None:
    # bool is an int to Python, but `true` as a reward is a bug in whatever wrote the file
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"{name} is {value}: rewards and advantages must be finite")


def _finite_numbers(name: str, values: Any) -> None:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a list of numbers, got {values!r:.80}")
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
            raise ValueError("a rollout needs a non-empty prompt_ids and response_ids")
        if vocab_size is not None:
            for name in ("prompt_ids", "response_ids"):
                bad = [t for t in getattr(self, name) if t >= vocab_size]
                if bad:
                    raise ValueError(
                        f"{name} holds token id {bad[0]}, outside the model's vocabulary of {vocab_size} "
                        "(model.vocab_size): the rollouts were tokenized for another model"
                    )
        n = len(self.response_ids)
        given = [k for k in ("reward", "token_rewards", "advantages") if getattr(self, k) is not None]
        if len(given) != 1:
            # two of them would leave one silently unused (advantages win over rewards)
            raise ValueError(
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
                raise ValueError(f"{name} has {len(value)} entries for {n} response tokens")
        if isinstance(self.advantages, (list, tuple)) and len(self.advantages) != n:
            raise ValueError(f"advantages has {len(self.advantages)} entries for {n} response tokens")
        for name in ("logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and any(v > 1e-4 for v in value):
                raise ValueError(f"{name} must be log-probabilities (<= 0)")
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, (int, str))):
            raise ValueError(f"group must be an integer or a string, got {self.group!r}")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def load_rollouts(path: str | Path, vocab_size: int | None = None) -> list[Rollout]:
    """Rollouts from a JSONL file (one ``Rollout`` object per line), every field checked by type
    (``vocab_size``: ids inside the model's vocabulary); errors name the file and line."""
    out = []
    known = set(Rollout.__dataclass_fields__)
    path = Path(path)
    if not path.is_file():
        raise ValueError(
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
                        raise ValueError("expected a JSON object")
                    unknown = sorted(set(record) - known)
                    if unknown:
                        raise ValueError(f"unknown field(s) {unknown}; valid: {sorted(known)}")
                    missing = sorted({"prompt_ids", "response_ids"} - set(record))
                    if missing:
                        raise ValueError(f"missing field(s) {missing}")
                    rollout = Rollout(**record)
                    rollout.validate(vocab_size)
                    out.append(rollout)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: bad rollout: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); task.rollouts takes a JSONL file") from e
    except OSError as e:
        raise ValueError(f"task.rollouts={path}: cannot read it ({e.strerror or e})") from e
    if not out:
        raise ValueError(f"{path}: no rollouts (the file is empty)")
    return out


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number: rewards, advantages and log-probs must be finite")


def save_rollouts(path: str | Path, rollouts: Iterable[Rollout]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rollouts:
            f.write(json.dumps(r.to_json()) + "\n")


# -- advantages -----------------------------------------------------------------------------------
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
            raise ValueError(f"group {key[-1]!r} mixes sequence and per-token rewards")
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


# -- layouts and log-probs ------------------------------------------------------------------------
def rollout_layout(rollouts: Sequence[Rollout], advantages: Sequence[torch.Tensor] | None = None) -> OrthrosLayout:
    """The rl layout of a batch: rows ``prompt + response``, output tokens on response targets only.

    Output token ``k`` of the layout predicts response token ``k`` of the concatenated responses
    (rows in order), so per-token tensors (advantages, log-probs) line up with ``layout.labels``.
    ``loss_weights`` are the advantages (1 when none are given).
    """
    if not rollouts:
        raise ValueError("no rollouts")
    weights = advantages if advantages is not None else [1.0] * len(rollouts)
    return rl_batch([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], list(weights))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per output token, in fp32 or better (differentiable)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return -F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def response_logprobs(model: torch.nn.Module, layout: OrthrosLayout) -> torch.Tensor:
    """Log-prob of every response token ``[N]`` under ``model`` on the rl layout (grad when enabled).

    Works with the reference ``OrthrosForCausalLM`` and with ``ParallelOrthrosForCausalLM``
    (whose ``forward_layout`` returns the TP-gathered logits by default).
    """
    return token_logprobs(model.forward_layout(layout).logits, layout.labels)



# -- the GRPO objective ---------------------------------------------------------------------------
def normalizer(layout: OrthrosLayout, loss_average: str, units: int | None = None) -> torch.Tensor:
    """Per-token factor ``[N]`` that turns a sum over tokens into the chosen average.

    token: ``1 / units`` (every response token counts the same); sequence: ``1 / (len(row) *
    units)`` (every response counts the same). ``units`` are the response tokens, or responses,
    of the whole batch the average runs over (default: this layout's own; the trainer passes the
    step's global count, ``orthros_train.train.global_loss``).
    """
    units = loss_units(layout, loss_average) if units is None else units
    ones = copy.copy(layout)
    ones.loss_weights = torch.ones_like(layout.loss_weights, dtype=torch.float64)
    per_token = average_per_sequence(ones).loss_weights if loss_average == "sequence" else ones.loss_weights
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

    All tensors are per response token ``[N]``; ``weights`` come from ``normalizer``.
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
    ``w = -c * units`` (``units`` defaults to the layout's labelled tokens, the models' default
    normalizer).
    """
    units = layout.num_loss_tokens if units is None else units
    leaf = logp.detach().double().clone().requires_grad_(True)
    loss, stats = grpo_loss(leaf, old_logp.detach().double(), advantages.double(), weights.double(),
                            None if ref_logp is None else ref_logp.detach().double(), **objective)
    (coeff,) = torch.autograd.grad(loss, leaf)
    out = copy.copy(layout)
    out.loss_weights = (-coeff * units).to(layout.loss_weights.dtype)
    return out, float(loss.detach()), stats


@dataclass
class RolloutBatch:
    """A micro-batch of rollouts as the trainer reads it: the rl layout (weights = advantages) and
    the per-response-token tensors that line up with ``layout.labels``."""

    layout: OrthrosLayout
    advantages: torch.Tensor  # [N]
    old_logp: torch.Tensor | None = None  # [N] the sampling policy's; None: on-policy
    ref_logp: torch.Tensor | None = None  # [N] given by the rollouts; None: the reference model's
    rewards: list[float] = field(default_factory=list)  # total reward of each rollout

    @classmethod
    def of(cls, rollouts: Sequence[Rollout], advantages: Sequence[torch.Tensor], recompute_old: bool = False):
        def given(name: str) -> torch.Tensor | None:
            values = [getattr(r, name) for r in rollouts]
            if any(v is None for v in values):
                return None
            return torch.tensor([x for v in values for x in v], dtype=torch.float32)

        return cls(
            layout=rollout_layout(rollouts, advantages),
            advantages=torch.cat(list(advantages)).float(),
            old_logp=None if recompute_old else given("logprobs"),
            ref_logp=given("ref_logprobs"),
            rewards=[rollout_reward(r) for r in rollouts],
        )

    def to(self, device: torch.device | str) -> "RolloutBatch":
        def move(t):
            return None if t is None else t.to(device)

        return RolloutBatch(self.layout.to(device), self.advantages.to(device), move(self.old_logp),
                            move(self.ref_logp), list(self.rewards))


LogprobFn = Callable[[OrthrosLayout], torch.Tensor]


class GRPOObjective:
    """A step's rollout micro-batches -> the layouts the trainer's loss turns into a GRPO step.

    ``policy_logprobs`` / ``reference_logprobs`` give the response tokens' log-probs under the
    current policy and the frozen reference (no grad; sharded models, collective calls). The
    policy's are needed only off-policy (rollouts with ``logprobs``) or with a KL term: an
    on-policy update without KL has ratio 1, and its GRPO gradient is that of the rl layout with
    weights = advantages (times ``1 / len(row)`` in sequence mode).
    """

    def __init__(
        self,
        cfg: RLConfig,
        loss_average: str,
        policy_logprobs: LogprobFn,
        reference_logprobs: LogprobFn | None = None,
        group: Any = None,
    ) -> None:
        if cfg.kl_coef > 0 and reference_logprobs is None:
            raise ValueError("rl.kl_coef > 0 needs the frozen reference model")
        self.cfg = cfg
        self.loss_average = loss_average
        self.policy_logprobs = policy_logprobs
        self.reference_logprobs = reference_logprobs
        self.group = group  # data-parallel group the diagnostics are summed over

    def prepare(
        self, batches: Sequence[RolloutBatch], units: int
    ) -> tuple[list[OrthrosLayout], list[float], dict[str, float]]:
        """Layouts to train on, each micro-batch's share of the step's GRPO loss, and the step's
        diagnostics (global means over the data-parallel group)."""
        cfg = self.cfg
        objective = dict(clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef)
        layouts, values = [], []
        sums = {"ratio_sum": 0.0, "clipped": 0.0, "neg_logp_sum": 0.0, "kl_sum": 0.0}
        for b in batches:
            weights = normalizer(b.layout, self.loss_average, units).to(b.advantages.device)
            if b.old_logp is None and cfg.kl_coef == 0:
                out = copy.copy(b.layout)  # ratio 1: dLoss/dlogp = -A * weights
                out.loss_weights = (b.advantages.double() * weights * max(units, 1)).to(b.layout.loss_weights.dtype)
                value = float(-(b.advantages.double() * weights).sum())
                n = b.layout.num_outputs
                stats = {"ratio_sum": float(n), "clipped": 0.0, "neg_logp_sum": math.nan}
            else:
                logp = self.policy_logprobs(b.layout)
                old = b.old_logp if b.old_logp is not None else logp
                ref = b.ref_logp
                if cfg.kl_coef > 0 and ref is None:
                    ref = self.reference_logprobs(b.layout)
                out, value, stats = surrogate_layout(
                    b.layout, logp, old, b.advantages, weights, ref, units=max(units, 1), **objective
                )
            for k, v in stats.items():
                sums[k] += v
            layouts.append(out)
            values.append(value)
        rewards = [r for b in batches for r in b.rewards]
        scored = [r for r in rewards if not math.isnan(r)]  # rollouts given as advantages carry no reward
        tokens = sum(b.layout.num_outputs for b in batches)
        totals = torch.tensor(
            [sum(scored), float(len(scored)), float(len(rewards)), float(tokens), sums["ratio_sum"], sums["clipped"],
             sums["neg_logp_sum"], sums["kl_sum"], float(sum(b.advantages.abs().sum() for b in batches))],
            dtype=torch.float64,
            device=batches[0].advantages.device,
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
        if cfg.kl_coef > 0:
            stats["kl"] = kl / n_tokens
        return layouts, values, stats


# -- rollouts from our own generation -------------------------------------------------------------
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
                except ValueError as e:  # e.g. a NaN reward: name the function, not a non-finite loss later
                    raise ValueError(f"the reward function {getattr(self.reward_fn, '__name__', self.reward_fn)!r} "
                                     f"returned {reward!r}: {e}") from e
        return rollouts


def reference_match_reward(
    prompt_ids: list[int], response_ids: list[int], reference_ids: list[int] | None
) -> list[float]:
    """Per-token reward: 1 where response token ``i`` equals reference token ``i`` (a simple
    verifiable reward for prompt sets with reference answers, e.g. ``orthros-data rl --reference-field``).
    Tokens past the reference earn 0, so stopping on time pays."""
    if reference_ids is None:
        raise ValueError("reference_match_reward needs prompts with a reference answer")
    return [1.0 if i < len(reference_ids) and t == reference_ids[i] else 0.0 for i, t in enumerate(response_ids)]


def rollout_reward(r: Rollout) -> float:
    """The total reward of a rollout (sum of per-token rewards), for logging."""
    if r.reward is not None:
        return float(r.reward)
    if r.token_rewards is not None:
        return float(sum(r.token_rewards))
    return float("nan")


# -- the CPU toy task -----------------------------------------------------------------------------
@dataclass
class PatternTask:
    """Toy RL task: continue the prompt by counting up, one step at a time.

    Prompts are ``prompt_len`` random tokens from ``[low, vocab)``. Response token ``i`` earns 1
    when it is the successor of the token before it (the prompt's last token for ``i = 0``),
    counting within ``[low, vocab)`` and wrapping around; a perfect response is
    ``last+1, last+2, ...``. ``token_rewards=True`` returns the per-token hits (process reward),
    else one reward: the fraction of hits over ``response_len``. An untrained model scores about
    ``1 / (vocab - low)``.
    """

    vocab_size: int = 16
    low: int = 2
    prompt_len: int = 8
    response_len: int = 8
    token_rewards: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size - 1:
            raise ValueError("PatternTask needs 0 <= low < vocab_size - 1")

    def next_token(self, t: int) -> int:
        span = self.vocab_size - self.low
        return self.low + (t - self.low + 1) % span

    def target(self, prompt: Sequence[int]) -> list[int]:
        """The perfect response."""
        out, t = [], int(prompt[-1])
        for _ in range(self.response_len):
            t = self.next_token(t)
            out.append(t)
        return out

    def hits(self, prompt: Sequence[int], response: Sequence[int]) -> list[float]:
        prev = [int(prompt[-1]), *[int(t) for t in response[:-1]]]
        return [1.0 if i < self.response_len and int(t) == self.next_token(p) else 0.0
                for i, (p, t) in enumerate(zip(prev, response))]

    def prompt(self, index: int) -> list[int]:
        """Prompt number ``index`` of the task's stream (a pure function of seed and index, so a
        resumed or differently sharded run reads the same prompts)."""
        rng = np.random.default_rng([self.seed, int(index)])
        return [int(t) for t in rng.integers(self.low, self.vocab_size, self.prompt_len)]

    def prompts(self, indices: Iterable[int]) -> list[list[int]]:
        return [self.prompt(i) for i in indices]

    def reward(self, prompt: list[int], response: list[int], reference: list[int] | None = None) -> float | list[float]:
        hits = self.hits(prompt, response)
        return hits if self.token_rewards else sum(hits) / self.response_len

    def score(self, policy: torch.nn.Module, n: int = 64, seed: int = 12345) -> float:
        """Greedy accuracy (mean per-token hit rate) on ``n`` fresh prompts."""
        from orthros_train.infer import generate

        fresh = PatternTask(self.vocab_size, self.low, self.prompt_len, self.response_len, seed=seed)
        prompts = fresh.prompts(range(n))
        out = generate(policy, prompts, max_new_tokens=self.response_len)
        return sum(sum(self.hits(p, r)) / self.response_len for p, r in zip(prompts, out.sequences)) / n


__all__ = [
    "GRPOObjective",
    "PatternTask",
    "Rollout",
    "RolloutBatch",
    "RolloutGenerator",
    "compute_advantages",
    "grpo_loss",
    "load_rollouts",
    "normalizer",
    "reference_match_reward",
    "response_logprobs",
    "rollout_layout",
    "rollout_reward",
    "save_rollouts",
    "surrogate_layout",
    "token_logprobs",
]
