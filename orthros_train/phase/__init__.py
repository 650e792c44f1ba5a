"""Phase layouts: which tokens form the base stream and which get an output token."""

from orthros_train.phase.builders import (
    decode_layout,
    positions_layout,
    prefill_layout,
    pretrain_layout,
    rl_layout,
    sft_layout,
)
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout, concat_layouts

__all__ = [
    "IGNORE_INDEX",
    "OrthrosLayout",
    "concat_layouts",
    "decode_layout",
    "positions_layout",
    "prefill_layout",
    "pretrain_layout",
    "rl_layout",
    "sft_layout",
]
