"""Recipe sections are typed by their dataclasses: wrong types and unknown keys fail at load,
naming the full key, the value and the expected type."""

from __future__ import annotations

import pytest
from fixtures import compose_recipe

from orthros_train.errors import UserError
from orthros_train.parallel.setup import ParallelConfig
from orthros_train.train.config import RLConfig, TrainerConfig, resolve_batch_geometry


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=5.5", "trainer.max_steps=5.5: expected int"),
        ("trainer.max_steps=five", "trainer.max_steps='five': expected int"),
        ("trainer.dry_run=maybe", "trainer.dry_run='maybe': expected a boolean, true or false"),
        ("trainer.dry_run=yes", "trainer.dry_run='yes': expected a boolean"),
        ("trainer.dry_run=1", "trainer.dry_run=1: expected a boolean"),
        ("trainer.wandb.enabled=0", "trainer.wandb.enabled=0: expected a boolean"),
        ("optim.lr=fast", "optim.lr='fast': expected float"),
        ("parallel.tensor_parallel=2.0", "parallel.tensor_parallel=2.0: expected int"),
        ("model.num_key_value_heads=two", "model.num_key_value_heads='two': expected int or null"),
        ("trainer.seq_len_schedule=[[0,x]]", "trainer.seq_len_schedule[0]=[0, 'x']: expected list[list[int]] or null"),
        ("+trainer.max_step=3", "unknown key trainer.max_step"),
        ("+data.pathz=[a]", "unknown key data.pathz"),
    ],
)
def test_a_wrong_type_or_unknown_key_names_key_value_and_type(override, message):
    with pytest.raises(UserError) as err:
        compose_recipe("tiny_cpu", override)
    assert message in str(err.value)


def test_well_typed_values_are_converted_where_lossless():
    cfg = compose_recipe(
        "tiny_cpu", "optim.lr=1", "trainer.dry_run=true", "trainer.max_steps=7", "trainer.wandb.name=3"
    )
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.trainer.dry_run is True and cfg.trainer.max_steps == 7
    assert cfg.trainer.wandb.name == "3"
    assert cfg.trainer.wandb.enabled is True


# -- batch geometry from the world size -----------------------------------------------------------


def _geometry(world: int | None, rl: RLConfig | None = None, **kw):
    parallel = {k: kw.pop(k) for k in ("tensor_parallel", "context_parallel", "data_parallel") if k in kw}
    return resolve_batch_geometry(TrainerConfig(**kw), ParallelConfig(**parallel), world, rl)


@pytest.mark.parametrize(
    ("world", "layout", "dp", "accum"),
    [(1, {}, 1, 16), (2, {}, 2, 8), (8, {}, 8, 2), (16, {}, 16, 1), (8, {"tensor_parallel": 2}, 4, 4),
     (16, {"tensor_parallel": 2, "context_parallel": 2}, 4, 4)],
)  # fmt: skip
def test_data_parallel_and_accumulation_follow_the_world_size(world, layout, dp, accum):
    g = _geometry(world, global_batch_size=64, micro_batch_size=4, **layout)
    assert (g.data_parallel, g.grad_accum_steps, g.global_batch_size, g.world_size) == (dp, accum, 64, world)


def test_the_recipe_plans_for_its_world_size_and_a_launch_follows_its_own():
    planned = compose_recipe("pretrain_1p3b")  # a dry run: the parallel group's 8 GPUs
    assert (planned.parallel.world_size, planned.parallel.data_parallel, planned.trainer.grad_accum_steps) == (8, 8, 16)
    two_nodes = compose_recipe("pretrain_1p3b", world_size=16)
    assert (two_nodes.parallel.data_parallel, two_nodes.trainer.grad_accum_steps) == (16, 8)
    assert planned.tokens_per_step == two_nodes.tokens_per_step == 4096 * 256
    dry = compose_recipe("pretrain_1p3b", "parallel.world_size=32")  # trainer.dry_run=true parallel.world_size=32
    assert (dry.parallel.data_parallel, dry.trainer.grad_accum_steps) == (32, 4)
    tiny_on_two, tiny_planned = compose_recipe("tiny_cpu", world_size=2), compose_recipe("tiny_cpu")
    assert tiny_on_two.trainer.grad_accum_steps == 1 and tiny_planned.trainer.grad_accum_steps == 2


def test_rl_derives_its_global_batch_from_the_rollouts_per_step():
    rl = RLConfig(group_size=8, prompts_per_step=8)
    assert _geometry(1, rl, micro_batch_size=32).grad_accum_steps == 2
    assert _geometry(2, rl, micro_batch_size=32).grad_accum_steps == 1
    with pytest.raises(UserError, match=r"global_batch_size=32, but an RL step trains on .* = 64 rollouts"):
        _geometry(1, rl, micro_batch_size=32, global_batch_size=32)


def test_without_a_global_batch_it_grows_with_the_data_parallel_size():
    g = _geometry(4, micro_batch_size=2, grad_accum_steps=3)
    assert (g.data_parallel, g.grad_accum_steps, g.global_batch_size) == (4, 3, 24)


@pytest.mark.parametrize(
    ("world", "kw", "message"),
    [
        (2, dict(global_batch_size=100, micro_batch_size=8),
         "trainer.global_batch_size=100 (sequences per step) do not split into micro batches of "
         "trainer.micro_batch_size=8 on 2 data-parallel rank(s) "
         "(world size 2 / (parallel.tensor_parallel=1 x parallel.context_parallel=1)): "
         "100 / (8 x 2) = 6.25 accumulation steps. Nearest valid: trainer.global_batch_size=96 or 112; "
         "trainer.micro_batch_size=5 or 10"),
        (16, dict(global_batch_size=8, micro_batch_size=4),
         "8 / (4 x 16) = 0.125 accumulation steps (0.5 sequences per rank). Nearest valid: "
         "trainer.global_batch_size=64; a world size of 2"),
        (3, dict(global_batch_size=8, micro_batch_size=4, tensor_parallel=2),
         "world size 3 is not divisible by parallel.tensor_parallel=2 x parallel.context_parallel=1 = 2: "
         "use a world size of 2 or 4"),
        (2, dict(global_batch_size=8, micro_batch_size=4, data_parallel=4),
         "world size 2 / (parallel.tensor_parallel=1 x parallel.context_parallel=1) = 2 data-parallel ranks, but "
         "parallel.data_parallel=4: leave parallel.data_parallel unset (null)"),
        (1, dict(global_batch_size=8, micro_batch_size=4, grad_accum_steps=1),
         "trainer.grad_accum_steps=1, but trainer.global_batch_size=8 / (trainer.micro_batch_size=4 x 1 data-parallel "
         "ranks) = 2: leave trainer.grad_accum_steps unset (null)"),
    ],
)  # fmt: skip
def test_an_impossible_geometry_names_the_numbers_and_the_nearest_valid_choices(world, kw, message):
    with pytest.raises(UserError) as err:
        _geometry(world, **kw)
    assert message in str(err.value)


def test_an_explicit_data_parallel_that_matches_is_accepted():
    assert compose_recipe("tiny_cpu", "parallel.data_parallel=2", world_size=2).parallel.data_parallel == 2
    with pytest.raises(UserError, match="parallel.data_parallel=2"):
        compose_recipe("tiny_cpu", "parallel.data_parallel=2", world_size=1)


def test_the_documented_seq_len_schedule_override_works_as_written():
    cfg = compose_recipe("tiny_cpu", "trainer.seq_len_schedule=[[0,128],[5,256]]")  # README's form, no '+'
    assert cfg.trainer.seq_len_schedule == [[0, 128], [5, 256]]
