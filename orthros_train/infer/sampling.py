"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

import torch

from orthros_train.errors import UserError


@dataclass
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy (argmax); top-k/top-p apply when sampling.

    max_new_tokens     hard cap on generated tokens per row
    stop_token_ids     a row stops after emitting one of these (the stop token is kept in the output)
    prefill_chunk_size prompt tokens per prefill forward (None: the whole prompt at once; "auto":
                       ``PREFILL_CHUNK`` for Orthros and sliding models, the whole prompt for dense);
                       chunks continue the KV cache, so no forward ever sees more than this many queries
    seed               seeds the sampling generator (reproducible sampling)
    cuda_graph         decode through a static step at the cache's capacity (prompt + max_new_tokens),
                       captured once in a CUDA graph and replayed per token (``infer/static_decode.py``);
                       a CPU model runs the same static step without a graph. Same tokens as eager
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    prefill_chunk_size: int | Literal["auto"] | None = "auto"
    seed: int | None = None
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in (self.stop_token_ids or ()))
        self.validate()

    def validate(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise UserError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise UserError(f"{name} must be a number, got {value!r}")
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        # NaN passes every comparison's negation (nan < 0 is false) and inf divides the logits to 0:
        # both would reach torch as a broken probability tensor, so finite is checked first.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise UserError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.cuda_graph, bool):
            raise UserError(f"cuda_graph must be true or false, got {self.cuda_graph!r}")
        chunk = self.prefill_chunk_size
        if chunk is not None and chunk != "auto" and (not isinstance(chunk, int) or chunk < 1):
            raise UserError(f"prefill_chunk_size must be an int >= 1, 'auto' or None, got {chunk!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest nucleus of mass >= top_p.

    The most likely token always survives, so a row never ends up with nothing to sample.
    """
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token id per row from ``logits [B, V]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
