"""Rollouts as the trainer's batch, and the log-probs of a batch's labels under a model.

A batch of rollouts is one rl ``OrthrosLayout``: every prompt + response is one document of the
packed base stream (sliding-window attention only), and output tokens sit only on the positions
that predict a response token, so the full-attention work of a step grows with the response
tokens, not with the prompt length. Its ``loss_weights`` are the advantages; GRPO's other
per-token inputs travel beside the labels in ``output_values`` and each rollout's reward in
``row_values``, so RL data is the same batch type as every other phase's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from orthros_train.data.rl import rl_batch
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout
from orthros_train.train.rl.rollout import Rollout, rollout_reward

# output_values keys: log-prob of each response token under the sampling (old) policy and under
# the frozen reference policy, when the rollouts carry them
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
# row_values key: each rollout's total reward (NaN for rollouts given as advantages)
REWARD = "reward"


def rollout_layout(
    rollouts: Sequence[Rollout], advantages: Sequence[torch.Tensor] | None = None, recompute_old: bool = False
) -> OrthrosLayout:
    """The rl layout of a batch: rows ``prompt + response``, output tokens on response targets only.

    Output token ``k`` of the layout predicts response token ``k`` of the concatenated responses
    (rows in order), so per-token tensors (advantages, log-probs) line up with ``layout.labels``.
    ``loss_weights`` are the advantages (1 when none are given). The rollouts' own ``logprobs``
    and ``ref_logprobs`` become ``output_values`` when every rollout has them (``recompute_old``
    drops the old ones: the policy's are taken before the batch's updates instead).
    """
    if not rollouts:
        raise ValueError("no rollouts")
    weights = advantages if advantages is not None else [1.0] * len(rollouts)
    layout = rl_batch([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], list(weights))
    given = {OLD_LOGPROBS: "logprobs", REF_LOGPROBS: "ref_logprobs"}
    if recompute_old:
        given.pop(OLD_LOGPROBS)
    for key, name in given.items():
        values = [getattr(r, name) for r in rollouts]
        if all(v is not None for v in values):
            layout.output_values[key] = torch.tensor([x for v in values for x in v], dtype=torch.float32)
    layout.row_values[REWARD] = [rollout_reward(r) for r in rollouts]
    return layout


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
