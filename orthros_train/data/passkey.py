"""Pass-key probes: a needle hidden in a haystack, asked back at the end.

Every pass-key probe of the project is built here, so they all lay out a probe the same way: the
key-value needle of the synthetic recall documents (``synthetic_recall.make_passkey_document``),
the pass-key sentence in essay text of the lm-eval example task (``eval/tasks``), and the
tokenized prompts of the conversion study (``study/smollm2_eval.py``, ``study/pipeline.py``).

The helpers draw from the caller's ``random.Random`` in a fixed order, so a seed gives the same
probes as it always has (recorded results under ``docs/`` depend on that).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

PASSKEY_QUESTION = "What is the pass key? The pass key is"


def draw_passkey(rng: random.Random) -> str:
    """A five-digit pass key (one draw from ``rng``)."""
    return str(rng.randrange(10000, 100000))


def passkey_sentence(key: str) -> str:
    """The needle sentence that states ``key`` (twice, so a reader cannot miss it)."""
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def haystack_slice(rng: random.Random, text: Sequence[T], length: int) -> list[T]:
    """``length`` consecutive items of ``text`` from a random start (one draw from ``rng``)."""
    start = rng.randrange(0, len(text) - length + 1)
    return list(text[start:start + length])


def hide_needle(haystack: Sequence[T], needle: Sequence[T], at: int, question: Sequence[T] = ()) -> list[T]:
    """A pass-key probe: ``haystack`` with ``needle`` inserted before its item ``at``, then ``question``.

    The items are tokens or sentences alike; where the needle sits is the caller's choice (a depth
    into the haystack, or a distance back from the question).
    """
    if not 0 <= at <= len(haystack):
        raise ValueError(f"needle position {at} is outside the {len(haystack)}-item haystack")
    return [*haystack[:at], *needle, *haystack[at:], *question]


__all__ = ["PASSKEY_QUESTION", "draw_passkey", "haystack_slice", "hide_needle", "passkey_sentence"]
