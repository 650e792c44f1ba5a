"""Tensor/sequence parallelism and ZeRO against the single-device model (CPU, gloo, 2 ranks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fixtures import (
    LAUNCH_DIR,
    PARALLEL_TEST_RUN,
    QUIET_RUN,
    cli_env,
    metrics,
    result_of,
    run_train,
    tiny_config,
    torchrun,
)

from orthros_train.errors import UserError
from orthros_train.parallel.setup import ParallelConfig, check_parallel_layout


@pytest.mark.slow
def test_tensor_and_sequence_parallel_equal_reference():
    results = result_of(torchrun("tp_equivalence"))
    assert set(results) == {"tp-orthros", "sp-orthros", "sp-dense"}
    for variant, errs in results.items():
        for what, err in errs.items():
            assert err <= 1e-5, (variant, what, err)


@pytest.mark.slow
@pytest.mark.parametrize("tp, recompute", [(1, "none"), (1, "full")])
def test_context_parallel_cp2_equals_reference(tp, recompute):
    """CP=2 on 2 ranks: logits, loss and gradients equal the single-device model for pretrain and
    sft layouts whose documents and windows cross the chunk boundaries, one window longer than a
    chunk, for orthros and both baselines (the second case with full-layer recompute)."""
    results = result_of(torchrun("cp_equivalence", str(tp), recompute))
    assert len(results) == 8
    for variant, errs in results.items():
        for what, err in errs.items():
            assert err <= 1e-5, (variant, what, err)


@pytest.mark.slow
def test_context_parallel_with_tp_sp_and_selective_recompute():
    """TP=2+SP x CP=2 on 4 ranks with selective (attention) recompute equals the reference."""
    proc = torchrun("cp_equivalence", "2", "selective", nproc=4)
    for variant, errs in result_of(proc).items():
        for what, err in errs.items():
            assert err <= 1e-5, (variant, what, err)


@pytest.mark.slow
def test_zero_stages_equal_single_process():
    results = result_of(torchrun("zero_equivalence"))
    assert set(results) == {"zero0", "zero1", "zero2", "zero3", "zero2_offload"}
    for stage, err in results.items():
        assert err <= 1e-5, (stage, err)


@pytest.mark.slow
def test_trainer_tp2_sp_and_cp2_losses_equal_tp1(tp2_sp_launch, tmp_path):
    """The real CLI: TP=2+SP (conftest's tp2_sp_launch) and CP=2 (ZeRO-1 over the data x context
    group) runs under torchrun log the same losses as a one-process run."""
    small = [*PARALLEL_TEST_RUN, *QUIET_RUN]
    single = run_train("--config-name", "tiny_cpu", *small, f"trainer.run_dir={tmp_path / 'tp1'}", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-4000:]
    tp2, tp2_run = tp2_sp_launch
    assert tp2.returncode == 0, ("tp2", tp2.stderr[-4000:])
    # Through the launcher users run (launch/torchrun.sh): 2 CPU ranks with gloo.
    cp2 = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "2", "tiny_cpu", *small, f"trainer.run_dir={tmp_path / 'cp2'}",
         "parallel.context_parallel=2", "parallel.zero_stage=1"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=cli_env(PYTHON=sys.executable),
    )  # fmt: skip
    assert cp2.returncode == 0, ("cp2", cp2.stderr[-4000:])

    a = [r["loss"] for r in metrics(tmp_path / "tp1")]
    assert len(a) == 3
    for run, run_dir in {"tp2": tp2_run, "cp2": tmp_path / "cp2"}.items():
        b = [r["loss"] for r in metrics(run_dir)]
        assert len(b) == 3
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (run, a, b)


# 8 heads: the numbers a layout check names (heads per TP rank) are not the tiny model's 4 and 2.
EIGHT_HEADS = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8, "intermediate_size": 96}


@pytest.mark.parametrize(
    "pcfg, world, message",
    [
        (ParallelConfig(tensor_parallel=3), 3, "num_attention_heads=8 is not divisible by parallel.tensor_parallel=3"),
        (ParallelConfig(tensor_parallel=2, data_parallel=2), 3, "world size 3 is not divisible"),
        (ParallelConfig(tensor_parallel=2, data_parallel=4), 4, "parallel.data_parallel=4"),
    ],
)
def test_impossible_layout_names_the_numbers(pcfg, world, message):
    cfg = tiny_config(96, **EIGHT_HEADS, num_key_value_heads=4)
    with pytest.raises(UserError, match=message):
        check_parallel_layout(pcfg, cfg, world)


def test_kv_heads_must_split_too():
    cfg = tiny_config(96, **EIGHT_HEADS, num_key_value_heads=2)
    with pytest.raises(UserError, match="num_key_value_heads=2"):
        check_parallel_layout(ParallelConfig(tensor_parallel=4), cfg)


def test_parallel_config_rejects_bad_values():
    with pytest.raises(UserError, match="zero_stage"):
        ParallelConfig(zero_stage=4)
    with pytest.raises(UserError, match="offload_optimizer"):
        ParallelConfig(zero_stage=0, offload_optimizer=True)


def test_parallel_model_is_the_model_built_from_shards(tmp_path):
    """In one process (TP = 1): the parallel build is an ``OrthrosForCausalLM`` with the reference
    parameter names, its seeded init is the reference rule drawn in reference order, it computes
    the same logits/loss, and loading reference weights names the missing or foreign tensor."""
    import torch

    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import DistributedEnv, destroy_parallel, init_parallel
    from orthros_train.parallel.state_dict import load_reference_shards, reference_shapes
    from orthros_train.phase import sft_layout

    cfg = tiny_config(64, sliding_window=4, qk_norm=True)
    init_parallel(ParallelConfig(backend="gloo"), cfg, DistributedEnv())
    try:
        model = build_parallel_model(cfg, ParallelConfig(), seed=7)
        assert isinstance(model, OrthrosForCausalLM)
        assert [n for n, _ in model.named_parameters()] == list(reference_shapes(cfg))
        ref = OrthrosForCausalLM(cfg)
        ref.reset_parameters(torch.Generator().manual_seed(7))
        for name, p in model.named_parameters():
            assert torch.equal(p, dict(ref.named_parameters())[name]), name
        ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
        layout = sft_layout(ids, [[(2, 6)], [(5, 11)]])
        out, want = model.forward_layout(layout), ref.forward_layout(layout)
        assert (out.logits - want.logits).abs().max() <= 1e-6
        assert abs(float(out.loss) - float(want.loss)) <= 1e-6
        state = ref.state_dict()
        blank = build_parallel_model(cfg, ParallelConfig(), seed=None)  # weights left to the loader
        load_reference_shards(blank, state, cfg)
        assert all(torch.equal(p, state[n]) for n, p in blank.named_parameters())
        with pytest.raises(UserError, match="lack 'norm.weight'"):
            load_reference_shards(model, {k: v for k, v in state.items() if k != "norm.weight"}, cfg)
        with pytest.raises(UserError, match="layers.9.mlp.up_proj.weight"):
            load_reference_shards(model, {**state, "layers.9.mlp.up_proj.weight": state["norm.weight"]}, cfg)
    finally:
        destroy_parallel()
