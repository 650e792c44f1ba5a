"""Quiet by default: known third-party warnings filtered once, rank 0 speaks, errors reach the
user once, the tokenize bar has a total, --help lists the recipes."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest
from fixtures import LAUNCH_DIR, TRAIN_CLI, cli_env


def test_known_third_party_warnings_are_filtered_and_others_are_not():
    import orthros_train  # noqa: F401  (installs the filters)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        from orthros_train.third_party_warnings import filter_third_party_warnings

        filter_third_party_warnings()
        for message, category in [
            ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning),
            ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", UserWarning),
            ("`rope_scaling` is deprecated and will be removed in a future version.", FutureWarning),
            ("something else entirely", UserWarning),
        ]:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else entirely"]


def test_help_lists_the_recipes():
    proc = subprocess.run([*TRAIN_CLI, "--help"], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0
    for name in ("tiny_cpu", "pretrain_1p3b", "scaling/orthros_6p8b", "convert_llama31_8b", "longctx_128k"):
        assert f"  {name} " in proc.stdout
    assert "model/" not in proc.stdout and "trainer/gpu" not in proc.stdout  # groups are not recipes


def test_tokenize_progress_bar_has_a_total(plain_tokenizer_dir, tmp_path, capsys):
    import json

    from data_tools.cli import main as data_main

    tok = plain_tokenizer_dir
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"essay {i} on startups"}) + "\n" for i in range(7)))
    assert data_main(["tokenize", str(src), "--tokenizer", str(tok), "--output", str(tmp_path / "out")]) == 0
    bar = capsys.readouterr().err
    assert "7/7" in bar and "<" in bar  # n/total and elapsed<remaining


def _torchrun(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(LAUNCH_DIR / "torchrun.sh"), "2", "tiny_cpu", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=900, cwd=tmp_path)


@pytest.mark.slow
def test_two_rank_tp2_run_prints_a_handful_of_lines(tp2_sp_launch):
    proc, _ = tp2_sp_launch  # 3 steps, progress bar and wandb as a user has them (conftest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and "train:" not in ln]
    assert len(lines) <= 8, "\n".join(lines)
    assert not any("Warning" in ln for ln in lines), "\n".join(lines)


@pytest.mark.slow
def test_an_error_on_every_rank_is_printed_once(tmp_path):
    proc = _torchrun(tmp_path, "trainer.max_steps=five", f"trainer.run_dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    assert proc.stderr.count("trainer.max_steps='five': expected int") == 1, proc.stderr[-3000:]


def test_megatron_info_lines_are_hidden_after_configure_logging(capsys):
    """megatron-core is imported lazily, after Hydra put the root logger at INFO: its per-rank
    announcements (which FSDP path it picked) must not reach the console; its warnings must."""
    import logging

    from orthros_train.logging_setup import configure_logging

    root = logging.getLogger()
    handler = logging.StreamHandler()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        configure_logging(0)
        lib = logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
        lib.info("Detected Megatron Core, using Megatron-FSDP with Megatron.")
        lib.warning("a real megatron warning")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    err = capsys.readouterr().err
    assert "Detected Megatron Core" not in err
    assert "a real megatron warning" in err
