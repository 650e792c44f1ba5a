"""RL fine-tuning: GRPO-style policy-gradient steps on rl layouts (docs/sft_rl.md).

A *rollout* is a prompt, a sampled response and how good it was. Rollouts come from our own
generation (``RolloutGenerator``: prefill + decode with sampling) or from an external engine
(vLLM, SGLang, ...) as JSON lines in the format of ``Rollout`` (``load_rollouts``).

A batch of rollouts becomes one ``rl_layout``: every prompt + response is one document of the
packed base stream (sliding-window attention only), and output tokens sit only on the positions
that predict a response token. So the full-attention work of a step grows with the response
tokens, not with the prompt length. The same layout gives

* the log-probabilities of the response tokens under the policy, the old (sampling) policy and
  a frozen reference policy (``response_logprobs``), and
* the GRPO loss (``grpo_loss``): the PPO clipped surrogate on per-token advantages
  ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with ``r = exp(logp - logp_old)``, plus
  ``kl_coef * KL(policy || reference)`` (the non-negative ``k3`` estimator
  ``exp(ref - logp) - (ref - logp) - 1``), averaged over all response tokens of the batch
  (``loss_average="token"``) or per sequence and then over sequences (``"sequence"``, the GRPO
  paper's form).

Advantages (``compute_advantages``): given per rollout, or from rewards normalised within each
group of rollouts that share a prompt (GRPO): a sequence reward gives every response token
``(r - mean) / std`` of its group; per-token rewards are normalised over all tokens of the group
and summed from each token to the end of the response (GRPO's process supervision).

``surrogate_layout`` turns a GRPO step into a plain weighted-cross-entropy layout whose gradient
is exactly the GRPO gradient (the weights are ``-dLoss/dlogp`` times the token count), so the
main trainer (megatron TP/SP + DeepSpeed), whose loss is ``sum(w * CE) / N``, can run RL updates
without knowing about them.

``GRPOTrainer`` is the simple synchronous loop on one process (generate -> score -> update) with
a plain torch AdamW on the reference ``OrthrosForCausalLM``; ``PatternTask`` is the CPU toy task.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from orthros_train.data.rl import rl_batch
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout
from orthros_train.train.config import OptimConfig
from orthros_train.train.optim import build_optimizer, lr_at, set_lr

# reward_fn(prompt_ids, response_ids, reference_ids or None) -> one reward or one per response token
RewardFn = Callable[[list[int], list[int], "list[int] | None"], "float | Sequence[float]"]
LOSS_AVERAGES = ("token", "sequence")


# -- the rollout format ---------------------------------------------------------------------------
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
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.response_ids = [int(t) for t in self.response_ids]
        self.validate()

    def validate(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError("a rollout needs a non-empty prompt_ids and response_ids")
        n = len(self.response_ids)
        given = [k for k in ("reward", "token_rewards", "advantages") if getattr(self, k) is not None]
        if not given:
            raise ValueError("a rollout needs one of reward, token_rewards or advantages")
        for name in ("token_rewards", "logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} response tokens")
        if isinstance(self.advantages, (list, tuple)) and len(self.advantages) != n:
            raise ValueError(f"advantages has {len(self.advantages)} entries for {n} response tokens")
        for name in ("logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and any(v > 1e-4 or math.isnan(v) for v in value):
                raise ValueError(f"{name} must be log-probabilities (<= 0)")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def load_rollouts(path: str | Path) -> list[Rollout]:
    """Rollouts from a JSONL file (one ``Rollout`` object per line); errors name the line."""
    out = []
    known = set(Rollout.__dataclass_fields__)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("expected a JSON object")
                unknown = sorted(set(record) - known)
                if unknown:
                    raise ValueError(f"unknown field(s) {unknown}; valid: {sorted(known)}")
                out.append(Rollout(**record))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad rollout: {e}") from e
    if not out:
        raise ValueError(f"{path}: no rollouts")
    return out


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
@dataclass
class RLConfig:
    """GRPO settings (the ``rl`` section of an RL recipe)."""

    group_size: int = 8  # responses sampled per prompt
    prompts_per_step: int = 8  # prompts per rollout batch
    max_new_tokens: int = 16
    temperature: float = 1.0  # sampling (1.0: the policy's own distribution, so old logp == policy logp)
    top_p: float = 1.0
    clip_eps_low: float = 0.2  # ratio clipped to [1 - low, 1 + high] (DAPO "clip-higher": high > low)
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0  # beta of KL(policy || reference); > 0 keeps a frozen copy of the initial policy
    loss_average: str = "token"  # token: over all response tokens | sequence: per response, then over responses
    scale_advantages: bool = True  # divide group-centred rewards by the group std (GRPO) or not (Dr. GRPO)
    ppo_epochs: int = 1  # passes over each rollout batch
    minibatches: int = 1  # optimizer steps per pass
    micro_batch_rows: int | None = None  # rows per forward (gradient accumulation); None: the whole minibatch
    recompute_old_logprobs: bool = False  # ignore rollouts' logprobs; use the current policy's before updating
    seed: int = 0  # sampling seed

    def __post_init__(self) -> None:
        if self.loss_average not in LOSS_AVERAGES:
            raise ValueError(f"rl.loss_average must be one of {LOSS_AVERAGES}, got {self.loss_average!r}")
        for name in ("group_size", "prompts_per_step", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rl.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0 or self.clip_eps_low >= 1:
            raise ValueError("rl.clip_eps_low must lie in [0, 1) and rl.clip_eps_high must be >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"rl.kl_coef must be >= 0, got {self.kl_coef}")
        if self.temperature <= 0:
            raise ValueError("rl.temperature must be > 0 (RL samples; greedy rollouts carry no exploration)")
        if self.micro_batch_rows is not None and self.micro_batch_rows < 1:
            raise ValueError(f"rl.micro_batch_rows must be >= 1 or null, got {self.micro_batch_rows}")


def normalizer(layout: OrthrosLayout, loss_average: str, num_rows: int | None = None) -> torch.Tensor:
    """Per-token factor ``[N]`` that turns a sum over tokens into the chosen average.

    token: ``1 / N`` (every response token counts the same); sequence: ``1 / (rows * len(row))``
    (every response counts the same). ``num_rows`` is the row count of the batch the average runs
    over when this layout is only a micro-batch of it (default: this layout's rows).
    """
    n = layout.num_outputs
    if loss_average == "token":
        return torch.full((n,), 1.0 / max(n, 1), dtype=torch.float64, device=layout.labels.device)
    if loss_average != "sequence":
        raise ValueError(f"loss_average must be one of {LOSS_AVERAGES}, got {loss_average!r}")
    counts = torch.bincount(layout.row_of_output, minlength=layout.num_rows).double()
    rows = num_rows if num_rows is not None else int((counts > 0).sum())
    return 1.0 / (counts[layout.row_of_output] * rows)


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
    """``sum_t weights_t * (-min(r_t A_t, clip(r_t) A_t) + kl_coef * k3_t)`` and diagnostics.

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
        n = max(logp.numel(), 1)
        stats = {
            "ratio_mean": float(ratio.sum() / n),
            "clip_fraction": float((clipped != unclipped).float().sum() / n),
            "entropy_proxy": float(-logp.sum() / n),  # mean negative log-prob of the sampled tokens
        }
        if kl is not None:
            stats["kl"] = float(kl.sum() / n)
    return loss, stats


def surrogate_layout(
    layout: OrthrosLayout,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    **objective: float,
) -> OrthrosLayout:
    """A copy of ``layout`` whose weighted cross entropy has exactly the GRPO gradient at ``logp``.

    ``logp`` is the policy's current log-prob (no grad). With ``c = dLoss/dlogp`` the layout
    loss ``sum(w * CE) / N = -sum(w * logp) / N`` has gradient ``sum(c * dlogp)`` when
    ``w = -c * N``: the main trainer's loss then is a GRPO step.
    """
    leaf = logp.detach().float().clone().requires_grad_(True)
    loss, _ = grpo_loss(leaf, old_logp.detach(), advantages, weights, ref_logp, **objective)
    (coeff,) = torch.autograd.grad(loss, leaf)
    out = copy.copy(layout)
    out.loss_weights = (-coeff * layout.num_loss_tokens).to(layout.loss_weights.dtype)
    return out


# -- rollouts from our own generation -------------------------------------------------------------
class RolloutGenerator:
    """Samples ``group_size`` responses per prompt with the policy (prefill + decode) and scores them."""

    def __init__(self, reward_fn: RewardFn, cfg: RLConfig, stop_token_ids: Sequence[int] = ()) -> None:
        self.reward_fn = reward_fn
        self.cfg = cfg
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.calls = 0

    @torch.no_grad()
    def __call__(
        self,
        policy: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        group_offset: int = 0,
        references: Sequence[Sequence[int] | None] | None = None,
    ) -> list[Rollout]:
        """``group_size`` scored rollouts per prompt; prompt ``i`` gets group ``group_offset + i``."""
        from orthros_train.infer import SamplingParams, generate

        cfg = self.cfg
        refs = list(references) if references is not None else [None] * len(prompts)
        rows = [list(p) for p in prompts for _ in range(cfg.group_size)]
        params = SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=self.stop_token_ids,
            seed=cfg.seed * 1_000_003 + self.calls,
        )
        self.calls += 1
        result = generate(policy, rows, params)
        rollouts = []
        for k, (prompt, response) in enumerate(zip(rows, result.sequences)):
            if not response:  # max_new_tokens >= 1 and prompts are non-empty: cannot happen
                continue
            ref = refs[k // cfg.group_size]
            reward = self.reward_fn(list(prompt), list(response), None if ref is None else [int(t) for t in ref])
            kw: dict[str, Any] = {}
            if isinstance(reward, (int, float)):
                kw["reward"] = float(reward)
            else:
                kw["token_rewards"] = [float(x) for x in reward]
            rollouts.append(Rollout(prompt, response, group=group_offset + k // cfg.group_size, **kw))
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


# -- the synchronous loop -------------------------------------------------------------------------
class GRPOTrainer:
    """GRPO on one process: plain AdamW on a reference ``OrthrosForCausalLM`` (or any module with
    ``forward_layout`` returning logits).

    ``update(rollouts)`` trains on a batch of rollouts (ours or an external engine's);
    ``train(prompt_fn, generator)`` runs the synchronous generate -> score -> update loop.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        cfg: RLConfig,
        optim: OptimConfig | None = None,
        max_steps: int = 100,
        ref_model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.policy = policy
        self.cfg = cfg
        # RL fine-tuning defaults: a small constant lr, no weight decay.
        self.optim = optim or OptimConfig(lr=1e-5, min_lr=1e-5, weight_decay=0.0, warmup_steps=0, schedule="constant")
        self.max_steps = max_steps
        if cfg.kl_coef > 0 and ref_model is None:
            ref_model = copy.deepcopy(policy)  # the frozen initial policy
        self.ref_model = ref_model
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = optimizer or build_optimizer(policy, self.optim)
        self.device = next(policy.parameters()).device
        self.step = 0  # rollout batches trained on
        self.optimizer_steps = 0
        self.rng = random.Random(cfg.seed)

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, layout: OrthrosLayout) -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            return response_logprobs(model, layout).detach()
        finally:
            model.train(was)

    def prepare(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """Layout, advantages, old and reference log-probs of a rollout batch (no gradient)."""
        cfg = self.cfg
        adv = compute_advantages(rollouts, scale=cfg.scale_advantages)
        layout = rollout_layout(rollouts, adv).to(self.device)
        advantages = torch.cat(adv).to(self.device)
        given_old = [r.logprobs for r in rollouts]
        single_pass = cfg.ppo_epochs == 1 and cfg.minibatches == 1
        if all(x is not None for x in given_old) and not cfg.recompute_old_logprobs:
            old = torch.tensor([v for x in given_old for v in x], dtype=torch.float32, device=self.device)
        elif single_pass:
            old = None  # on-policy, one update: old == current policy, taken from the same forward
        else:
            old = self._logprobs(self.policy, layout)
        ref = None
        if cfg.kl_coef > 0:
            given_ref = [r.ref_logprobs for r in rollouts]
            if all(x is not None for x in given_ref):
                ref = torch.tensor([v for x in given_ref for v in x], dtype=torch.float32, device=self.device)
            else:
                ref = self._logprobs(self.ref_model, layout)
        return {"layout": layout, "advantages": advantages, "old_logp": old, "ref_logp": ref}

    def _rows_layout(self, rollouts: Sequence[Rollout], rows: Sequence[int]) -> OrthrosLayout:
        return rollout_layout([rollouts[i] for i in rows]).to(self.device)

    def update(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """``ppo_epochs`` x ``minibatches`` optimizer steps on a rollout batch; returns diagnostics."""
        cfg = self.cfg
        prep = self.prepare(rollouts)
        layout, adv = prep["layout"], prep["advantages"]
        # per-row slices of the flat per-token tensors
        starts = torch.cumsum(torch.tensor([0] + [len(r.response_ids) for r in rollouts]), 0).tolist()
        self.policy.train()
        stats: dict[str, float] = {}
        n_rows = len(rollouts)
        for _epoch in range(cfg.ppo_epochs):
            order = list(range(n_rows))
            if cfg.ppo_epochs > 1 or cfg.minibatches > 1:
                self.rng.shuffle(order)
            per_mb = math.ceil(n_rows / cfg.minibatches)
            for m in range(cfg.minibatches):
                mb = sorted(order[m * per_mb : (m + 1) * per_mb])
                if not mb:
                    continue
                stats = self._optimizer_step(rollouts, mb, starts, prep)
        stats["loss_tokens"] = float(layout.num_outputs)
        stats["reward_mean"] = sum(rollout_reward(r) for r in rollouts) / len(rollouts)
        stats["advantage_abs_mean"] = float(adv.abs().mean())
        stats["response_len_mean"] = sum(len(r.response_ids) for r in rollouts) / len(rollouts)
        self.step += 1
        return stats

    def _optimizer_step(self, rollouts, mb: list[int], starts: list[int], prep: dict) -> dict[str, float]:
        cfg = self.cfg
        tokens_total = sum(len(rollouts[i].response_ids) for i in mb)
        micro = cfg.micro_batch_rows or len(mb)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, agg = 0.0, {}
        for c in range(0, len(mb), micro):
            rows = mb[c : c + micro]
            layout = self._rows_layout(rollouts, rows)
            idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows]).to(self.device)
            if cfg.loss_average == "token":
                weights = torch.full((layout.num_outputs,), 1.0 / tokens_total, dtype=torch.float64, device=self.device)
            else:
                weights = normalizer(layout, "sequence", num_rows=len(mb))
            logp = response_logprobs(self.policy, layout)
            old = prep["old_logp"][idx] if prep["old_logp"] is not None else logp.detach()
            ref = prep["ref_logp"][idx] if prep["ref_logp"] is not None else None
            loss, s = grpo_loss(
                logp, old, prep["advantages"][idx], weights, ref,
                cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef,
            )
            loss.backward()
            total_loss += float(loss.detach())
            share = layout.num_outputs / tokens_total
            for k, v in s.items():
                agg[k] = agg.get(k, 0.0) + v * share
        params = [p for p in self.policy.parameters() if p.grad is not None]
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        lr = lr_at(self.step, self.optim, self.max_steps)  # the schedule runs over rollout batches
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer_steps += 1
        return {"loss": total_loss, "grad_norm": float(grad_norm), "lr": lr, **agg}

    def train(
        self,
        prompt_fn: Callable[[int], Sequence[Sequence[int]] | tuple[list, list]],
        generator: RolloutGenerator,
        steps: int | None = None,
        log: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """The synchronous loop: prompts -> ``generator`` (sample + score) -> ``update``.

        ``prompt_fn(step)`` returns the prompts of a step (token id lists), or ``(prompts,
        references)`` for reward functions that compare with a reference answer.
        """
        history = []
        target = self.step + steps if steps is not None else self.max_steps
        while self.step < target:
            t0 = time.perf_counter()
            got = prompt_fn(self.step)
            prompts, refs = got if isinstance(got, tuple) else (got, None)
            rollouts = generator(self.policy, prompts, self.step * len(prompts), refs)
            t1 = time.perf_counter()
            stats = self.update(rollouts)
            t2 = time.perf_counter()
            record = {"step": self.step, **stats, "generate_s": t1 - t0, "update_s": t2 - t1}
            history.append(record)
            if log is not None:
                log(record)
        return history


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
    _rng: random.Random = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size - 1:
            raise ValueError("PatternTask needs 0 <= low < vocab_size - 1")
        self._rng = random.Random(self.seed)

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

    def prompts(self, n: int) -> list[list[int]]:
        return [[self._rng.randrange(self.low, self.vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]

    def reward(self, prompt: list[int], response: list[int], reference: list[int] | None = None) -> float | list[float]:
        hits = self.hits(prompt, response)
        return hits if self.token_rewards else sum(hits) / self.response_len

    def score(self, policy: torch.nn.Module, n: int = 64, seed: int = 12345) -> float:
        """Greedy accuracy (mean per-token hit rate) on ``n`` fresh prompts."""
        from orthros_train.infer import generate

        rng = random.Random(seed)
        prompts = [[rng.randrange(self.low, self.vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]
        out = generate(policy, prompts, max_new_tokens=self.response_len)
        return sum(sum(self.hits(p, r)) / self.response_len for p, r in zip(prompts, out.sequences)) / n


__all__ = [
    "GRPOTrainer",
    "LOSS_AVERAGES",
    "PatternTask",
    "RLConfig",
    "Rollout",
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
