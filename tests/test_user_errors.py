"""User errors apart from bugs: only the project's own refusals (the UserError family) are one
line; a ValueError raised inside a library keeps its traceback and is reported as a bug. The
one-line messages name the key or the file and the fix: a JSONL record by file and line, a corrupt
tokenizer by its tokenizer.json."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO, cli_env, compose_recipe, tiny_model

from orthros_train.errors import UserError


def test_user_error_is_not_a_value_error():
    # a ValueError from torch or numpy must never be mistaken for the user's fault
    assert not issubclass(UserError, ValueError)


def test_typed_section_lets_a_library_value_error_through(monkeypatch):
    """The config layer turns the project's refusals into one line and nothing else: a ValueError
    raised inside numpy while a section is built propagates as itself, not as a UserError."""
    import numpy as np

    from orthros_train.model.config import OrthrosConfig

    def broken(self) -> None:
        np.zeros(-1)  # numpy's own ValueError: "negative dimensions are not allowed"

    monkeypatch.setattr(OrthrosConfig, "validate", broken)
    with pytest.raises(ValueError, match="negative dimensions") as err:
        compose_recipe("tiny_cpu")
    assert not isinstance(err.value, UserError)


def test_a_library_value_error_reaches_the_user_with_its_traceback(tmp_path):
    """End to end through orthros-train: the traceback and the bug report, exit 1, not one line."""
    code = (
        "import sys, numpy as np\n"
        "from orthros_train.model.config import OrthrosConfig\n"
        "OrthrosConfig.validate = lambda self: np.zeros(-1)\n"
        f"sys.argv = ['orthros-train', '--config-name', 'tiny_cpu', 'trainer.run_dir={tmp_path / 'run'}',"
        " 'trainer.dry_run=true']\n"
        "from orthros_train.train.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert "negative dimensions are not allowed" in proc.stderr
    assert "internal error (ValueError): this is a bug" in proc.stderr


def test_a_study_library_value_error_is_a_bug_not_a_refusal(tmp_path, capsys):
    from orthros_train.study.cli import run_owned

    def work() -> None:
        import numpy as np

        np.zeros(-1)

    assert run_owned("orthros-study", tmp_path / "out", "study", work) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error (ValueError)" in err


def _tokenize(capsys, *args: str) -> tuple[int, str]:
    """``orthros-data tokenize ARGS`` in this process: (exit status, stderr)."""
    from data_tools.cli import main

    capsys.readouterr()
    code = main(["tokenize", "--no-progress", *args])
    return code, capsys.readouterr().err


def test_a_jsonl_surrogate_is_named_by_file_and_line_and_skipped_on_request(tmp_path, capsys, plain_tokenizer_dir):
    data = tmp_path / "surr.jsonl"
    # an escaped lone surrogate: valid JSON, but no Unicode text (the tokenizer raised a TypeError)
    data.write_text('{"text": "good one"}\n{"text": "bad \\ud800 surrogate"}\n{"text": "good two"}\n')
    code, err = _tokenize(capsys, str(data), "--tokenizer", plain_tokenizer_dir, "--output", str(tmp_path / "out"))
    assert code == 2, err
    assert f"{data}:2: holds an escaped lone surrogate" in err and "--on-error skip" in err
    code, err = _tokenize(capsys, str(data), "--tokenizer", plain_tokenizer_dir, "--output", str(tmp_path / "out"),
                          "--on-error", "skip")  # fmt: skip
    assert code == 0, err
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["documents"] == 2 and summary["skipped"] == {"not_utf8": 1}


@pytest.fixture
def checkpoint_with_bad_tokenizer(tmp_path, plain_tokenizer_dir) -> Path:
    """A tiny Orthros checkpoint whose tokenizer.json was cut in half (an interrupted copy)."""
    ckpt = tmp_path / "ckpt"
    tiny_model(1024).save_pretrained(ckpt)
    for f in Path(plain_tokenizer_dir).iterdir():
        shutil.copy(f, ckpt / f.name)
    text = (ckpt / "tokenizer.json").read_text()
    (ckpt / "tokenizer.json").write_text(text[: len(text) // 2])
    return ckpt


def test_a_corrupt_tokenizer_names_its_file_and_the_fix(tmp_path, capsys, checkpoint_with_bad_tokenizer):
    ckpt = checkpoint_with_bad_tokenizer
    (tmp_path / "essay.txt").write_text("A few words to tokenize.\n")
    code, err = _tokenize(capsys, str(tmp_path / "essay.txt"), "--tokenizer", str(ckpt), "--output",
                          str(tmp_path / "out"))  # fmt: skip
    assert code == 2, err
    assert f"{ckpt / 'tokenizer.json'}: not valid JSON" in err and "truncated or corrupt" in err


def test_to_hf_refuses_to_export_a_corrupt_tokenizer(tmp_path, checkpoint_with_bad_tokenizer):
    from orthros_train.common.tokenizer import TokenizerError
    from orthros_train.convert.to_hf import convert_to_hf

    with pytest.raises(TokenizerError, match=r"tokenizer.json: not valid JSON.*truncated or corrupt"):
        convert_to_hf(checkpoint_with_bad_tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything is written
