"""Settings that make another one meaningless, values the model cannot use and empty paths are
refused before anything runs, with one line naming the keys and the fix."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
from fixtures import compose_recipe

from orthros_train.errors import UserError

SMALL = ("model.hidden_size=64", "model.num_hidden_layers=2", "model.sliding_window=32", "trainer.seq_len=64",
         "trainer.global_batch_size=null", "trainer.micro_batch_size=2")  # fmt: skip


def _teacher(tmp_path: Path, **shape) -> Path:
    """A checkpoint folder's config.json of the tiny_cpu model with ``shape`` changed (no weights:
    every check below runs before any is read)."""
    cfg = compose_recipe("tiny_cpu", *SMALL).model.to_dict()
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**cfg, **shape}, default=str))
    return folder


def test_sink_tokens_on_a_dense_model_are_refused():
    with pytest.raises(UserError, match=r"model.sink_tokens=4 with model.attention_type=dense.*set "
                                         r"model.sink_tokens=0"):
        compose_recipe("tiny_cpu", *SMALL, "+model.sink_tokens=4", "model.attention_type=dense")
    # a windowed model uses them
    assert compose_recipe("tiny_cpu", *SMALL, "+model.sink_tokens=4", "model.attention_type=sliding").model.sink_tokens


@pytest.mark.parametrize("keys, named", [
    (["distill.beyond_window_only=true"], "distill.beyond_window_only=true acts"),
    (["distill.align=mse", "distill.align_steps=1"], "distill.align=mse acts"),
])  # fmt: skip
def test_distill_terms_with_no_position_beyond_the_window_are_refused(tmp_path, keys, named):
    """seq_len 64 = sliding_window 64: the term could never apply and the loss would be (1-alpha) CE."""
    with pytest.raises(UserError, match=rf"{named} only on positions >= model.sliding_window=64.*trainer.seq_len=64"):
        compose_recipe("tiny_cpu", *SMALL, "+distill=dense_twin", f"model.init_from={tmp_path}",
                       "model.sliding_window=64", *keys)  # fmt: skip


def test_a_disabled_distill_preset_names_the_preset():
    with pytest.raises(UserError, match=r"distill.enabled=false.*leave out the preset that set them "
                                         r"\(\+distill=dense_twin\).*distill=disabled"):
        compose_recipe("tiny_cpu", *SMALL, "+distill=dense_twin", "distill.enabled=false")


def test_distill_on_a_recipe_without_a_distill_default_says_to_add_it():
    from orthros_train.train.cli import override_typo

    problem = override_typo("tiny_cpu", ["distill=dense_twin", "trainer.max_steps=2"])
    assert problem == ("distill=dense_twin: recipe tiny_cpu has no distill entry in its defaults list to replace; "
                       "add the preset with +distill=dense_twin")  # fmt: skip
    assert override_typo("tiny_cpu", ["+distill=dense_twin"]) is None


def test_alignment_with_a_teacher_of_another_shape_is_refused_before_a_model_is_built(tmp_path):
    from orthros_train.train.teacher import check_teacher, planned_teacher_config

    teacher = _teacher(tmp_path, hidden_size=256, num_hidden_layers=4, intermediate_size=512)
    cfg = compose_recipe("tiny_cpu", *SMALL, "+distill=dense_twin", f"distill.teacher={teacher}",
                         f"model.init_from={teacher}", "distill.align=mse", "distill.align_steps=1")  # fmt: skip
    for check in (check_teacher, planned_teacher_config):
        with pytest.raises(UserError, match=r"distill.align=mse compares hidden states layer by layer.*hidden_size "
                                             r"256 \(the student's model.hidden_size=64\), num_hidden_layers 4.*"
                                             r"distill.align=none"):
            check(cfg)
    # logits only: another hidden size is a fine teacher
    planned_teacher_config(compose_recipe("tiny_cpu", *SMALL, "+distill=dense_twin", f"distill.teacher={teacher}",
                                          f"model.init_from={teacher}"))  # fmt: skip


def test_a_teacher_config_that_is_not_json_names_the_key_and_file(tmp_path):
    from orthros_train.train.teacher import planned_teacher_config

    teacher = _teacher(tmp_path)
    (teacher / "config.json").write_text("{truncated")
    cfg = compose_recipe("tiny_cpu", *SMALL, "+distill=dense_twin", f"distill.teacher={teacher}")
    with pytest.raises(UserError, match=rf"distill.teacher={teacher}: .*config.json is not an Orthros model config"):
        planned_teacher_config(cfg)


def test_resuming_with_another_optim_trainable_is_refused_even_when_changes_are_allowed(tmp_path):
    from orthros_train.train.run_dir import check_resume

    recipe = {"model": {"hidden_size": 64}, "optim": {"lr": 1e-3, "trainable": "self_attn"}}
    checkpoint = tmp_path / "step_000000002"
    checkpoint.mkdir()
    (checkpoint / "meta.json").write_text(json.dumps({"recipe": recipe}))
    now = {**recipe, "optim": {"lr": 1e-3, "trainable": None}}
    with pytest.raises(UserError, match=r'optim.trainable=null \(the checkpoint trained "self_attn"\).*Set '
                                         r'optim.trainable="self_attn" back, or start a new run'):
        check_resume(checkpoint, now, "allow")
    assert check_resume(checkpoint, recipe, "refuse") == []  # unchanged: resumes


@pytest.mark.parametrize("step", [-1, 0, 3])
def test_a_fail_at_step_that_can_never_fire_is_refused(step):
    with pytest.raises(UserError, match=rf"trainer.fail_at_step={step} can never fire: steps run "
                                         r"1..trainer.max_steps=2.*test hook"):
        compose_recipe("tiny_cpu", *SMALL, "trainer.max_steps=2", f"trainer.fail_at_step={step}")
    assert compose_recipe("tiny_cpu", *SMALL, "trainer.max_steps=2", "trainer.fail_at_step=2")


def test_fail_at_step_says_why_the_process_dies(make_trainer, monkeypatch, caplog):
    import orthros_train.train.trainer as trainer_module

    class Killed(Exception):
        pass

    def exit_(code: int) -> None:
        raise Killed(code)

    trainer = make_trainer("trainer.max_steps=2", "trainer.fail_at_step=1")
    monkeypatch.setattr(trainer_module.os, "_exit", exit_)
    with caplog.at_level(logging.ERROR, logger="orthros_train.train.trainer"), pytest.raises(Killed):
        trainer.fit()
    assert "trainer.fail_at_step=1: this process is killed on purpose after step 1 (exit 17" in caplog.text


def test_the_recipes_explain_fail_at_step():
    for name in ("cpu", "gpu"):
        text = (Path(__file__).parent.parent / "recipes" / "trainer" / f"{name}.yaml").read_text()
        before = text.split("fail_at_step: null")[0].splitlines()[-1]
        assert before.startswith("#") and "Leave it null" in before


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "1"])
def test_a_sampling_temperature_that_is_not_a_finite_number_is_named(value):
    from orthros_train.infer.sampling import SamplingParams

    with pytest.raises(UserError, match="temperature must be"):
        SamplingParams(temperature=value).validate()
    with pytest.raises(UserError, match="top_p must"):
        SamplingParams(top_p=math.nan).validate()


@pytest.mark.parametrize("overrides, named", [
    (["+model.sink_tokens=2"], r"--override \+model.sink_tokens=2 sets model.sink_tokens, which --archs "
                               r"orthros_sinks fixes \(model.sink_tokens=4\)"),
    (["++model.sink_tokens=2"], r"which --archs orthros_sinks fixes"),
    (["model.attention_type=dense"], r"model.attention_type is what each of --archs"),
    (["optim.lr=nan"], r"--override optim.lr=nan: the study sets optim.lr of every run itself \(from --lrs\)"),
    (["optim.min_lr=1e-4"], r"sets optim.min_lr .*use --lrs instead"),
    (["trainer.seed=7"], r"sets trainer.seed .*use --seeds instead"),
    (["trainer.run_dir=/tmp/one"], r"sets trainer.run_dir .*use --out instead"),
])  # fmt: skip
def test_a_study_override_of_a_key_the_arch_fixes_is_refused(tmp_path, overrides, named):
    from orthros_train.study.pipeline import StudyOptions

    with pytest.raises(UserError, match=named):
        StudyOptions(out=tmp_path, archs=("orthros", "orthros_sinks"), overrides=overrides)
    StudyOptions(out=tmp_path, archs=("orthros",), overrides=["+model.sink_tokens=2"])  # no arch fixes it


@pytest.mark.parametrize("overrides, key", [
    (["model.init_from=''"], "model.init_from"),
    (["trainer.run_dir=''"], "trainer.run_dir"),
    (["trainer.resume=''"], "trainer.resume"),
    (["optim.trainable=''"], "optim.trainable"),
    (["data.cache_dir=''"], "data.cache_dir"),
    (["++data.tokenizer='  '"], "data.tokenizer"),
    (["+distill=dense_twin", "distill.teacher='  '"], "distill.teacher"),
])  # fmt: skip
def test_an_empty_path_in_a_recipe_key_is_refused(overrides, key):
    with pytest.raises(UserError, match=rf"{key}='\s*' is empty: give .*, or {key}="):
        compose_recipe("tiny_cpu", *SMALL, *overrides)


def test_an_empty_entry_of_a_path_list_is_refused():
    with pytest.raises(UserError, match=r"data.paths\[1\]='' is empty: every entry must be an orthros-data output"):
        compose_recipe("tiny_cpu", *SMALL, "data.source=indexed", "++data.paths=[a,'']")


@pytest.mark.parametrize("module, parser, argv, flag", [
    ("orthros_train.study.cli", "build_parser", ["--out", ""], "--out"),
    ("orthros_train.study.cli", "build_parser", ["--notes", " "], "--notes"),
    ("data_tools.cli", "build_parser", ["tokenize", "in.txt", "--tokenizer", "t", "--output", ""], "--output"),
    ("data_tools.cli", "build_parser", ["tokenize", "", "--tokenizer", "t", "--output", "o"], "INPUT"),
    ("orthros_train.convert.cli", "_parser", ["to-hf", "src", " "], "dst"),
    ("orthros_train.eval.cli", "build_parser", ["ppl", "", "essays.txt"], "checkpoint"),
    ("orthros_train.eval.cli", "build_parser", ["ppl", "ckpt", " "], "data"),
    ("orthros_train.eval.cli", "build_parser", ["niah", "ckpt", "--output-dir", ""], "--output-dir"),
    ("orthros_train.eval.cli", "build_parser", ["bench-prefill", " "], "model"),
])  # fmt: skip
def test_an_empty_path_flag_is_a_usage_error_naming_the_flag(capsys, module, parser, argv, flag):
    """Path('') is the current directory: a study, a tokenized output or an export would land there."""
    import importlib

    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), parser)().parse_args(argv)
    assert exit_.value.code == 2
    assert re.search(rf"argument {flag}: '\s*' is empty: give a path", capsys.readouterr().err)


@pytest.mark.parametrize("atol", ["nan", "inf", "-1", "tight"])
def test_a_verify_tolerance_that_is_not_a_finite_number_at_least_0_is_a_usage_error(capsys, atol):
    """``max_abs_diff > nan`` is false: --atol nan passed an export whose logits differ."""
    from orthros_train.convert.cli import _parser

    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["verify", "hf", "ckpt", "--atol", atol])
    assert exit_.value.code == 2
    assert re.search(rf"argument --atol: '{atol}'(: the tolerance must be a finite number >= 0| is not a number)",
                     capsys.readouterr().err)
    assert _parser().parse_args(["verify", "hf", "ckpt", "--atol", "0"]).atol == 0.0
