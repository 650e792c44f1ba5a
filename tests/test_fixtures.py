"""The shared test helpers keep their promises: the xdist groups name tests that exist, and a
recipe composed here is the one the command line runs."""

from __future__ import annotations

import importlib

from fixtures import REPO, SHARED_FIXTURE_GROUPS, compose_recipe, resolved_recipe


def test_every_shared_fixture_group_names_an_existing_test():
    for key in SHARED_FIXTURE_GROUPS:
        path, _, test = key.partition("::")
        assert (REPO / path).is_file(), key
        if test:
            module = importlib.import_module(path.removeprefix("tests/").removesuffix(".py"))
            assert callable(getattr(module, test, None)), f"{key}: no such test (update SHARED_FIXTURE_GROUPS)"


def test_a_composed_recipe_names_what_hydra_would():
    """``${hydra:job.config_name}`` takes the recipe's name, as under ``orthros-train``."""
    resolved = resolved_recipe("tiny_cpu", "trainer.max_steps=3")
    assert resolved["trainer"]["run_dir"] == "runs/tiny_cpu" and resolved["trainer"]["wandb"]["name"] == "tiny_cpu"
    assert resolved["trainer"]["max_steps"] == 3 and "hydra" not in resolved
    assert compose_recipe("rl_tiny_cpu").rl is not None
