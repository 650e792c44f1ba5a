"""The trainer through its real command line: recipes dry-run, the tiny recipe learns."""

from __future__ import annotations

import json

import pytest
from fixtures import resolved_recipe, run_train

from orthros_train.train.cli import recipe_list

RECIPES = [name for name, _ in recipe_list()]  # what --config-name takes: recipes/*.yaml, scaling/, study/


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_dry_runs(recipe, tmp_path, monkeypatch, capsys):
    """In this process: the recipe composed with the override as the command line composes it, then
    the command line's own ``run`` prints the plan (a subprocess would spend ~9 s importing torch,
    megatron-core and DeepSpeed per recipe; the real command line dry-runs pretrain_1p3b below and
    the documented recipes in test_documented_commands)."""
    from omegaconf import OmegaConf

    from orthros_train.train.cli import run

    monkeypatch.chdir(tmp_path)  # as the command line ran: nothing a plan writes lands in the checkout
    run(OmegaConf.create(resolved_recipe(recipe, "trainer.dry_run=true", f"trainer.run_dir={tmp_path}")))
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.index("{") :])
    assert summary["parameters"] > 0 and summary["flops_per_token"] > 0
    assert summary["tokens_per_step"] > 0 and summary["total_steps"] > 0


def test_pretrain_1p3b_plan_is_the_usual_setting(tmp_path):
    proc = run_train("--config-name", "pretrain_1p3b", "trainer.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert 1.2e9 < summary["parameters"] < 1.5e9
    assert summary["sliding_window"] == 128 and summary["seq_len"] == 4096
    assert abs(summary["total_tokens"] - 100e9) / 100e9 < 0.01


def test_unknown_recipe_key_is_a_clear_error(tmp_path):
    proc = run_train("--config-name", "tiny_cpu", "+trainer.max_step=3", "trainer.dry_run=true", cwd=tmp_path)
    assert proc.returncode != 0
    assert "max_step" in proc.stderr and "trainer" in proc.stderr


def test_bad_model_value_is_a_clear_error(tmp_path):
    proc = run_train("--config-name", "tiny_cpu", "model.sliding_window=0", "trainer.dry_run=true", cwd=tmp_path)
    assert proc.returncode != 0
    assert "sliding_window" in proc.stderr


@pytest.mark.slow
def test_tiny_recipe_trains_and_loss_decreases(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "--config-name",
        "tiny_cpu",
        "trainer.max_steps=40",
        "trainer.eval_every=20",
        "trainer.progress=false",
        "trainer.sample_tokens=8",
        "optim.warmup_steps=5",
        "model.hidden_size=128",
        "model.num_hidden_layers=2",
        f"trainer.run_dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r)
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 0.5, (first, last)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert "continuation" in proc.stdout
    # The final checkpoint loads back into a model.
    from orthros_train.model import OrthrosForCausalLM

    model = OrthrosForCausalLM.from_pretrained(run_dir / "checkpoints" / "final")
    assert model.config.hidden_size == 128
    assert (run_dir / "wandb").is_dir()


def test_indexed_blend_example_override_trains_with_one_path(bpe_tokenizer_dir, tmp_path):
    """`data=indexed_blend data.paths=[x]` as the recipe's comment says: default weights fit any
    number of paths (null: blend by size)."""
    from data_tools.cli import main as data_main

    tok = bpe_tokenizer_dir(512, chat_template=False)
    src = tmp_path / "docs.jsonl"
    row = json.dumps({"text": "Startups are companies designed to grow fast. " * 30})
    src.write_text("\n".join([row] * 20))
    prefix = tmp_path / "data" / "essays"
    assert data_main(["tokenize", str(src), "--tokenizer", str(tok), "--output", str(prefix)]) == 0
    proc = run_train(
        "--config-name", "tiny_cpu", "data=indexed_blend", f"data.paths=[{prefix}]", "data.tokenizer_vocab_size=512",
        "data.split='90,10,0'", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.progress=false",
        "trainer.sample_prompt=null", "trainer.wandb.enabled=false", "model.hidden_size=64",
        "model.num_hidden_layers=1", "trainer.seq_len=64", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=null",
        f"trainer.run_dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_single_process_with_inherited_launcher_variables_takes_no_port(monkeypatch):
    """RANK/WORLD_SIZE=1/MASTER_PORT left in the environment (an in-process trainer sets them for
    DeepSpeed) must not make a one-process run rendezvous on that port: two such runs at once
    would both try to listen on it."""
    from orthros_train.train.cli import launcher_env

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "53487"}.items():
        monkeypatch.setenv(key, value)
    assert launcher_env().launched is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = launcher_env()
    assert env.launched is True and env.world_size == 2 and env.master_port == 53487


def test_missing_init_from_checkpoint_names_the_key_and_the_fix(tmp_path):
    proc = run_train(
        "--config-name", "tiny_cpu", f"model.init_from={tmp_path / 'nowhere'}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.max_steps=1", "trainer.progress=false", "trainer.wandb.enabled=false", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "model.init_from=" in proc.stderr and "does not exist" in proc.stderr and "init_from=null" in proc.stderr
    assert "Traceback" not in proc.stderr
