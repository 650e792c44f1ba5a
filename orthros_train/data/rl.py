"""RL data: prompts (from ``orthros-data rl`` shards) out, scored responses -> ``rl_layout`` in.

The RL loop draws prompts with the same resumable, data-parallel sampler as every other source,
generates responses, scores them, and packs prompt + response rows with per-token weights
(advantages) on the response tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from orthros_train.data.indexed import MODE_PROMPT, MODE_REFERENCE
from orthros_train.data.sampler import ResumableSampler
from orthros_train.data.sft import ConversationStore
from orthros_train.errors import UserError
from orthros_train.phase.builders import rl_layout
from orthros_train.phase.layout import OrthrosLayout


@dataclass
class Prompt:
    index: int  # conversation index in the store (stable id for logging)
    input_ids: np.ndarray  # the rendered prompt, ending with the generation prompt
    reference_ids: np.ndarray | None  # tokenized reference answer, if the set has one


class PromptSet:
    """Prompts of an RL set, dealt out by a ``ResumableSampler`` (state in checkpoints)."""

    def __init__(self, prefixes: list[str], micro_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
        self.store = ConversationStore(prefixes)
        order = np.random.default_rng([seed, 11]).permutation(len(self.store))
        self.order = order
        self.sampler = ResumableSampler(len(self.store), micro_batch_size, seed, dp_rank, dp_size)

    def __len__(self) -> int:
        return len(self.store)

    def prompt(self, i: int) -> Prompt:
        parts, modes = self.store.segments(i)
        prompt = np.concatenate([p for p, m in zip(parts, modes) if m == MODE_PROMPT]).astype(np.int64)
        ref = [p for p, m in zip(parts, modes) if m == MODE_REFERENCE]
        return Prompt(i, prompt, np.concatenate(ref).astype(np.int64) if ref else None)

    def next_prompts(self) -> list[Prompt]:
        return [self.prompt(int(self.order[k])) for k in self.sampler.next_indices()]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def rl_batch(
    prompts: Sequence[np.ndarray | torch.Tensor],
    responses: Sequence[np.ndarray | torch.Tensor],
    weights: Sequence[float | Sequence[float]],
) -> OrthrosLayout:
    """Rows ``prompt + response``; loss on the response tokens only, weighted per token.

    ``weights[b]`` is one number (a sequence-level advantage) or one per response token.
    """
    if not (len(prompts) == len(responses) == len(weights)):
        raise UserError("prompts, responses and weights must have one entry per row")
    rows, spans, token_weights = [], [], []
    for p, r, w in zip(prompts, responses, weights):
        p, r = torch.as_tensor(p).long(), torch.as_tensor(r).long()
        if p.numel() == 0 or r.numel() == 0:
            raise UserError("each row needs a non-empty prompt and response")
        row = torch.cat([p, r])
        tw = torch.zeros(row.numel(), dtype=torch.float32)
        tw[p.numel() :] = torch.as_tensor(w, dtype=torch.float32).expand(r.numel())
        rows.append(row)
        spans.append([(p.numel(), row.numel())])
        token_weights.append(tw)
    return rl_layout(rows, spans, token_weights)
