"""One directory per run: multirun jobs get their own, a resume must be the same run, a finished
run re-launched says it is complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import QUIET_RUN, SMALL_TINY_CPU, metrics, run_train, start_train

from orthros_train.errors import UserError
from orthros_train.train.run_dir import check_fresh_start, check_resume, multirun_job_dir, recipe_changes

RECIPE = {
    "model": {"hidden_size": 64, "sliding_window": 128, "attention_backend": "auto"},
    "data": {"source": "embedded", "tokenizer": None, "cache_dir": "~/.cache/a"},
    "optim": {"lr": 3e-3},
    "trainer": {"max_steps": 10, "seq_len": 64, "micro_batch_size": 2, "grad_accum_steps": 1, "log_every": 5},
    "parallel": {"data_parallel": 1, "tensor_parallel": 1},
}


def _changed(**changes: object) -> dict:
    recipe = json.loads(json.dumps(RECIPE))
    for key, value in changes.items():
        section, name = key.split("__")
        recipe[section][name] = value
    return recipe


def _checkpoint(tmp_path: Path, recipe: dict) -> Path:
    ckpt = tmp_path / "checkpoints" / "step_000000010"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 10, "recipe": recipe}))
    return ckpt


def test_another_model_data_or_tokenizer_is_refused_naming_each_key(tmp_path):
    ckpt = _checkpoint(tmp_path, RECIPE)
    other = _changed(model__sliding_window=32, data__tokenizer="/tok")
    for mode in ("refuse", "allow"):
        with pytest.raises(UserError) as err:
            check_resume(ckpt, other, mode)
        message = str(err.value)
        assert "model.sliding_window: 128 in the checkpoint, 32 now" in message
        assert "data.tokenizer: None in the checkpoint, '/tok' now" in message
        assert "trainer.run_dir" in message and "model.init_from" in message


def test_a_new_learning_rate_needs_resume_changes_allow_and_is_logged(tmp_path):
    ckpt = _checkpoint(tmp_path, RECIPE)
    other = _changed(optim__lr=1e-3)
    with pytest.raises(UserError, match=r"optim.lr: 0.003 in the checkpoint, 0.001 now.*resume_changes=allow"):
        check_resume(ckpt, other, "refuse")
    assert check_resume(ckpt, other, "allow") == ["resume: optim.lr: 0.003 in the checkpoint, 0.001 now"]


def test_layout_logging_and_a_longer_run_resume_freely():
    same_tokens = _changed(
        trainer__micro_batch_size=1, trainer__grad_accum_steps=2, trainer__log_every=1, trainer__max_steps=20
    )
    same_tokens["parallel"]["tensor_parallel"] = 2
    same_tokens["data"]["cache_dir"] = "/elsewhere"
    kinds = recipe_changes(RECIPE, same_tokens)
    assert kinds["identity"] == [] and kinds["training"] == []
    assert kinds["noted"] == ["trainer.max_steps: 10 in the checkpoint, 20 now"]
    # The same micro batch on twice the data-parallel ranks is another batch: tokens per step differ.
    more = _changed()
    more["parallel"]["data_parallel"] = 2
    assert recipe_changes(RECIPE, more)["training"] == ["tokens per step: 128 in the checkpoint, 256 now"]


def test_a_recorded_global_batch_counts_as_the_tokens_per_step():
    old = _changed()  # saved before the geometry was recorded: micro x accum x DP
    new = _changed(trainer__micro_batch_size=1, trainer__grad_accum_steps=None)
    new["trainer"]["global_batch_size"] = 2
    new["parallel"]["data_parallel"] = None
    assert recipe_changes(old, new)["training"] == []
    new["trainer"]["global_batch_size"] = 4
    assert recipe_changes(old, new)["training"] == ["tokens per step: 128 in the checkpoint, 256 now"]


def test_a_fresh_start_over_an_existing_run_needs_overwrite(tmp_path):
    assert check_fresh_start(tmp_path, "none", False) == []  # empty: nothing to protect
    _checkpoint(tmp_path, RECIPE)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    refused = r"already holds a run .*trainer.resume=none starts afresh.*trainer.overwrite=true"
    with pytest.raises(UserError, match=refused):
        check_fresh_start(tmp_path, "none", False)
    other = tmp_path.parent / "other_ckpt"
    with pytest.raises(UserError, match="starts from another run's checkpoint"):
        check_fresh_start(tmp_path, str(other), False)
    own = tmp_path / "checkpoints" / "step_000000010"
    assert check_fresh_start(tmp_path, str(own), False) == []  # its own checkpoint: a resume
    assert check_fresh_start(tmp_path, "auto", False) == []
    assert check_fresh_start(tmp_path, "none", True) == [str(tmp_path / "checkpoints"), str(tmp_path / "metrics.jsonl")]


def test_long_multirun_names_keep_jobs_apart():
    long = [f"model.key_{i}=value_{i}" for i in range(30)]
    assert multirun_job_dir("r", long, 0) != multirun_job_dir("r", long[:-1] + ["model.key_29=other"], 1)


def test_multirun_job_dirs_are_named_by_their_overrides():
    assert multirun_job_dir("runs/tiny_cpu", ["optim.lr=1e-3", "data.paths=[a/b]"], 0) == (
        "runs/tiny_cpu/data.paths__a_b___optim.lr_1e-3"
    )
    assert multirun_job_dir("runs/tiny_cpu", [], 3) == "runs/tiny_cpu/job3"


# Two steps of tiny_cpu at test size, warming up over the first.
TINY = ["--config-name", "tiny_cpu", *SMALL_TINY_CPU, *QUIET_RUN, "trainer.max_steps=2", "optim.warmup_steps=1"]


@pytest.mark.slow
def test_multirun_jobs_train_in_their_own_dirs_and_a_finished_run_says_it_is_complete(tmp_path):
    proc = run_train("-m", *TINY, "optim.lr=1e-3,3e-3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = tmp_path / "runs" / "tiny_cpu"
    assert sorted(p.name for p in runs.iterdir()) == ["optim.lr_0.001", "optim.lr_0.003"]  # the swept key only
    for job in runs.iterdir():
        records = (job / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in records] == [1, 2]  # each job trained, none resumed the other
    one = [*TINY, "optim.lr=1e-3", f"trainer.run_dir={runs / 'optim.lr_0.001'}"]
    again = run_train(*one, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is complete" in again.stdout and "resumed from" not in again.stdout
    assert len((runs / "optim.lr_0.001" / "metrics.jsonl").read_text().splitlines()) == 2  # nothing retrained
    window = run_train(*one, "model.sliding_window=32", cwd=tmp_path)
    assert window.returncode != 0 and "model.sliding_window: 64 in the checkpoint, 32 now" in window.stderr
    longer = run_train(*one, "trainer.max_steps=3", "optim.lr=2e-3", "trainer.resume_changes=allow", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resume: optim.lr: 0.001 in the checkpoint, 0.002 now" in longer.stderr
    assert "resumed from" in longer.stdout


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in metrics(run)]


@pytest.mark.slow
def test_two_concurrent_launches_into_one_dir_leave_one_clean_run(tmp_path):
    import signal
    import socket
    import time

    from orthros_train.train.checkpoint import verify_checkpoint

    run = tmp_path / "run"
    args = [*TINY, "trainer.max_steps=100000", "trainer.save_every=5", f"trainer.run_dir={run}"]
    first = start_train(*args, cwd=tmp_path)
    deadline = time.time() + 600
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()) and time.time() < deadline:
        assert first.poll() is None, first.stderr.read()[-3000:]
        time.sleep(0.2)
    second = run_train(*args, cwd=tmp_path)  # a duplicated job: the same command into the same directory
    assert second.returncode == 1, second.stderr[-3000:]
    assert "is in use by another run" in second.stderr
    assert f"host {socket.gethostname()}, pid {first.pid}, started " in second.stderr
    assert "Traceback" not in second.stderr and "resumed from" not in second.stdout
    assert first.poll() is None  # the first run goes on
    first.send_signal(signal.SIGTERM)  # and ends with its own checkpoint
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, err[-3000:]
    steps = _steps(run)
    assert steps == list(range(1, len(steps) + 1))  # one run's metrics, not interleaved
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == f"step_{steps[-1]:09d}" and verify_checkpoint(latest) is None
    assert json.loads((latest / "meta.json").read_text())["recipe"] == json.loads((run / "recipe.json").read_text())
    assert not (run / "run.lock").exists()  # released at exit


@pytest.mark.slow
def test_resume_none_in_a_finished_run_is_refused_unless_overwrite(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, f"trainer.run_dir={run}"]
    assert run_train(*args, cwd=tmp_path).returncode == 0
    before = (run / "checkpoints" / "final" / "model.safetensors").read_bytes()
    again = run_train(*args, "trainer.resume=none", cwd=tmp_path)
    assert again.returncode == 1 and "already holds a run" in again.stderr and "trainer.overwrite=true" in again.stderr
    assert "Traceback" not in again.stderr
    assert (run / "checkpoints" / "final" / "model.safetensors").read_bytes() == before  # untouched
    assert _steps(run) == [1, 2]
    fresh = run_train(*args, "trainer.resume=none", "trainer.overwrite=true", "optim.lr=1e-3", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "deleting the previous run's" in fresh.stderr
    assert _steps(run) == [1, 2]  # the new run's log only
    assert json.loads((run / "recipe.json").read_text())["optim"]["lr"] == 1e-3


@pytest.mark.slow
def test_multirun_with_an_explicit_run_dir_gives_every_job_its_own(tmp_path):
    base = tmp_path / "sweep"
    proc = run_train("-m", *TINY, f"trainer.run_dir={base}", "optim.lr=1e-3,3e-3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in base.iterdir()) == ["optim.lr_0.001", "optim.lr_0.003"]
    for job in base.iterdir():
        assert _steps(job) == [1, 2]  # each trained; none was refused or "complete"
    assert "changed recipe" not in proc.stderr and "is complete" not in proc.stdout


def test_an_unwritable_run_dir_is_a_clear_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_train(*TINY, f"trainer.run_dir={blocker / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert f"trainer.run_dir={blocker / 'run'} cannot be written (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stderr
