"""Studies own their runs (``orthros_train/study/runs.py``): one study per --out, finished runs reused,
partial ones resumed, runs of another command refused, children stopped on SIGTERM, failures in one
line, bad flags refused before anything is written. A fake trainer (a few lines of Python that
writes what the real one does) keeps these fast; one slow test goes through the real trainer."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orthros_train.errors import UserError
from orthros_train.study.runs import RunFailed, run_state, train_or_reuse

REPO = Path(__file__).resolve().parents[1]

# What the real trainer leaves that the study reads: recipe.json (max_steps), checkpoints/step_*/meta.json,
# checkpoints/latest, checkpoints/final/{config.json,*.safetensors}; it resumes from latest and saves on SIGTERM.
FAKE_TRAINER = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path
    run, steps = Path(sys.argv[1]), int(sys.argv[2])
    with (run / "pids").open("a") as f:
        f.write(f"{os.getpid()}\\n")
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    ck = run / "checkpoints"
    start = json.loads((ck / (ck / "latest").read_text() / "meta.json").read_text())["step"] \\
        if (ck / "latest").is_file() else 0
    (run / "recipe.json").write_text(json.dumps({"trainer": {"max_steps": steps}}))
    if "fail" in sys.argv:
        print("Traceback (most recent call last):\\nValueError: boom", flush=True)
        sys.exit(1)
    def save(step):
        d = ck / f"step_{step:09d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "meta.json").write_text(json.dumps({"step": step}))
        (ck / "latest").write_text(d.name)
    for step in range(start + 1, steps + 1):
        time.sleep(0.01)
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step}) + "\\n")
        if stop:
            save(step)
            sys.exit(0)
    save(steps)
    (ck / "final").mkdir()
    (ck / "final" / "config.json").write_text("{}")
    (ck / "final" / "model.safetensors").write_text("")
''')

# A study in a process of its own: two fake runs, two at a time, owning --out (argv: out, steps).
DRIVER = textwrap.dedent('''
    import sys
    from pathlib import Path
    from orthros_train.errors import UserError
    from orthros_train.study.runs import StudyInterrupted, interrupted_exit, owned_study, run_parallel, train_or_reuse
    out, steps, fake = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    jobs = [([sys.executable, fake, str(out / name), steps], out / name, print) for name in ("a", "b")]
    try:
        with owned_study(out, "study"):
            run_parallel(train_or_reuse, jobs, 2)
    except StudyInterrupted as exc:
        sys.exit(interrupted_exit("driver", exc, out))
    except UserError as exc:  # as the CLI does (study/cli.py: run_owned)
        print(f"driver: {exc}", file=sys.stderr)
        sys.exit(2)
''')


@pytest.fixture
def fake(tmp_path) -> Path:
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE_TRAINER)
    return path


def _cmd(fake: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(fake), str(run_dir), str(steps), *extra]


def _pids(run_dir: Path) -> list[int]:
    path = run_dir / "pids"
    return [int(x) for x in path.read_text().split()] if path.is_file() else []


def test_a_finished_run_is_reused_another_command_refused_overwrite_retrains(fake, tmp_path) -> None:
    run = tmp_path / "out" / "run"
    train_or_reuse(_cmd(fake, run, 5), run, log=lambda m: None)
    assert run_state(run, _cmd(fake, run, 5)[1:]) == "finished" and len(_pids(run)) == 1
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != "train.log"}
    logged: list[str] = []
    train_or_reuse(_cmd(fake, run, 5), run, log=logged.append)  # the rerun: nothing trained, nothing deleted
    assert len(_pids(run)) == 1 and logged == [f"reuse {run}: finished with the same command"]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != "train.log"} == before
    with pytest.raises(UserError, match=f"{run} holds a run of another configuration .*pass --overwrite"):
        train_or_reuse(_cmd(fake, run, 7), run, log=lambda m: None)
    assert len(_pids(run)) == 1  # refused before anything started
    train_or_reuse(_cmd(fake, run, 7), run, log=lambda m: None, overwrite=True)
    assert len(_pids(run)) == 1 and run_state(run, _cmd(fake, run, 7)[1:]) == "finished"  # a new run
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a study run directory"):
        train_or_reuse(_cmd(fake, tmp_path / "other", 3), tmp_path / "other", log=lambda m: None)


def test_a_failed_child_is_one_line_naming_the_run_and_its_log(fake, tmp_path) -> None:
    run = tmp_path / "run"
    with pytest.raises(RunFailed) as err:
        train_or_reuse(_cmd(fake, run, 3, "fail"), run, log=lambda m: None)
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    assert f"training run {run} failed (exit 1: ValueError: boom)" in text and str(run / "train.log") in text


def test_sigterm_stops_every_child_and_a_rerun_resumes(fake, tmp_path) -> None:
    out = tmp_path / "out"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(driver), str(out), "600", str(fake)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not all((out / n / "metrics.jsonl").is_file() for n in "ab"):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    # A second study into the same --out is refused in one line while the first holds it.

    second = subprocess.run([sys.executable, str(driver), str(out), "600", str(fake)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1
    assert f"--out {out} is in use by another study (host" in second.stderr
    children = [p for n in "ab" for p in _pids(out / n)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and len(err.strip().splitlines()) == 1 and "stopped by SIGTERM" in err
    for pid in children:  # no orphan: every child was stopped and waited for
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    saved = {n: len((out / n / "metrics.jsonl").read_text().splitlines()) for n in "ab"}
    assert all(0 < s < 600 for s in saved.values())
    assert not (out / "run.lock").exists()
    # The rerun resumes both runs where they stopped (the trainer saved on SIGTERM) and finishes them.
    rerun = subprocess.run([sys.executable, str(driver), str(out), "600", str(fake)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    for n in "ab":
        steps = [json.loads(line)["step"] for line in (out / n / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 601)) and len(_pids(out / n)) == 2


STUDY_REFUSALS = [
    (["--lrs", "nan"], "every rate must be a finite number > 0"),
    (["--lrs", "1e-3,-1"], "every rate must be a finite number > 0"),
    (["--seeds", "1,1"], "repeats a seed"),
    (["--archs", ","], "--archs needs at least one model"),
    (["--overwrite", "--skip-train"], "cannot go with --skip-train"),
]
CONVERSION_REFUSALS = [
    (["--frozen", "0.04", "--steps", "10"], "--frozen 0.04 of 10 steps rounds to 0 steps"),
    (["--warmups", "0.01"], "--warmups 0.01 of 10 steps rounds to 0 steps"),
    (["--frozen", "inf"], "must lie in [0, 1)"),
    (["--affine-noise", "nan"], "--affine-noise must be a finite number >= 0"),
    (["--affine-noise", "-0.1"], "--affine-noise must be a finite number >= 0"),
    (["--lrs", "inf"], "every rate must be a finite number > 0"),
    (["--lrs", "0"], "every rate must be a finite number > 0"),
    (["--lrs", "3e3"], "and at most 1 (3000 is not)"),
    (["--seeds", "2,3,2"], "repeats a seed"),
    (["--smollm2-minutes", "nan"], "--smollm2-minutes must be a finite number > 0"),
]


@pytest.mark.parametrize(("args", "needle"), STUDY_REFUSALS + [(["conversion", "--quick", *a], n)
                                                               for a, n in CONVERSION_REFUSALS])
def test_bad_numbers_are_refused_in_one_line_before_anything_is_written(tmp_path, capsys, args, needle) -> None:
    from orthros_train.study.cli import main

    out = tmp_path / "out"
    assert main([*args[:2], "--out", str(out), *args[2:]] if args[0] == "conversion" else
                [*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and needle in err
    assert not out.exists()


def test_a_teacher_of_another_shape_is_refused(tmp_path, capsys) -> None:
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
    from orthros_train.study.cli import main

    cfg = OrthrosConfig(vocab_size=1024, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64, sliding_window=8, attention_type="dense")
    OrthrosForCausalLM(cfg).save_pretrained(tmp_path / "teacher")
    out = tmp_path / "out"
    assert main(["conversion", "--quick", "--out", str(out), "--teacher", str(tmp_path / "teacher")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hidden_size 48 (the study's 32)" in err
    assert "--override model.hidden_size=48" in err and not out.exists()


@pytest.mark.parametrize("content", ['{\n  "a": 1, oops\n}\n', ""], ids=["corrupt", "empty"])
def test_a_teacher_with_a_corrupt_config_json_names_it(tmp_path, capsys, content) -> None:
    from orthros_train.study.cli import main

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(content)
    (teacher / "model.safetensors").write_bytes(b"")
    out = tmp_path / "out"
    assert main(["conversion", "--quick", "--out", str(out), "--teacher", str(teacher)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--teacher" in err and "config.json is not valid JSON" in err
    assert not out.exists()


@pytest.mark.parametrize("args", [["reads", "--prompt", "0"], ["reads", "--prompt", "abc"],
                                  ["reads", "--new-tokens", "-1"], ["reads", "--batches", "0,1"],
                                  ["reads", "--batches", "x"], ["study", "--seeds", "1,x"],
                                  ["study", "--seeds", "1,1"], ["study", "--lr", "nan"], ["study", "--steps", "0"]])
def test_moe_bench_refuses_bad_numbers(tmp_path, capsys, args) -> None:
    spec = importlib.util.spec_from_file_location("moe_routing_bench", REPO / "bench" / "moe_routing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exc:
        bench.main([*args, *(["--out", str(tmp_path / "o")] if args[0] == "study" else [])])
    assert exc.value.code == 2 and f"argument {args[1]}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_real_quick_study_killed_resumes_and_a_rerun_retrains_nothing(tmp_path) -> None:
    """Through the real trainer: SIGTERM midway (exit 143, the trainer saved), the rerun resumes and
    finishes (and trains the sink arm), a third run reuses everything (no trainer starts, no checkpoint
    is rewritten)."""
    out = tmp_path / "s"
    argv = [sys.executable, "-m", "orthros_train.study.cli", "--quick", "--out", str(out),
            "--archs", "orthros,orthros_sinks", "--lrs", "3e-3", "--seeds", "1", "--steps", "400",
            "--recall-documents", "1", "--passkey-documents", "1", "--valid-tokens", "256", "--prefill-lengths", ""]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = out / "orthros" / "lr0.003-seed1"
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):
        time.sleep(0.5)
    child = json.loads((run / "run.lock").read_text())["pid"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err.strip().splitlines()[-1]
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
    assert (run / "checkpoints" / "latest").is_file() and not (run / "checkpoints" / "final").exists()
    assert subprocess.run(argv, env=env, capture_output=True, timeout=600).returncode == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 400 and len(set(steps)) == len(steps)  # resumed, not restarted
    runs = [p for arm in ("orthros", "orthros_sinks") for p in (out / arm).rglob("*")]
    before = {p: p.stat().st_mtime_ns for p in runs}
    third = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0 and f"reuse {run}" in third.stdout + third.stderr
    assert {p: p.stat().st_mtime_ns for p in runs} == before  # nothing trained, deleted or rewritten
    assert (out / "study.json").is_file() and (out / "study.md").is_file()
    # The from-scratch sink arm: the Orthros recipe with S = 4, beside S = 0, in the report.
    sinks = json.loads((out / "orthros_sinks" / "lr0.003-seed1" / "recipe.json").read_text())
    assert sinks["model"]["sink_tokens"] == 4 and sinks["model"]["attention_type"] == "orthros"
    assert set(json.loads((out / "study.json").read_text())["summary"]) == {"orthros", "orthros_sinks"}
    assert "Orthros, 4 sink tokens" in (out / "study.md").read_text()


def test_an_out_that_is_a_file_is_named_as_the_out_flag(tmp_path):
    from orthros_train.study.runs import owned_study

    target = tmp_path / "kitfile"
    target.write_text("not a folder")
    with pytest.raises(UserError, match=rf"^--out {target} is a file, not a directory: pick another --out$"):
        with owned_study(target, "study"):
            pass
    assert target.read_text() == "not a folder"
