"""Recipe sections are typed by their dataclasses: wrong types and unknown keys fail at load,
naming the full key, the value and the expected type."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orthros_train.train.cli import RECIPES_DIR
from orthros_train.train.config import run_config_from_dict


def _load(*overrides: str):
    with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
        cfg = compose(config_name="tiny_cpu", overrides=["trainer.run_dir=unused", "trainer.wandb.name=x", *overrides])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return run_config_from_dict(resolved)


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
        ("+trainer.seq_len_schedule=[[0,x]]", "trainer.seq_len_schedule[0]=[0, 'x']: expected list[list[int]] or null"),
        ("+trainer.max_step=3", "unknown key trainer.max_step"),
        ("+data.pathz=[a]", "unknown key data.pathz"),
    ],
)
def test_a_wrong_type_or_unknown_key_names_key_value_and_type(override, message):
    with pytest.raises(ValueError) as err:
        _load(override)
    assert message in str(err.value)


def test_well_typed_values_are_converted_where_lossless():
    cfg = _load("optim.lr=1", "trainer.dry_run=true", "trainer.max_steps=7", "trainer.wandb.name=3")
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.trainer.dry_run is True and cfg.trainer.max_steps == 7
    assert cfg.trainer.wandb.name == "3"
    assert cfg.trainer.wandb.enabled is True
