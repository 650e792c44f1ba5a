"""Adversarial review, round 3: bad input is refused where it is defined, in one line naming the
key/flag/file and the fix, and nothing is lost; a bug keeps its traceback. One test per class,
parametrised over the cases found."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import torch
from fixtures import LAUNCH_DIR, QUIET_RUN, REPO, SMALL_TINY_CPU, cli_env, resolved_recipe, tiny_model

from orthros_train.errors import UserError
from orthros_train.train.config import RunConfig, run_config_from_dict, typed_section

# -- 1. every number of a recipe checked where it is defined -----------------------------------------


def _float_fields(cls: type, prefix: str) -> list[tuple[type, str, str, bool]]:
    """(section class, section name, field, is a list) of every float field, nested sections too."""
    out = []
    for f in fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(hint)
        if is_dataclass(hint):
            out += [(hint, f"{prefix}.{f.name}", *rest[2:]) for rest in _float_fields(hint, f"{prefix}.{f.name}")]
        elif hint is float or float in args:
            out.append((cls, prefix, f.name, False))
        elif any(typing.get_args(a) == (float,) for a in (hint, *args)):  # list[float] (data.weights)
            out.append((cls, prefix, f.name, True))
    return out


def _sections() -> list[tuple[type, str]]:
    """Every typed section of a recipe, whatever sections RunConfig grows (init is not one)."""
    hints = typing.get_type_hints(RunConfig)
    out = []
    for name, hint in hints.items():
        cls = next((a for a in (hint, *typing.get_args(hint)) if is_dataclass(a)), None)
        if cls is not None and name != "init":
            out.append((cls, name))
    return out


FLOAT_FIELDS = [case for cls, name in _sections() for case in _float_fields(cls, name)]


def test_the_walk_finds_the_float_fields_of_every_section():
    names = {f"{section}.{key}" for _, section, key, _ in FLOAT_FIELDS}
    assert {"optim.lr", "optim.min_lr", "optim.weight_decay", "optim.eps", "rl.top_p", "model.rope_theta",
            "trainer.loss_spike_factor", "data.weights"} <= names


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("cls,section,key,is_list", FLOAT_FIELDS,
                         ids=[f"{s}.{k}" for _, s, k, _ in FLOAT_FIELDS])
def test_every_float_field_refuses_nan_and_inf_naming_the_key(cls, section, key, is_list, value):
    if cls.__dataclass_fields__[key].metadata.get("nonfinite_ok"):
        pytest.skip(f"{section}.{key} takes non-finite values on purpose")
    given = [1.0, value] if is_list else value
    with pytest.raises(UserError, match=rf"^{section}\.{key}(\[1\])?={value}: must be a finite number"):
        typed_section(cls, {key: given}, section)


@pytest.mark.parametrize("overrides,message", [
    ({"lr": 3e3}, r"optim.lr=3000.0 must lie in \(0, 1\] .*optim.allow_large_lr=true"),
    ({"lr": -1e-3}, r"optim.lr=-0.001 must lie in \(0, 1\]"),
    ({"lr": 0.0}, r"optim.lr=0.0 must lie in \(0, 1\]"),
    ({"lr": 1e-3, "min_lr": 1e-2}, r"optim.min_lr=0.01 must lie in \[0, optim.lr=0.001\]"),
    ({"min_lr": -1e-5}, r"optim.min_lr=-1e-05 must lie in"),
    ({"weight_decay": -0.1}, r"optim.weight_decay=-0.1 must be >= 0"),
    ({"grad_clip": -1.0}, r"optim.grad_clip=-1.0 must be >= 0"),
    ({"beta1": 1.5}, r"optim.beta1=1.5 must lie in \[0, 1\)"),
    ({"beta2": 1.0}, r"optim.beta2=1.0 must lie in \[0, 1\)"),
    ({"eps": 0.0}, r"optim.eps=0.0 must be > 0"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_optim_ranges_are_refused_naming_the_key(overrides, message):
    from orthros_train.train.config import OptimConfig

    with pytest.raises(UserError, match=message):
        typed_section(OptimConfig, overrides, "optim")


def test_a_large_learning_rate_is_taken_when_asked_for():
    from orthros_train.train.config import OptimConfig

    assert typed_section(OptimConfig, {"lr": 3.0, "min_lr": 0.0, "allow_large_lr": True}, "optim").lr == 3.0


@pytest.mark.parametrize("section,values,message", [
    ("rl", {"top_p": 0.0}, r"rl.top_p=0.0 must lie in \(0, 1\]"),
    ("trainer", {"loss_spike_factor": -1.0}, r"trainer.loss_spike_factor=-1.0 must be >= 0"),
    ("trainer", {"gpu_memory_gib": 0.0}, r"trainer.gpu_memory_gib=0.0 must be > 0"),
    ("data", {"split": "abc"}, r"data.split='abc': expected up to three numbers"),
    ("data", {"split": "0,100,0"}, r"data.split='0,100,0' gives training no share"),
    ("data", {"split": "98,-2,0"}, r"data.split='98,-2,0': expected up to three shares >= 0"),
    ("data", {"source": "indexed", "paths": ["a", "b"], "weights": [0.0, 0.0]}, r"data.weights=\[0.0, 0.0\]"),
])
def test_section_ranges_are_refused_naming_the_key(section, values, message):
    cls = dict((name, c) for c, name in _sections())[section]
    with pytest.raises(UserError, match=message):
        typed_section(cls, values, section)


@pytest.mark.parametrize("overrides,message", [
    (["+optim.frozen_steps=1000000000", "trainer.max_steps=3"],
     r"optim.frozen_steps=1000000000 exceeds trainer.max_steps=3: only gamma/beta would train"),
    (["+optim.frozen_steps=2", "trainer.max_steps=3", "model.attention_type=dense"],
     r"optim.frozen_steps=2 holds every weight but the output-stream affine, which a "
     r"model.attention_type=dense model does not have"),
])
def test_frozen_steps_that_would_train_nothing_are_refused_with_the_numbers(tmp_path, overrides, message):
    recipe = resolved_recipe("tiny_cpu", f"trainer.run_dir={tmp_path}", *overrides)
    with pytest.raises(UserError, match=message):
        run_config_from_dict(recipe)


def test_frozen_steps_within_the_run_are_taken(tmp_path):
    recipe = resolved_recipe("tiny_cpu", f"trainer.run_dir={tmp_path}", "+optim.frozen_steps=3", "trainer.max_steps=3")
    assert run_config_from_dict(recipe).optim.frozen_steps == 3


# -- 2. the run directory tells the truth -------------------------------------------------------------


def test_an_export_is_published_whole_or_not_at_all(tmp_path):
    from orthros_train.train.run_dir import complete_export, publish_directory

    target = tmp_path / "checkpoints" / "final"

    def dies_half_way(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the kill arrives while the weights are written

    with pytest.raises(KeyboardInterrupt):
        publish_directory(target, dies_half_way)
    assert not target.exists() and not list(target.parent.iterdir())  # no final/, no debris
    model = tiny_model()
    publish_directory(target, model.save_pretrained)
    assert complete_export(target)
    first = (target / "model.safetensors").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        publish_directory(target, dies_half_way)
    assert (target / "model.safetensors").read_bytes() == first  # the previous export stays whole


def test_a_relaunch_does_not_announce_a_broken_final_export(tmp_path):
    from orthros_train.train.run_dir import completed_checkpoint

    root = tmp_path / "checkpoints"
    step = root / "step_000000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4}))
    (root / "latest").write_text(step.name)
    (root / "final").mkdir()
    (root / "final" / ".tmp06GR7N").write_bytes(b"")  # what a kill -9 during the old export left
    assert completed_checkpoint(tmp_path, 4) is None  # so the relaunch exports it again
    tiny_model().save_pretrained(root / "final")
    assert completed_checkpoint(tmp_path, 4) == step


def test_a_resume_sets_the_rows_past_its_step_aside(tmp_path):
    from orthros_train.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')  # killed mid-row
    log = MetricsLog(tmp_path, initial_step=2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    aside = log.set_aside
    assert aside.name == "metrics.after-step-2.attempt-1.jsonl"
    assert aside.read_text().splitlines()[:2] == [json.dumps(rows[2]), json.dumps(rows[3])]
    assert aside.read_text().splitlines()[2] == '{"step": 5, "lo'  # nothing lost
    log.log({"step": 3, "loss": 0.3})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert MetricsLog(tmp_path, initial_step=3).set_aside is None  # a clean resume moves nothing


def test_resuming_on_data_of_another_tokenizer_is_refused_naming_both(tmp_path, bpe_tokenizer_dir):
    from transformers import AutoTokenizer

    from orthros_train.train.run_dir import tokenizer_difference

    saved = AutoTokenizer.from_pretrained(bpe_tokenizer_dir(vocab_size=1024, chat_template=False))
    other = AutoTokenizer.from_pretrained(bpe_tokenizer_dir(vocab_size=512, chat_template=False))
    saved.save_pretrained(tmp_path / "step_000000003" / "model")
    assert tokenizer_difference(tmp_path / "step_000000003", saved) is None
    problem = tokenizer_difference(tmp_path / "step_000000003", other)
    assert "step_000000003/model" in problem and f"({len(saved)} tokens)" in problem
    assert f"({len(other)} tokens" in problem


def test_a_run_without_a_usable_checkpoint_is_not_restarted_silently(tmp_path, make_trainer):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    with pytest.raises(UserError, match=r"holds a run \(.*metrics.jsonl\) but no usable checkpoint.*"
                                        r"trainer.resume=none trainer.overwrite=true"):
        make_trainer()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 7.0}\n'


@pytest.mark.parametrize("resume", ["bogus", "/no/such/dir"])
def test_a_resume_value_that_is_not_a_keyword_or_checkpoint_names_the_keywords(tmp_path, make_trainer, resume):
    with pytest.raises(UserError, match=rf"trainer.resume={resume}: no such directory \(trainer.resume takes "
                                        r"auto, none or a checkpoint directory\)"):
        make_trainer(f"trainer.resume={resume}")


def test_a_launch_into_a_live_run_keeps_its_hydra_files_out_of_it(tmp_path):
    from orthros_train.train.cli import _HYDRA_DIRS, hydra_output_dir

    _HYDRA_DIRS.clear()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"host": socket.gethostname(), "pid": holder.pid, "started": "now", "token": "t", "job_id": None}
        (run_dir / "run.lock").write_text(json.dumps(owner))
        elsewhere = hydra_output_dir(str(run_dir))
        assert Path(elsewhere).resolve() != run_dir.resolve() and not (run_dir / ".hydra").exists()
    finally:
        holder.kill()
        holder.wait()
    _HYDRA_DIRS.clear()  # one answer per launch (process); the next launch asks afresh
    assert hydra_output_dir(str(run_dir)) == str(run_dir)  # its holder is gone: the run dir again


def test_a_relaunch_keeps_the_run_s_hydra_record_until_it_is_accepted(tmp_path):
    from orthros_train.train.cli import _HYDRA_DIRS, hydra_output_dir, publish_launch_record

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.001\n")
    _HYDRA_DIRS.clear()
    staging = Path(hydra_output_dir(str(run_dir)))
    assert staging.resolve() != run_dir.resolve()
    assert hydra_output_dir(str(run_dir)) == str(staging)  # Hydra may ask twice: one answer
    (staging / ".hydra").mkdir()
    (staging / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.002\n")
    # refused: nothing is published, the run's record is the earlier launch's
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- optim.lr=0.001\n"
    assert publish_launch_record(run_dir, staging)  # accepted: the new record replaces it
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- optim.lr=0.002\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra"] and not staging.exists()
    _HYDRA_DIRS.clear()


def test_written_weights_honour_the_umask(tmp_path):
    from orthros_train.train.run_dir import publish_directory

    old = os.umask(0o002)
    try:
        publish_directory(tmp_path / "final", tiny_model().save_pretrained)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "final").iterdir()}
    assert modes == {"model.safetensors": 0o664, "config.json": 0o664}


# -- 3. user errors vs bugs ---------------------------------------------------------------------------


def _train_main(monkeypatch, capsys, tmp_path, *overrides: str) -> tuple[int, str]:
    from orthros_train.train import cli

    argv = ["orthros-train", "--config-name", "tiny_cpu", *SMALL_TINY_CPU, *QUIET_RUN,
            f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=1", *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        cli.main()
    code = exc.value.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # SystemExit("message"): Python prints it and exits 1
        return 1, err + code
    return code, err


@pytest.mark.parametrize("override,message", [
    ("optim.lr=nan", "orthros-train: optim.lr=nan: must be a finite number (not NaN or inf)"),
    ("optim.lr=inf", "orthros-train: optim.lr=inf: must be a finite number (not NaN or inf)"),
    ("optim.weight_decay=nan", "orthros-train: optim.weight_decay=nan: must be a finite number"),
    ("optim.min_lr=nan", "orthros-train: optim.min_lr=nan: must be a finite number"),
    ("optim.lr=3e3", "orthros-train: optim.lr=3000.0 must lie in (0, 1]"),
    ("optim.beta1=1.5", "orthros-train: optim.beta1=1.5 must lie in [0, 1)"),
    ("trainer.max_step=3", "orthros-train: trainer.max_step=3 is not a key of recipe tiny_cpu: did you mean "
                           "trainer.max_steps"),
])
def test_a_bad_recipe_value_is_one_line(monkeypatch, capsys, tmp_path, override, message):
    code, err = _train_main(monkeypatch, capsys, tmp_path, override)
    assert code == 1 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_value_error_inside_torch_keeps_its_traceback_and_says_where_to_report(monkeypatch, capsys, tmp_path):
    import orthros_train.train.trainer as trainer_module

    class Trainer:  # stands in for the real one: a ValueError from inside torch during training
        is_main = False  # publishes no Hydra record

        def __init__(self, *args, **kwargs) -> None:
            pass

        def fit(self) -> dict:
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=-1.0)  # torch: "Invalid learning rate"
            return {}

        def close(self) -> None:
            pass

    monkeypatch.setattr(trainer_module, "Trainer", Trainer)
    code, err = _train_main(monkeypatch, capsys, tmp_path)
    assert code == 1
    assert "Traceback" in err and "torch/optim" in err and "ValueError: Invalid learning rate" in err
    assert "internal error (ValueError): this is a bug" in err and "please report it" in err


def _eval_main(monkeypatch, capsys, error: BaseException) -> tuple[int, str]:
    from orthros_train.eval import cli

    def command(args) -> None:
        raise error

    monkeypatch.setitem(cli.COMMANDS, "ppl", command)
    code = cli.main(["ppl", "ckpt", "data.txt", "--device", "cpu", "--output-dir", str(Path.cwd())])
    return code, capsys.readouterr().err


def _convert_main(monkeypatch, capsys, error: BaseException) -> tuple[int, str]:
    from orthros_train.convert import cli, gguf

    def gguf_to_hf(src, dst):
        raise error

    monkeypatch.setattr(gguf, "gguf_to_hf", gguf_to_hf)
    return cli.main(["gguf-to-hf", "x.gguf", "out"]), capsys.readouterr().err


def _data_main(monkeypatch, capsys, error: BaseException) -> tuple[int, str]:
    import data_tools.pretokenize
    from data_tools import cli

    def run(options):
        raise error

    monkeypatch.setattr(data_tools.pretokenize, "run", run)
    return cli.main(["tokenize", "x.txt", "--tokenizer", "tok", "--output", "out"]), capsys.readouterr().err


@pytest.mark.parametrize("main", [_eval_main, _convert_main, _data_main], ids=["eval", "convert", "data"])
def test_the_command_lines_tell_user_errors_from_bugs(monkeypatch, capsys, tmp_path, main):
    monkeypatch.chdir(tmp_path)
    code, err = main(monkeypatch, capsys, UserError("--flag 3: must be 2; use --flag 2"))
    assert code == 2 and "--flag 3: must be 2; use --flag 2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    try:
        torch.zeros(2).view(3)  # a RuntimeError from inside torch
    except RuntimeError as bug:
        code, err = main(monkeypatch, capsys, bug)
    assert code == 1 and "Traceback" in err and "this is a bug" in err
    try:
        int("x")  # a plain ValueError (not the user's): a bug too
    except ValueError as bug:
        code, err = main(monkeypatch, capsys, bug)
    assert code == 1 and "Traceback" in err and "internal error (ValueError)" in err


# -- 4. commands catch their own bad input ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_and_orthros(tmp_path_factory):
    """A tiny HF Llama (vocab 128) and an Orthros checkpoint of another vocabulary (2048)."""
    from fixtures import TINY_HF_SHAPE
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("verify")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, **TINY_HF_SHAPE)).save_pretrained(root / "hf")
    tiny_model(vocab_size=2048).save_pretrained(root / "orthros")
    return root / "hf", root / "orthros"


@pytest.mark.parametrize("case,message", [
    ("mismatched", r"different models: HF_DIR .*hf and ORTHROS_DIR .*orthros differ in vocab_size 128 vs 2048"),
    ("hf_as_orthros", r"ORTHROS_DIR .*hf is a Hugging Face model directory \(model_type 'llama'\), not an Orthros"),
])
def test_convert_verify_refuses_folders_that_are_not_one_model(hf_and_orthros, capsys, case, message):
    from orthros_train.convert.cli import main

    hf, orthros = hf_and_orthros
    args = [str(hf), str(orthros)] if case == "mismatched" else [str(hf), str(hf)]
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert __import__("re").search(message, err), err


@pytest.mark.parametrize("content", [b"", bytes(range(256)) * 8, b"GGU"], ids=["empty", "random", "short"])
def test_gguf_to_hf_refuses_a_file_that_is_not_gguf(tmp_path, capsys, content):
    from orthros_train.convert.cli import main

    (tmp_path / "fake.gguf").write_bytes(content)
    assert main(["gguf-to-hf", str(tmp_path / "fake.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "fake.gguf is not a GGUF file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_trainer_step_folder_points_to_its_model(tmp_path, capsys):
    from orthros_train.convert.cli import main as convert
    from orthros_train.eval.cli import main as evaluate

    tiny_model().save_pretrained(tmp_path / "step_000000003" / "model")
    step = tmp_path / "step_000000003"
    assert convert(["to-hf", str(step), str(tmp_path / "out")]) == 2
    assert evaluate(["ppl", str(step), "x.txt", "--device", "cpu", "--output-dir", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert err.count(f"{step} is a trainer checkpoint step: its model is {step / 'model'}") == 2


def test_a_corrupt_config_json_is_named(tmp_path):
    from orthros_train.infer.loading import load_model

    tiny_model().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{\n  "vocab_size": 64,\n  bad\n}')
    with pytest.raises(UserError, match=r"config.json is not valid JSON \(Expecting property name"):
        load_model(tmp_path, device="cpu")


def test_ppl_refuses_text_that_is_not_utf8_naming_the_file(tmp_path):
    from orthros_train.eval.ppl import text_documents

    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3, line 1\)"):
        list(text_documents([str(tmp_path / "latin1.txt")]))


@pytest.mark.parametrize("flag,lengths", [("--lengths", [1024, 256]), ("--seq-len", [1024])])
def test_eval_lengths_beyond_the_trained_positions_are_named(capsys, flag, lengths):
    from orthros_train.eval.cli import warn_beyond_positions

    model = tiny_model(max_position_embeddings=256)
    warn_beyond_positions(model, flag, lengths)
    err = capsys.readouterr().err
    assert f"{flag} 1024 exceed(s) the checkpoint's max_position_embeddings=256" in err
    warn_beyond_positions(model, flag, [256])
    assert capsys.readouterr().err == ""


def test_recall_num_pairs_beyond_the_text_keys_is_named():
    import random

    from orthros_train.eval.recall import make_text_sample

    with pytest.raises(UserError, match=r"--num-pairs 100000: the text format has \d+ distinct keys"):
        make_text_sample(None, 1024, 100_000, random.Random(0))


def test_tokenize_names_a_truncated_gzip_file(tmp_path, plain_tokenizer_dir, capsys):
    import gzip

    from data_tools.cli import main

    data = gzip.compress("".join(json.dumps({"text": f"essay {i} " * 40}) + "\n" for i in range(300)).encode())
    (tmp_path / "trunc.jsonl.gz").write_bytes(data[: len(data) // 2])
    code = main(["tokenize", str(tmp_path / "trunc.jsonl.gz"), "--tokenizer", plain_tokenizer_dir,
                 "--output", str(tmp_path / "tok" / "x"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "trunc.jsonl.gz: the compressed file is truncated or corrupt" in err
    assert "Traceback" not in err


def test_rollout_groups_of_another_size_than_rl_group_size_are_named(tmp_path, caplog):
    from orthros_train.train.config import RLConfig
    from orthros_train.train.rl.rollout import Rollout, save_rollouts
    from orthros_train.train.rl.sources import FileRollouts

    groups = [0, 1, 1, 1, 2, 2, 3, 3]
    save_rollouts(tmp_path / "r.jsonl", [Rollout([1, 2], [3], reward=float(i), group=g) for i, g in enumerate(groups)])
    with caplog.at_level("WARNING"):
        FileRollouts(str(tmp_path / "r.jsonl"), RLConfig(group_size=2, prompts_per_step=2), 2, 0, 1)
    text = caplog.text
    assert "2 group(s) whose size is not rl.group_size=2" in text
    assert "step 1: group 0 has 1 (rollouts 1..1)" in text and "step 1: group 1 has 3 (rollouts 2..4)" in text


@pytest.mark.parametrize("delay", [1.5, 4.0])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, delay):
    proc = subprocess.Popen(
        [sys.executable, "-m", "orthros_train.train.cli", "--config-name", "tiny_cpu", *QUIET_RUN,
         f"trainer.run_dir={tmp_path / 'run'}"],
        env=cli_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert "orthros-train: interrupted (Ctrl-C)" in err


def test_torchrun_launcher_refuses_a_bad_recipe_once_before_starting_ranks(tmp_path):
    proc = subprocess.run(
        ["bash", str(LAUNCH_DIR / "torchrun.sh"), "2", "tiny_cpu", *QUIET_RUN, "optim.lr=nan",
         f"trainer.run_dir={tmp_path / 'run'}"],
        env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.count("optim.lr=nan: must be a finite number") == 1, proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("content", [None, "{}"], ids=["empty", "config_only"])
def test_a_tokenizer_folder_without_tokenizer_files_is_named(tmp_path, content):
    from orthros_train.common.tokenizer import TokenizerError, load_tokenizer

    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(TokenizerError, match=r"the folder holds no tokenizer files \(tokenizer.json"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("content,message", [
    ('{"hello": [1, 2, 3]}', r"notsum.json: not a summary written by orthros-data \(no 'shards'\)"),
    ("[1, 2]", r"notsum.json: not a summary written by orthros-data"),
    ("{oops", r"notsum.json: not valid JSON"),
])
def test_inspect_names_a_json_that_is_not_a_summary(tmp_path, capsys, content, message):
    from data_tools.cli import main

    (tmp_path / "notsum.json").write_text(content)
    assert main(["inspect", str(tmp_path / "notsum.json")]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(message, err) and "Traceback" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["niah", "ckpt", "--lengths", "-1k"], "not a token count: '-1k'"),
    (["niah", "ckpt", "--depths", "-5"], "depth -5"),
])
def test_eval_flags_given_a_negative_value_reach_their_own_check(tmp_path, capsys, argv, message):
    from orthros_train.eval.cli import main

    assert main([*argv, "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "expected one argument" not in err, err


def test_init_from_of_another_model_names_the_model_keys(tmp_path):
    from orthros_train.train.build import _config_difference

    tiny_model(vocab_size=2048, num_hidden_layers=3).save_pretrained(tmp_path / "ckpt")
    recipe = resolved_recipe("tiny_cpu", f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={tmp_path / 'ckpt'}")
    differ = " ".join(_config_difference(run_config_from_dict(recipe)))
    assert "model.num_hidden_layers=" in differ and "3 in " in differ and "ckpt/config.json" in differ


def test_a_clean_resume_leaves_a_long_metrics_log_alone(tmp_path, monkeypatch):
    from orthros_train.train import metrics as metrics_module

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5001)))
    before = path.stat().st_mtime_ns

    def no_whole_read(self, *args, **kwargs):
        raise AssertionError("the whole log was read")

    monkeypatch.setattr(Path, "read_text", no_whole_read)
    assert metrics_module.set_aside_rows_after(path, 5000) is None
    monkeypatch.undo()
    assert path.stat().st_mtime_ns == before


def test_init_from_a_checkpoint_of_another_shape_names_the_model_keys_to_set(tmp_path, monkeypatch) -> None:
    """An RL or SFT recipe pointed at a checkpoint of another shape (the documented RL command on
    rl_tiny_cpu's 2-layer model with a 4-layer checkpoint) names the model.* keys that differ, not
    only the tensors it cannot place."""
    from fixtures import compose_recipe

    from orthros_train.model.orthros import OrthrosForCausalLM
    from orthros_train.train import build

    monkeypatch.setattr(build, "build_parallel_model", lambda cfg, pcfg, seed=None: OrthrosForCausalLM(cfg))

    def refuse(model, weights, cfg):  # what load_reference_shards says for surplus layers
        raise UserError("the weights hold 2 tensors this model does not have, e.g. ['layers.3.mlp.up_proj.weight']")

    monkeypatch.setattr(build, "load_reference_shards", refuse)
    ckpt = tmp_path / "ckpt"
    tiny_model(vocab_size=2048, num_hidden_layers=3).save_pretrained(ckpt)
    cfg = compose_recipe("tiny_cpu", f"trainer.run_dir={tmp_path / 'run'}", f"model.init_from={ckpt}")
    with pytest.raises(UserError) as exc:
        build.build_model(cfg, torch.device("cpu"))
    message = str(exc.value)
    assert "holds another model than the recipe's" in message and "model.num_hidden_layers=" in message, message
    assert "3 in" in message and "config.json" in message, message


def test_a_conversion_study_teacher_of_another_shape_is_refused_before_anything_runs(tmp_path) -> None:
    """--teacher of another hidden size or vocabulary: one line naming --teacher, the sizes and the
    override that matches them (was a traceback from the first sweep run)."""
    from orthros_train.study.conversion import check_teacher

    teacher = tmp_path / "cv_dense"
    teacher.mkdir()
    (teacher / "model.safetensors").write_bytes(b"")
    shape = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "attention_type": "dense"}
    (teacher / "config.json").write_text(json.dumps(shape))
    study = {"vocab_size": "${data.tokenizer_vocab_size}", "hidden_size": 32, "num_hidden_layers": 2}
    with pytest.raises(UserError) as exc:
        check_teacher(teacher, study)
    message = str(exc.value)
    assert message.startswith(f"--teacher {teacher} has another shape: hidden_size 64 (the study's 32)"), message
    assert "--override model.hidden_size=64" in message and "vocab_size" not in message  # not a size yet
    check_teacher(teacher, {**study, "hidden_size": 64})  # the study's shape: accepted
    # the study's tokenizer has 1024 tokens: no override fixes a teacher of another vocabulary
    with pytest.raises(UserError, match=r"has a vocabulary of 128 tokens, the study's tokenizer 1024: .* pick a dense "
                                         r"checkpoint trained with the study's tokenizer"):  # fmt: skip
        check_teacher(teacher, {**study, "hidden_size": 64}, vocab_size=1024)
    with pytest.raises(UserError, match=r"tie_word_embeddings None \(the study's True\)"):  # tying is shape too
        check_teacher(teacher, {**study, "hidden_size": 64, "tie_word_embeddings": True}, vocab_size=128)


def test_a_conversion_study_teacher_check_reads_the_tokenizers_vocabulary(tmp_path) -> None:
    """The study's recipe states its vocabulary as the tokenizer's: the up-front check resolves it."""
    from orthros_train.study.conversion import ConversionOptions, check_options

    teacher = tmp_path / "cv_dense"
    teacher.mkdir()
    (teacher / "model.safetensors").write_bytes(b"")
    (teacher / "config.json").write_text(json.dumps({"vocab_size": 128, "attention_type": "dense"}))
    with pytest.raises(UserError, match="has a vocabulary of 128 tokens, the study's tokenizer 1024"):
        check_options(ConversionOptions(out=tmp_path / "out", quick=True, teacher=teacher))
