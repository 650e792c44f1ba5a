"""The loss of a step is one mean over its whole global batch: gradients and the logged loss do
not depend on micro_batch_size x grad_accum_steps or the data- or context-parallel size, and
equal a direct computation on the whole batch (SFT and RL rows with very different answer
lengths)."""

from __future__ import annotations

import pytest
import torch
from fixtures import torchrun
from parallel_scripts import global_loss

CASES = [(kind, average) for kind in ("sft", "rl") for average in ("token", "sequence")]


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over all gradient tensors together (L2)."""
    assert a.keys() == b.keys() and a
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    norm = sum(float(b[n].double().pow(2).sum()) for n in b)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    from orthros_train.parallel.setup import destroy_parallel

    run = str(tmp_path_factory.mktemp("global_loss") / "run")
    try:
        return {
            (micro, accum): global_loss.measure(run, micro, accum) for micro, accum in ((8, 1), (2, 4), (1, 8))
        } | {"per_micro_batch": global_loss.measure(run, 2, 4, per_micro_batch=True)}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_step_gradient_and_loss_do_not_depend_on_micro_batching(splits, case):
    whole = splits[(8, 1)][case]
    # the whole batch in one micro batch equals the loss written out directly (float64)
    assert whole["loss"] == pytest.approx(whole["direct_loss"], rel=1e-6)
    assert relative(whole["grads"], whole["direct_grads"]) <= 1e-6
    for split in ((2, 4), (1, 8)):
        got = splits[split][case]
        assert got["loss"] == pytest.approx(whole["loss"], rel=1e-6), split
        assert relative(got["grads"], whole["grads"]) <= 1e-6, split


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_per_micro_batch_averaging_depends_on_the_split(splits, case):
    """What the trainer used to do: each micro batch averaged by itself, the averages averaged."""
    old, whole = splits["per_micro_batch"][case], splits[(8, 1)][case]
    if case == ("rl", "sequence"):  # one response per row, 2 rows per micro batch: equal shares
        assert relative(old["grads"], whole["grads"]) <= 1e-6
        return
    assert relative(old["grads"], whole["grads"]) > 1e-2
    assert abs(old["loss"] - whole["loss"]) > 1e-4 * abs(whole["loss"])


@pytest.mark.slow
def test_two_data_or_context_parallel_ranks_equal_one(splits, tmp_path):
    """torchrun, gloo: DP = 2 (each rank reads half of the batch) and CP = 2 (both ranks read it
    all and split every sequence); same gradients and loss. The DP splits share one launch."""
    launches = {"dp2": ["4:1", "1:4"], "cp2": ["2:4", "--context-parallel", "2"]}
    for name, args in launches.items():
        out = tmp_path / f"{name}.pt"
        proc = torchrun("global_loss", str(out), *args, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        by_split = torch.load(out, weights_only=False)
        assert len(by_split) == (2 if name == "dp2" else 1)
        for (micro, accum), measured in by_split.items():
            for case in CASES:
                whole = splits[(8, 1)][case]
                assert measured[case]["loss"] == pytest.approx(whole["loss"], rel=1e-6), (name, micro, accum, case)
                assert relative(measured[case]["grads"], whole["grads"]) <= 1e-6, (name, micro, accum, case)
