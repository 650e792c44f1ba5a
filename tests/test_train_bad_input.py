"""Bad input at the trainer's door: no recipe, a model smaller than the data's vocabulary, a
truncated ``model.init_from``. Each is refused naming the key or file and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures import TINY_SHAPE, run_train, tiny_model

from orthros_train.errors import UserError

# One layer on the embedded corpus's 2048-token vocabulary: the model of the recipe below and of
# the truncated checkpoints.
ONE_LAYER = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 8}


def _recipe(tmp_path: Path, **model) -> dict:
    return {
        "model": {"vocab_size": 2048, **TINY_SHAPE, **ONE_LAYER, "init_from": None, **model},
        "data": {"source": "embedded", "corpus": "paul_graham", "tokenizer_vocab_size": 2048,
                 "cache_dir": str(Path("~/.cache/orthros_train").expanduser())},
        "trainer": {"max_steps": 1, "run_dir": str(tmp_path / "run"), "device": "cpu", "log_every": 0,
                    "seed": 0, "eval_every": 0, "micro_batch_size": 1, "seq_len": 32, "progress": False,
                    "wandb": {"enabled": False}},
        "parallel": {"zero_stage": 0},
    }


def _trainer(recipe: dict):
    from orthros_train.parallel.setup import destroy_parallel
    from orthros_train.train.config import run_config_from_dict
    from orthros_train.train.trainer import Trainer

    try:
        return Trainer(run_config_from_dict(recipe), recipe)
    finally:
        destroy_parallel()


@pytest.mark.parametrize("argv", [["trainer.max_steps=1"], ["+trainer.max_steps=1", "+trainer.dry_run=true"]])
def test_overrides_without_a_recipe_are_refused(monkeypatch, capsys, argv):
    """Hydra's `+key` advice would otherwise train the dataclass defaults (a 32000-token model)."""
    from orthros_train.train import cli

    monkeypatch.setattr(sys, "argv", ["orthros-train", *argv])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    message = str(exc.value.code)
    assert "need a recipe" in message and "--config-name RECIPE" in message and "tiny_cpu" in message


def test_a_model_smaller_than_the_datas_vocabulary_names_both_keys(tmp_path):
    with pytest.raises(UserError, match=r"2048 tokens \(data.tokenizer_vocab_size=2048\) but model.vocab_size "
                                         r"is 1000.*set model.vocab_size=2048"):
        _trainer(_recipe(tmp_path, vocab_size=1000))


def _truncated_checkpoint(directory: Path, keep: float) -> Path:
    model = tiny_model(2048, **ONE_LAYER)
    model.save_pretrained(directory)
    weights = next(directory.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])  # an interrupted copy
    return weights


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
def test_lazy_checkpoint_names_a_truncated_file(tmp_path, keep):
    from orthros_train.common.safetensors_io import SafetensorsFileError, SafetensorsReader

    weights = _truncated_checkpoint(tmp_path / "ckpt", keep)
    with pytest.raises(SafetensorsFileError, match=rf"{weights.name} \(.* bytes\) is not a readable safetensors file.*"
                                                  "truncated or corrupt.*copy it again"):
        SafetensorsReader(tmp_path / "ckpt")


def test_truncated_init_from_is_a_clear_error_at_the_command_line(tmp_path):
    weights = _truncated_checkpoint(tmp_path / "ckpt", 0.5)
    proc = run_train(
        "--config-name", "tiny_cpu", f"model.init_from={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.max_steps=1", "trainer.progress=false", "trainer.wandb.enabled=false", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"model.init_from={tmp_path / 'ckpt'}" in proc.stderr and str(weights) in proc.stderr
    assert "truncated or corrupt" in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_safetensors_inside_the_file_is_still_refused_with_the_file(tmp_path):
    """A file whose header is intact but whose data stops early (the size check of safetensors)."""
    from orthros_train.common.safetensors_io import SafetensorsFileError, SafetensorsReader

    tensors = {"embed_tokens.weight": torch.ones(64, 8)}
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir()
    safetensors.torch.save_file(tensors, path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(SafetensorsFileError, match="model.safetensors"):
        SafetensorsReader(path.parent)


def test_a_cpu_model_whose_state_cannot_fit_the_machine_is_refused(monkeypatch):
    from fixtures import compose_recipe

    import orthros_train.train.build as build

    monkeypatch.setattr(build, "host_memory_gib", lambda: 8.0)
    build.check_host_memory_fit(compose_recipe("tiny_cpu"))  # a few MiB: passes
    huge = compose_recipe("tiny_cpu", "model.vocab_size=4000000000")  # a typo's worth of rows
    with pytest.raises(build.UserError, match=r"need ~[\d,.]+ GiB per process, and this machine has 8.0 GiB.*"
                                              r"vocab_size=4000000000"):  # fmt: skip
        build.check_host_memory_fit(huge)
