"""Distillation from the dense twin (orthros_train/train/distill.py): the loss, the trainer's run
with its logged terms, the teacher's identity on resume, the refusals, the memory model."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from fixtures import (
    TINY_TEST_RUN,
    by_step,
    compose_recipe,
    finish,
    metrics,
    resolved_recipe,
    run_train,
    start_tiny_run,
    tiny_config,
    tiny_model,
    trainer_for,
)

from orthros_train.errors import UserError
from orthros_train.model import OrthrosForCausalLM
from orthros_train.options import DistillAlign
from orthros_train.phase.builders import pretrain_layout
from orthros_train.phase.layout import IGNORE_INDEX
from orthros_train.train.distill import Distillation, Teacher
from orthros_train.train.teacher import teacher_identity
from orthros_train.train.trainer import LOST_NODE_EXIT_CODE

# tiny_cpu at test size with a window of 16 in sequences of 64: three quarters of the positions
# lie beyond the window, where the student and its dense teacher differ.
DISTILL_RUN = (*TINY_TEST_RUN, "model.sliding_window=16")


def distill(*keys: str) -> tuple[str, ...]:
    """Overrides that switch distillation on (tiny_cpu has no distill section: ``+``)."""
    return ("+distill.enabled=true", *(f"+distill.{k}" for k in keys))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A tiny_cpu model at test size exported with its tokenizer, as orthros-convert from-hf
    leaves a converted checkpoint: the student starts from it and the teacher is its dense twin."""
    from orthros_train.parallel.setup import destroy_parallel

    tmp = tmp_path_factory.mktemp("teacher")
    trainer = trainer_for(resolved_recipe("tiny_cpu", *DISTILL_RUN, f"trainer.run_dir={tmp / 'run'}"))
    try:
        return trainer.export("teacher")
    finally:
        trainer.close()
        destroy_parallel()


def _make(tmp: Path, *overrides: str):
    from orthros_train.parallel.setup import destroy_parallel

    destroy_parallel()
    return trainer_for(resolved_recipe("tiny_cpu", *DISTILL_RUN, *overrides, f"trainer.run_dir={tmp}"))


def _fit(tmp: Path, *overrides: str) -> list[dict]:
    trainer = _make(tmp, *overrides)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return metrics(tmp)


# -- the loss -------------------------------------------------------------------------------------------


def _objective(student: OrthrosForCausalLM, teacher: OrthrosForCausalLM, window: int, **distill) -> Distillation:
    cfg = types.SimpleNamespace(
        distill=types.SimpleNamespace(align=DistillAlign.none, align_steps=0, align_weight=1.0, **distill),
        model=types.SimpleNamespace(sliding_window=window), data=types.SimpleNamespace(loss_average="token"),
    )
    objective = Distillation(cfg, student, Teacher(teacher, {"path": "-", "sha256": "-"}), torch.device("cpu"))
    objective.begin_step(0, [])
    return objective


@pytest.mark.parametrize("alpha,temperature,beyond", [(0.3, 1.0, False), (0.7, 2.0, True), (1.0, 0.5, False)])
def test_loss_matches_a_hand_computation(alpha, temperature, beyond):
    """(1 - a) CE + a T^2 KL(teacher || student) at T, per token, weighted like the CE (loss weights,
    ignored labels, the step's normaliser), the KD term only beyond W when asked."""
    window = 8
    student = tiny_model(sliding_window=window, output_affine="nudged").double()
    teacher = tiny_model(sliding_window=window, attention_type="dense", seed=1).double()  # another model: a real KL
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    layout = pretrain_layout(ids)
    generator = torch.Generator().manual_seed(1)
    layout.loss_weights = torch.rand(layout.num_outputs, generator=generator, dtype=torch.float64)
    layout.labels[::5] = IGNORE_INDEX
    normalizer = 17.0

    objective = _objective(student, teacher, window, alpha=alpha, temperature=temperature, beyond_window_only=beyond)
    engine = lambda lay, loss_normalizer: student(lay, loss_normalizer=loss_normalizer)  # noqa: E731
    got = objective.forward(engine, layout, normalizer).loss

    s = student.forward_layout(layout).logits
    with torch.no_grad():
        t = teacher.forward_layout(layout).logits
    valid = layout.labels != IGNORE_INDEX
    ce = F.cross_entropy(s, layout.labels.clamp(min=0), reduction="none")
    p = torch.softmax(t / temperature, -1)
    kl = (p * (p.log() - torch.log_softmax(s / temperature, -1))).sum(-1)
    w = layout.loss_weights * valid
    kd_w = w * (layout.positions[layout.output_index] >= window) if beyond else w
    expected = ((1 - alpha) * (w * ce).sum() + alpha * temperature**2 * (kd_w * kl).sum()) / normalizer
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)  # the loss is computed in fp32
    assert got.requires_grad  # the KD term trains the student


def test_the_teacher_is_frozen_and_the_kl_to_itself_is_zero():
    """The dense twin of a model at W >= T is the model: no KL; the teacher has no gradients."""
    student = tiny_model(sliding_window=32)
    twin = OrthrosForCausalLM(tiny_config(sliding_window=32, attention_type="dense"))
    twin.load_state_dict(student.state_dict())
    objective = _objective(student, twin, 32, alpha=1.0, temperature=1.0, beyond_window_only=False)
    layout = pretrain_layout(torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(2)))
    loss = objective.forward(lambda lay, loss_normalizer: student(lay, loss_normalizer=loss_normalizer), layout, 24.0)
    assert abs(float(loss.loss.detach())) < 1e-6
    assert not any(p.requires_grad for p in objective.teacher.model.parameters())
    assert not objective.teacher.model.training


def test_the_blockwise_kl_equals_the_whole_one_with_its_gradient(monkeypatch):
    """The KL is computed block by block of rows and recomputed in the backward (memory): same value
    and gradient as in one piece."""
    import orthros_train.train.distill as distill_module

    gen = torch.Generator().manual_seed(3)
    teacher, student = torch.randn(37, 50, generator=gen), torch.randn(37, 50, generator=gen)
    whole_in, block_in = student.clone().requires_grad_(), student.clone().requires_grad_()
    whole = distill_module.token_kl(teacher, whole_in, 2.0)
    monkeypatch.setattr(distill_module, "KL_BLOCK_BYTES", 4 * 50 * 8)  # blocks of 8 rows
    blocks = distill_module.chunked_token_kl(teacher, block_in, 2.0)
    torch.testing.assert_close(blocks, whole)
    (whole * torch.arange(37.0)).sum().backward()
    (blocks * torch.arange(37.0)).sum().backward()
    torch.testing.assert_close(block_in.grad, whole_in.grad)


# -- the trainer -----------------------------------------------------------------------------------------


def test_alpha_zero_is_plain_cross_entropy_bitwise(teacher_dir, tmp_path):
    init = f"model.init_from={teacher_dir}"
    plain = _fit(tmp_path / "plain", init, "trainer.max_steps=2")
    zero = _fit(tmp_path / "zero", init, "trainer.max_steps=2", *distill("alpha=0"))
    assert [r["loss"] for r in plain] == [r["loss"] for r in zero]  # bitwise
    assert [r["loss"] for r in zero] == [r["ce_loss"] for r in zero]
    assert all(r["kl_beyond_w"] > 0 and r["kd_loss"] > 0 for r in zero)  # measured, not trained on


def test_a_distillation_run_trains_and_logs_its_terms(teacher_dir, tmp_path):
    run = tmp_path / "run"
    keys = ("alpha=0.5", "temperature=2.0", "align=mse", "align_steps=1", "align_weight=3.0")
    records = _fit(run, f"model.init_from={teacher_dir}", "trainer.max_steps=2", *distill(*keys))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"ce_loss", "kd_loss", "kl_beyond_w"} <= set(r) and r["grad_norm"] > 0
        align = 3.0 * r.get("align_loss", 0.0)
        assert r["loss"] == pytest.approx(0.5 * r["ce_loss"] + 0.5 * 4.0 * r["kd_loss"] + align, rel=1e-5)
    assert records[0]["align_loss"] > 0 and "align_loss" not in records[1]  # the stage is the first step
    meta = json.loads((run / "checkpoints" / "step_000000002" / "meta.json").read_text())
    assert meta["teacher"] == teacher_identity(teacher_dir)  # recorded, not saved
    assert not any("teacher" in p.name for p in (run / "checkpoints" / "step_000000002").rglob("*"))


def test_a_changed_teacher_is_refused_on_resume(teacher_dir, tmp_path):
    teacher = shutil.copytree(teacher_dir, tmp_path / "teacher")
    run = tmp_path / "run"
    overrides = (f"model.init_from={teacher_dir}", *distill(f"teacher={teacher}"))
    _fit(run, *overrides, "trainer.max_steps=1")
    weights = teacher / "model.safetensors"
    state = safetensors.torch.load_file(str(weights))
    state["norm.weight"] = state["norm.weight"] * 1.01  # retrained: same shapes, other values
    safetensors.torch.save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"distill.teacher=.*has changed since checkpoint .*step_000000001"):
        _make(run, *overrides, "trainer.max_steps=2")


# -- refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("+distill.alpha=0.5",), r"distill.alpha=0.5 set but distill.enabled=false"),
        (("+distill.enabled=false", "+distill.teacher=x"), r"distill.teacher=x set but distill.enabled=false"),
        (distill(), r"distill.enabled=true but there is no teacher: set distill.teacher=PATH"),
        (distill("teacher=t", "alpha=1.5"), r"distill.alpha=1.5 must lie in \[0, 1\]"),
        (distill("teacher=t", "alpha=-0.1"), r"distill.alpha=-0.1 must lie in \[0, 1\]"),
        (distill("teacher=t", "temperature=0"), r"distill.temperature=0.0 must be a finite number > 0"),
        (distill("teacher=t", "temperature=nan"), r"distill.temperature=nan.* finite number"),
        (distill("teacher=t", "temperature=inf"), r"distill.temperature=inf.* finite number"),
        (distill("teacher=t", "align=mse"), r"distill.align=mse needs distill.align_steps >= 1"),
        (distill("teacher=t", "align_steps=3"), r"distill.align_steps / .* set but distill.align=none"),
        (distill("teacher=t", "align=l1", "align_steps=3"), r"distill.align"),
    ],
)
def test_bad_distill_keys_are_refused_naming_them(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_recipe("tiny_cpu", *overrides)


def _teacher_copy(teacher_dir: Path, tmp_path: Path) -> Path:
    return shutil.copytree(teacher_dir, tmp_path / "teacher")


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(teacher_dir, tmp_path):
    teacher = _teacher_copy(teacher_dir, tmp_path)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    with pytest.raises(UserError, match=r"teacher's vocab_size is 4096 .*student's is 2048 \(model.vocab_size\)"):
        _make(tmp_path / "run", *distill(f"teacher={teacher}"))
    assert not (tmp_path / "run").exists()  # refused before the run directory is touched


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(teacher_dir, tmp_path, bpe_tokenizer_dir):
    teacher = _teacher_copy(teacher_dir, tmp_path)
    for f in teacher.glob("*token*"):
        f.unlink()
    other = Path(bpe_tokenizer_dir(vocab_size=2048))
    for f in other.iterdir():
        shutil.copy(f, teacher / f.name)
    with pytest.raises(UserError, match=r"the teacher's tokenizer \(distill.teacher=.*\) differs from the student's "
                                        r"\(data.tokenizer_vocab_size=2048"):
        _make(tmp_path / "run", *distill(f"teacher={teacher}"))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_missing_teacher_is_one_line_and_nothing_is_written(tmp_path):
    run = tmp_path / "run"
    proc = run_train("--config-name", "tiny_cpu", *DISTILL_RUN, f"trainer.run_dir={run}",
                     *distill(f"teacher={tmp_path / 'nowhere'}"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if "distill.teacher" in x]
    assert len(lines) == 1 and "is not an Orthros checkpoint directory (it does not exist)" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p.name for p in run.iterdir()} <= {".hydra", "cli.log"}  # Hydra's record of the command only


# -- memory model and dry run ----------------------------------------------------------------------------


def test_the_memory_model_counts_the_teacher():
    from orthros_train.parallel.setup import ParallelConfig
    from orthros_train.train.memory import estimate_memory, params_per_rank

    cfg = tiny_config(vocab_size=1000, hidden_size=64, sliding_window=16)
    twin = tiny_config(vocab_size=1000, hidden_size=64, sliding_window=16, attention_type="dense")
    for stage in (0, 3):
        layout = ParallelConfig(data_parallel=4, zero_stage=stage)
        plain = estimate_memory(cfg, layout, 256, 2, "bf16")
        with_teacher = estimate_memory(cfg, layout, 256, 2, "bf16", teacher=twin)
        assert plain.teacher == 0
        assert with_teacher.total - plain.total == with_teacher.teacher
        # replicated under every ZeRO stage: the whole TP shard in bf16, plus its logits for the KL
        assert with_teacher.teacher >= params_per_rank(twin, 1) * 2 + 2 * 256 * 1000 * (2 + 12)
        aligned = estimate_memory(cfg, layout, 256, 2, "bf16", teacher=twin, teacher_align=True)
        assert aligned.teacher - with_teacher.teacher == (cfg.num_hidden_layers - 1) * 512 * 64 * 2


def test_the_8b_conversion_dry_run_plans_the_teacher_and_still_fits():
    from orthros_train.train.plan import plan_summary

    plain = plan_summary(compose_recipe("convert_llama31_8b"))
    planned = plan_summary(compose_recipe("convert_llama31_8b", "distill=dense_twin", "distill.align=mse",
                                          "distill.align_steps=200"))  # fmt: skip
    memory = planned["memory_per_gpu"]
    assert memory["stages"][0]["teacher"] > 0 and memory["device"]["fits_with_headroom"]
    assert planned["distill"]["teacher"] == "checkpoints/llama31_8b-orthros-w128"  # model.init_from
    assert planned["distill"]["teacher_parameters"] == planned["parameters"]
    extra = planned["distill"]["teacher_flops_per_token"]
    assert planned["flops_per_token"] == pytest.approx(plain["flops_per_token"] + extra)
    assert 0.1 < extra / plain["flops_per_token"] < 0.5  # one forward of a dense 8B at 32K beside a training step


def test_sink_tokens_add_base_attention_work_but_no_memory():
    from orthros_train.train.plan import plan_summary

    plain = plan_summary(compose_recipe("convert_llama31_8b", "model.sink_tokens=0"))
    sinks = plan_summary(compose_recipe("convert_llama31_8b", "model.sink_tokens=4"))
    assert sinks["sink_tokens"] == 4 and sinks["base_attention_work"] == 1 + 4 / 128
    assert sinks["flops_per_token"] > plain["flops_per_token"]
    kv = [[s["kv"] for s in p["memory_per_gpu"]["stages"]] for p in (plain, sinks)]
    assert kv[0] == kv[1]  # the sinks are the cache's first entries


# -- slow: kill -9 and tensor parallelism ---------------------------------------------------------------


@pytest.mark.slow
def test_distillation_run_lost_mid_run_resumes_bitwise(teacher_dir, tmp_path):
    # trainer.fail_at_step ends the process with os._exit after step 5 (no cleanup, no finalisers: what
    # kill -9 leaves), so the loss lands mid-run however loaded the machine is; a SIGKILL timed from
    # outside could arrive after a six-step tiny run had already finished. The synchronous save of step 4
    # is the one to resume from, past the end of the alignment stage.
    steps = (*distill("alpha=0.5", "temperature=2.0", "align=cosine", "align_steps=2"),
             f"model.init_from={teacher_dir}", "model.sliding_window=16", "trainer.max_steps=6",
             "trainer.save_every=2", "trainer.async_save=false")  # fmt: skip
    straight = tmp_path / "straight"
    rc, _, err = finish(start_tiny_run(*steps, f"trainer.run_dir={straight}", cwd=tmp_path))
    assert rc == 0, err[-3000:]
    run = tmp_path / "killed"
    rc, _, err = finish(start_tiny_run(*steps, "trainer.fail_at_step=5", f"trainer.run_dir={run}", cwd=tmp_path))
    assert rc == LOST_NODE_EXIT_CODE, err[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000000004"
    rc, out, err = finish(start_tiny_run(*steps, f"trainer.run_dir={run}", cwd=tmp_path))
    assert rc == 0, err[-3000:]
    assert "resumed from" in out + err and "step_000000004" in out + err
    for key in ("loss", "ce_loss", "kd_loss", "kl_beyond_w"):
        assert by_step(straight, key) == by_step(run, key), key  # bitwise


# Two steps, the alignment stage the first: every term of the loss is compared.
PARALLEL_DISTILL = (*distill("alpha=0.5", "temperature=2.0", "align=mse", "align_steps=1"), "model.sliding_window=16",
                    "trainer.max_steps=2")  # fmt: skip


@pytest.fixture(scope="module")
def one_process_distillation(teacher_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    proc = start_tiny_run(*PARALLEL_DISTILL, f"model.init_from={teacher_dir}", f"trainer.run_dir={run}", cwd=run.parent)
    rc, _, err = finish(proc)
    assert rc == 0, err[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [("parallel.tensor_parallel=2", "parallel.sequence_parallel=true", "parallel.zero_stage=0"),
     ("parallel.context_parallel=2", "parallel.zero_stage=1")],
    ids=["tp2_sp", "cp2"],
)
def test_parallel_distillation_equals_one_process(one_process_distillation, teacher_dir, tmp_path, layout):
    """The teacher sharded like the student (TP/SP: vocab-parallel KL; CP: the same ContextPlan)."""
    run = tmp_path / "run"
    proc = start_tiny_run(*PARALLEL_DISTILL, f"model.init_from={teacher_dir}", f"trainer.run_dir={run}", *layout,
                          cwd=tmp_path, nproc=2)  # fmt: skip
    rc, _, err = finish(proc)
    assert rc == 0, err[-3000:]
    # The KL terms are small differences of fp32 log-probabilities (~1e-6..1e-4 here): another
    # summation order moves them by ~1e-8 absolute. A wrong gradient shows in step 2's losses.
    tolerance = {"kd_loss": 1e-7, "kl_beyond_w": 1e-7}
    bad = []
    for key in ("loss", "ce_loss", "kd_loss", "kl_beyond_w", "align_loss"):
        a = {r["step"]: r[key] for r in metrics(one_process_distillation) if key in r}
        b = {r["step"]: r[key] for r in metrics(run) if key in r}
        assert a.keys() == b.keys() and a, key
        if not all(b[s] == pytest.approx(a[s], rel=1e-5, abs=tolerance.get(key, 0)) for s in a):
            bad.append((key, a, b))
    assert not bad, bad
