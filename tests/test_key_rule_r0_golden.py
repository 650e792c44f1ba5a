"""``base_global_tail = 0`` is bitwise the model as it was before the global tail existed.

``data/key_rule_r0_golden.safetensors`` holds the logits of fixed inputs (a full forward, a packed
SFT layout, a chunked prefill and three decode steps; 0 and 2 sink tokens; the reference, SDPA and
Triton backends) computed by the code before the key rule moved to ``ops/keys.py`` and the tail
was added. Any change to the paper's layer (or to the sinks) shows here as a bit that moved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import tiny_model
from safetensors.torch import load_file

GOLDEN = Path(__file__).parent / "data" / "key_rule_r0_golden.safetensors"


def _logits(sinks: int, backend: str) -> dict[str, torch.Tensor]:
    from orthros_train.infer.generate import decode, prefill
    from orthros_train.phase.builders import positions_layout, sft_layout

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    m = tiny_model(sliding_window=8, sink_tokens=sinks, output_affine="resampled", attention_backend=backend)
    if backend != "triton":
        m = m.double()
    out = {"forward": m.forward_layout(positions_layout(ids)).logits}
    lay = sft_layout([ids[0], ids[1, :30]], [[(20, 30)], [(5, 9), (18, 25)]])
    out["sft"] = m.forward_layout(lay).logits
    logits, cache = prefill(m, [ids[0, :33], ids[1, :21]], chunk_size=7)
    steps = [logits]
    for _ in range(3):
        steps.append(decode(m, steps[-1].argmax(-1), cache))
    out["generate"] = torch.stack(steps)
    return {k: v.float().detach() for k, v in out.items()}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_zero_tail_is_bitwise_the_previous_model(sinks, backend):
    golden = load_file(GOLDEN)
    with torch.no_grad():
        got = _logits(sinks, backend)
    for part, value in got.items():
        want = golden[f"s{sinks}_{backend}_{part}"]
        assert torch.equal(value, want), (part, (value - want).abs().max())
