"""Expert parallelism (docs/parallel.md): the mixture of experts with megatron-core's dispatcher
and experts over 2 CPU ranks (gloo) against one rank, checkpoints across EP sizes, resume after
kill -9, and the layouts that are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import (
    LAUNCH_DIR,
    QUIET_RUN,
    SMALL_TINY_CPU,
    by_step,
    cli_env,
    compose_recipe,
    finish,
    kill_tree,
    result_of,
    start_train,
    tiny_config,
    torchrun,
    wait_for_step,
    wait_until,
)
from safetensors.torch import load_file

from orthros_train.errors import UserError
from orthros_train.model import OrthrosConfig
from orthros_train.parallel.setup import ParallelConfig, check_parallel_layout

TOL = 1e-5  # the tensor-parallel tests' bound

# moe_tiny_cpu at test size (8 experts, top-2, tied routing, router loss in the training loss):
# micro batches of one sequence and 2 per step, so one rank (2 accumulation steps) and two (1 each)
# run the very same micro batches. The router losses are per forward pass (transformers'
# definition), so a micro batch of other sequences would change them, not a bug in the split.
MOE_RUN = (
    *SMALL_TINY_CPU, *QUIET_RUN, "model.moe_intermediate_size=32", "model.sliding_window=16",
    "trainer.micro_batch_size=1", "trainer.global_batch_size=2", "optim.warmup_steps=2",
    "trainer.max_steps=8", "trainer.save_every=3",
)  # fmt: skip
EP2 = ("parallel.expert_parallel=2",)
ZERO1 = ("parallel.zero_stage=1",)


def start_moe_run(*overrides: str, cwd: Path, nproc: int = 1) -> subprocess.Popen:
    return start_train("--config-name", "moe_tiny_cpu", *MOE_RUN, *overrides, cwd=cwd, nproc=nproc)


def finished_run(run: Path, *overrides: str, nproc: int = 1) -> Path:
    rc, _, err = finish(start_moe_run(*overrides, f"trainer.run_dir={run}", cwd=run.parent, nproc=nproc))
    assert rc == 0, err[-4000:]
    return run


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "final" / "model.safetensors")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory) -> Path:
    """The reference: moe_tiny_cpu on one process, 8 steps, a checkpoint every 3."""
    return finished_run(tmp_path_factory.mktemp("ep1") / "run")


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory) -> Path:
    """The same run through the launcher users run: 2 ranks, parallel.expert_parallel=2 (the
    recipe's ZeRO-0: DeepSpeed reduces the experts over their expert-data-parallel group)."""
    run = tmp_path_factory.mktemp("ep2") / "run"
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "2", "moe_tiny_cpu", *MOE_RUN, *EP2, f"trainer.run_dir={run}"],
        capture_output=True, text=True, timeout=900, cwd=run.parent, env=cli_env(PYTHON=sys.executable),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def ep2_zero1_run(tmp_path_factory) -> Path:
    """EP = 2 under ZeRO-1 (what the large recipes run): the experts' fp32 masters and moments are
    partitioned over their expert-data-parallel group."""
    return finished_run(tmp_path_factory.mktemp("ep2z1") / "run", *EP2, *ZERO1, nproc=2)


@pytest.mark.slow
def test_expert_parallel_forward_backward_and_steps_equal_reference():
    """EP = 2, TP = 2 + SP with EP = 2 (every routing policy) and TP = 2 + SP with EP = 1, pretrain
    and sft layouts: logits, loss, router loss and gradients equal the one-device model; three
    clipped AdamW steps through DeepSpeed (EP = 2 under ZeRO 0/1/2, TP = 2 + SP + EP = 2 under
    ZeRO-1) equal one process, weights and gradient norms."""
    results = result_of(torchrun("ep_equivalence"))
    assert len(results) == (1 + 3 + 1) * 2 + 5, sorted(results)
    for variant, errs in results.items():
        for what, err in errs.items():
            assert err <= TOL, (variant, what, err)


@pytest.mark.slow
def test_ep2_and_tp2_sp_ep2_launches_train_the_one_rank_losses(one_rank_run, ep2_run, tmp_path):
    tp2 = finished_run(
        tmp_path / "tp2", *EP2, "parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
        "trainer.max_steps=3", "trainer.save_every=0", nproc=2,
    )  # fmt: skip
    ref = by_step(one_rank_run)
    assert sorted(ref) == list(range(1, 9))
    for name, run in {"ep2": ep2_run, "tp2-sp-ep2": tp2}.items():
        got = by_step(run)
        diff = max(abs(ref[s] - got[s]) for s in got)
        print(f"{name}: max loss difference to one rank {diff:.2e} over {len(got)} steps")
        assert diff <= TOL, (name, ref, got)
        router = by_step(run, "router_loss")
        assert all(router[s] > 0 for s in router)  # the router losses are part of what is compared


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["ep2->ep1", "ep1->ep2", "ep2-zero1->ep1-zero2"])
def test_checkpoint_reshards_across_expert_parallel_sizes(request, tmp_path, direction):
    """A checkpoint saved at EP = 2 resumes at EP = 1 and the reverse (ZeRO-0, the recipe's), and
    one of EP = 2 under ZeRO-1 resumes at EP = 1 under ZeRO-2: the steps after it and the final
    weights equal the uninterrupted run's."""
    straight, nproc, overrides = {
        "ep2->ep1": ("ep2_run", 1, ()),
        "ep1->ep2": ("one_rank_run", 2, EP2),
        "ep2-zero1->ep1-zero2": ("ep2_zero1_run", 1, ("parallel.zero_stage=2",)),
    }[direction]
    straight = request.getfixturevalue(straight)
    ckpt = straight / "checkpoints" / "step_000000003"
    resumed = tmp_path / "resumed"
    rc, out, err = finish(
        start_moe_run(*overrides, f"trainer.resume={ckpt}", f"trainer.run_dir={resumed}", cwd=tmp_path, nproc=nproc)
    )
    assert rc == 0, err[-4000:]
    assert "resumed from" in out and "resharded" in out + err, out[-2000:] + err[-2000:]
    a, b = by_step(straight), by_step(resumed)
    assert sorted(b) == [4, 5, 6, 7, 8]
    loss_diff = max(abs(a[s] - b[s]) for s in b)
    weight_diff = max_diff(final_weights(straight), final_weights(resumed))
    print(f"{direction}: losses {loss_diff:.2e}, final weights {weight_diff:.2e}")
    assert loss_diff <= TOL and weight_diff <= TOL, (a, b, weight_diff)


@pytest.mark.slow
def test_kill_9_expert_parallel_run_resumes_bitwise(ep2_zero1_run, tmp_path):
    """EP = 2 under ZeRO-1 killed after its first checkpoint: the resumed run's losses and final
    weights are the uninterrupted run's, bit for bit."""
    run = tmp_path / "killed"
    proc = start_moe_run(*EP2, *ZERO1, f"trainer.run_dir={run}", cwd=tmp_path, nproc=2)
    wait_for_step(run, 4, proc)  # the checkpoint of step 3 exists once step 4 is logged
    wait_until((run / "checkpoints" / "latest").is_file, proc, 600, "no checkpoint published")
    kill_tree(proc.pid)  # kill -9 the launcher and both ranks
    proc.wait()
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_000000003", "step_000000006")
    rc, out, err = finish(start_moe_run(*EP2, *ZERO1, f"trainer.run_dir={run}", cwd=tmp_path, nproc=2))
    assert rc == 0, err[-4000:]
    assert "resumed from" in out and latest in out, out[-3000:] + err[-3000:]
    straight, resumed = by_step(ep2_zero1_run), by_step(run)
    assert sorted(straight) == sorted(resumed) == list(range(1, 9))
    assert all(straight[s] == resumed[s] for s in straight), (straight, resumed)  # bitwise
    assert max_diff(final_weights(ep2_zero1_run), final_weights(run)) == 0.0


# -- what is refused --------------------------------------------------------------------------------

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(
    "pcfg, world, message",
    [
        (ParallelConfig(expert_parallel=3), 3, "model.num_experts=8 is not divisible by parallel.expert_parallel=3"),
        (ParallelConfig(expert_parallel=4), 2, "world size 2 is not divisible by parallel.expert_parallel=4"),
        (ParallelConfig(tensor_parallel=2, expert_parallel=2), 2, "needs parallel.sequence_parallel=true"),
        (ParallelConfig(expert_parallel=2, zero_stage=3), 2, "parallel.zero_stage=3 with experts split"),
        (ParallelConfig(expert_parallel=2, context_parallel=2), 4, "parallel.context_parallel=2 is not supported"),
    ],
)
def test_impossible_expert_layout_names_the_key(pcfg, world, message):
    with pytest.raises(UserError, match=message):
        check_parallel_layout(pcfg, tiny_config(64, **MOE), world)


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(UserError, match=r"parallel.expert_parallel=2 but the model is dense \(model.num_experts=0\)"):
        check_parallel_layout(ParallelConfig(expert_parallel=2), tiny_config(64), 2)


def test_top_k_above_the_experts_names_the_key():
    with pytest.raises(UserError, match="num_experts_per_tok must be an integer in 1..num_experts=8, got 9"):
        OrthrosConfig(**{**tiny_config(64).to_dict(), **MOE, "num_experts_per_tok": 9})


def test_recipe_with_an_impossible_expert_layout_stops_at_its_config():
    """The recipe's config refuses it, before any process group or model exists (a dry run too)."""
    with pytest.raises(UserError, match="model.num_experts=8 is not divisible by parallel.expert_parallel=3"):
        compose_recipe("moe_tiny_cpu", "parallel.expert_parallel=3", "trainer.global_batch_size=null", world_size=3)
    with pytest.raises(UserError, match="world size 2 is not divisible by parallel.expert_parallel=4"):
        compose_recipe("moe_tiny_cpu", "parallel.expert_parallel=4", world_size=2)
    with pytest.raises(UserError, match="parallel.expert_parallel=2 but the model is dense"):
        compose_recipe("tiny_cpu", "parallel.expert_parallel=2", world_size=2)
    with pytest.raises(UserError, match="trainer.precision=bf16 with parallel.zero_stage=0 and experts split"):
        compose_recipe("moe_tiny_cpu", "parallel.expert_parallel=2", "trainer.precision=bf16", world_size=2)
    compose_recipe("moe_tiny_cpu", "parallel.expert_parallel=2", "trainer.precision=bf16", "parallel.zero_stage=1",
                   world_size=2)  # fmt: skip


def test_rl_with_expert_parallelism_is_refused():
    with pytest.raises(UserError, match="rl with parallel.expert_parallel=2 is not supported"):
        compose_recipe("rl_tiny_cpu", "parallel.expert_parallel=2", "+model.num_experts=4", world_size=2)
