"""The CPU toy task: count up from the prompt's last token (a reward that rises in about a minute)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from orthros_train.errors import UserError


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
            raise UserError("PatternTask needs 0 <= low < vocab_size - 1")

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
