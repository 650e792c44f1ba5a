"""The package's logits of prompts read at once, at every position: what an export's ``forward`` returns.

An exported model's ``forward(ids)`` reads ``ids`` as a prompt (``remote_code/modeling_orthros.py``):
with a global tail ``R`` the base queries of each row's last ``R`` tokens see the whole row, as in
the package's prefill. The package's own ``OrthrosForCausalLM.forward`` is the training view, with no
tail, so it differs from an export in the last ``R`` positions of a row longer than the window.
``verify`` and the tests compare an export against this function instead.
"""

from __future__ import annotations

import torch

from orthros_train.model import OrthrosForCausalLM
from orthros_train.ops.keys import prompt_tail_flags
from orthros_train.phase.builders import positions_layout


@torch.no_grad()
def prompt_logits(model: OrthrosForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of every position of the prompts ``input_ids [B, T]`` (unpadded rows),
    each read in one prefill: its last ``base_global_tail`` tokens have global base queries."""
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    b, t = ids.shape
    layout = positions_layout(ids)
    flags = prompt_tail_flags(t, 0, t, model.config.base_global_tail, device=ids.device)
    if flags is not None:
        layout.base_global = flags.repeat(b)
        layout.validate()  # counts the global tokens
    logits = model.forward_layout(layout.to(next(model.parameters()).device)).logits
    return logits.view(b, t, -1)
