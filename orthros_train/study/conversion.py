"""``orthros-study conversion``: converting a dense model into Orthros, at small scale (docs/conversion_study.md).

One dense teacher is trained from scratch (``recipes/study/dense.yaml``: the replication study's
shape and data blend). From that one checkpoint, on the same continued-training tokens:

* ``converted``: the teacher as an Orthros model, untrained (the conversion rule of
  ``orthros-convert from-hf``: every weight kept, the output-stream query affine ``gamma = 1,
  beta = 0``, so it equals the teacher on sequences of at most W tokens);
* ``orthros_continued``: the converted model trained on;
* ``dense_continued`` / ``sliding_continued``: the teacher trained on with dense attention, or
  with the base stream's window alone (the floor), for the same steps and tokens.

Before the seeds, a small sweep on the first seed picks the continued-training settings (the
learning rate and warm-up, then whether gamma/beta start away from 1/0 and whether the pretrained
weights are held for the first steps), by the trainer's held-out blend loss; dense and sliding
continue with the same rate and warm-up. The Orthros runs save checkpoints at the fractions of
the recovery curve. Optional sections: long-context extension (the Orthros model trained at L,
extended to ``factor x L`` with YaRN, continued briefly there; ``longctx``) and a real model,
SmolLM2-135M (``study/smollm2.py``).

``run_conversion_study`` is the list of stages; each returns a frozen record (``study/stages.py``), and
``conversion.json`` is made of those records in one place (``ConversionOutcome.to_json``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.study.pipeline import (
    QUICK_OVERRIDES,
    _log,
    check_seeds_and_rates,
    evaluate_checkpoint,
    load_average,
    loss_between,
    passkey_haystack_length,
    pick_lr,
    read_metrics,
    read_results,
    torch_threads,
    train_run,
)
from orthros_train.study.runs import remove_stale, run_parallel
from orthros_train.study.stages import (
    ArmEvaluation,
    Conversion,
    ConversionOutcome,
    CurvePoint,
    Curves,
    Evaluation,
    LongContext,
    RunFacts,
    SeedRuns,
    Setting,
    StudyEnd,
    StudyHeader,
    SweepResult,
    SweepRun,
    SweepScores,
    Teacher,
    TrainedRun,
)
from orthros_train.study.stages import summarize_arm as summarize_arm  # the arms' table, also read from here

logger = logging.getLogger(__name__)

ARMS = ("teacher", "converted", "orthros_continued", "dense_continued", "sliding_continued")
CONTINUED = {"orthros_continued": "orthros", "dense_continued": "dense", "sliding_continued": "sliding"}
CURVE_FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)
MARKER = ".orthros-conversion-study"  # written first into --out: what makes a folder this study's
RESULTS = "conversion.json"
SMOLLM2_RESULTS = "smollm2.json"
SMOLLM2_TAIL_RESULTS = "smollm2_tail.json"  # study/smollm2_tail.py (--smollm2-tail)
# study/smollm2.py's arms (kept here so that the options can be checked without importing it).
SMOLLM2_ARMS = ("ce", "sinks", "sinks_ce", "sinks_kd", "sinks_align_kd", "dense")
TEACHER_LR = 3e-3  # the replication study's kept rate for this shape (docs/study.md)
TEACHER_SEED = 1234

# --quick: the replication study's reduced shape (~0.1M parameters, W = 8, 96 tokens) and a
# handful of steps: every stage end to end in a few minutes on the shared CPU.
QUICK = {
    "steps": 10,
    "seeds": (1, 2),
    "lrs": (3e-3,),
    "warmups": (0.1,),
    "longctx_steps": 4,
    "recall_documents": 8,
    "passkey_documents": 8,
    "valid_tokens": 2048,
}


@dataclass
class ConversionOptions:
    out: Path = Path("runs/conversion")
    report: Path | None = None  # None: no report (the CLI's default is <out>/conversion.md)
    quick: bool = False
    teacher: Path | None = None  # an existing dense checkpoint to convert (None: train one)
    teacher_steps: int | None = None  # trainer.max_steps of the teacher (None: the recipe's)
    steps: int = 100  # continued-training steps of every arm
    window: int | None = None  # the base window W (None: the recipe's)
    seeds: tuple[int, ...] = (1, 2, 3)  # trainer.seed of the continued runs (their data order)
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)  # swept peak rates (cosine to a tenth)
    # Warm-up as a fraction of the steps: the first with every rate, the others at the kept rate.
    warmups: tuple[float, ...] = (0.1, 0.0)
    affine_noise: float = 0.1  # the sweep's other start of gamma/beta: 1/0 plus N(0, noise^2) (0: not swept)
    frozen: float = 0.1  # the sweep's early freeze: fraction of steps only gamma/beta train (0: not swept)
    fractions: tuple[float, ...] = CURVE_FRACTIONS
    longctx: bool = True
    longctx_factor: int = 4
    longctx_steps: int = 50
    smollm2: bool = False  # the SmolLM2-135M section (~45 min on 2 cores)
    smollm2_minutes: float = 30.0  # its continued-training budget
    smollm2_steps: int | None = None  # steps of every arm (None: as many as a timed step says fit in the budget)
    smollm2_arms: tuple[str, ...] = SMOLLM2_ARMS  # the arms of study/smollm2.py to run
    smollm2_points: int = 3  # points of each arm's recovery curve (checkpoints at equal fractions of the steps)
    smollm2_eval_tokens: int = 4096  # held-out tokens of the loss and KL (at every curve point)
    smollm2_alpha: float = 0.5  # distillation arms: distill.alpha (weight of the KL term)
    sink_tokens: int = 4  # the sink arms' model.sink_tokens
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every small run
    train_threads: int | None = 1
    jobs: int = 2  # training processes at a time (one thread each)
    eval_threads: int = 1
    recall_documents: int = 32
    passkey_documents: int = 32
    valid_tokens: int | None = None
    notes: Path | None = None
    command: str | None = None
    overwrite: bool = False  # delete and retrain every run (default: reuse finished runs, resume partial ones)

    def __post_init__(self) -> None:
        check_seeds_and_rates(self.seeds, self.lrs)
        if not self.warmups:
            raise UserError("--warmups needs at least one warm-up fraction")
        for name in ("steps", "jobs", "eval_threads", "recall_documents", "passkey_documents", "longctx_factor",
                     "longctx_steps"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("teacher_steps", "window", "valid_tokens", "train_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1 (or unset), got {value}")
        for flag, value in [*(("--warmups", w) for w in self.warmups), ("--frozen", self.frozen)]:
            check_fraction(flag, value, self.steps)
        if not (math.isfinite(self.affine_noise) and self.affine_noise >= 0):
            raise UserError(f"--affine-noise must be a finite number >= 0, got {self.affine_noise}")
        if not (math.isfinite(self.smollm2_minutes) and self.smollm2_minutes > 0):
            raise UserError(f"--smollm2-minutes must be a finite number > 0, got {self.smollm2_minutes}")
        curve_steps(self.steps, self.fractions)  # refuses fractions the steps cannot resolve
        self._check_smollm2()

    def _check_smollm2(self) -> None:
        unknown = [a for a in self.smollm2_arms if a not in SMOLLM2_ARMS]
        if not self.smollm2_arms or unknown:
            raise UserError(f"--smollm2-arms {','.join(self.smollm2_arms)}: choose one or more of "
                             f"{','.join(SMOLLM2_ARMS)}")
        for name in ("smollm2_points", "smollm2_eval_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.smollm2_steps is not None and self.smollm2_steps < self.smollm2_points:
            raise UserError(f"--smollm2-steps {self.smollm2_steps} is fewer than the curve's "
                             f"{self.smollm2_points} points (--smollm2-points); give more steps or fewer points")
        if not (math.isfinite(self.smollm2_alpha) and 0 <= self.smollm2_alpha <= 1):
            raise UserError(f"--smollm2-alpha must lie in [0, 1], got {self.smollm2_alpha}")
        if self.sink_tokens < 1:
            raise UserError(f"--sink-tokens must be >= 1 (the sink arms' S), got {self.sink_tokens}")

    @classmethod
    def quick_defaults(cls, **given: Any) -> ConversionOptions:
        """The reduced study: ``QUICK`` under whatever is ``given``."""
        return cls(**{**QUICK, **given, "quick": True})


def check_fraction(flag: str, value: float, steps: int) -> None:
    """A fraction of the run's steps in [0, 1) that is 0 or at least one step (0.04 of 10 steps is none)."""
    if not (math.isfinite(value) and 0 <= value < 1):
        raise UserError(f"{flag} {value:g}: a fraction of the steps must lie in [0, 1)")
    if value > 0 and round(value * steps) == 0:
        raise UserError(f"{flag} {value:g} of {steps} steps rounds to 0 steps; give at least {1 / steps:g} "
                         "(or 0 to leave it out), or more --steps")


# -- bookkeeping: overrides, steps of the curve, arm summaries -----------------------------------------


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Hydra overrides with one value per key, the later group winning (QUICK_OVERRIDES sets
    trainer.max_steps for the teacher, the continued runs set their own)."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key = item.split("=", 1)[0].lstrip("+")
            merged.pop(key, None)  # re-inserted last: the order of the winning values is kept
            merged[key] = item
    return list(merged.values())


def curve_steps(steps: int, fractions: Sequence[float]) -> list[tuple[float, int]]:
    """(fraction, step) of every point of the recovery curve; step 0 is the converted model.

    Every fraction must land on its own step: at 10 steps, 0.1 and 0.12 would both be step 1.
    """
    if not fractions:
        raise UserError("the recovery curve needs at least one fraction")
    points = []
    for f in sorted(set(fractions)):
        if not 0 <= f <= 1:
            raise UserError(f"curve fraction {f} outside [0, 1]")
        points.append((f, round(f * steps)))
    taken = [s for _, s in points]
    if len(set(taken)) != len(taken) or any(s == 0 for f, s in points if f > 0):
        raise UserError(f"the curve fractions {sorted(set(fractions))} do not fall on distinct steps of a "
                         f"{steps}-step run ({taken}); use more steps or fewer fractions")
    return points


def save_every(steps: int, fractions: Sequence[float]) -> int:
    """trainer.save_every that puts a checkpoint on every step of the curve (the last is the final save)."""
    inner = [s for _, s in curve_steps(steps, fractions) if 0 < s < steps]
    return math.gcd(*inner) if inner else 0


def checkpoint_at(run_dir: Path, step: int, steps: int) -> Path:
    """The weights of a run after ``step`` optimizer steps (its final export at the end)."""
    from orthros_train.train.checkpoint_store import CheckpointStore

    if step == steps:
        return Path(run_dir) / "checkpoints" / "final"
    return Path(run_dir) / "checkpoints" / CheckpointStore.name(step) / "model"


# -- the converted checkpoint ------------------------------------------------------------------------------


def convert_dense_checkpoint(src: Path, dst: Path, window: int, affine_noise: float = 0.0, seed: int = 0) -> Path:
    """The dense checkpoint ``src`` as an Orthros checkpoint in ``dst``: every weight kept, window
    ``window``, the output-stream affine at gamma = 1, beta = 0 (``orthros-convert from-hf``'s
    rule), or, with ``affine_noise`` > 0, 1 and 0 plus Gaussian noise of that standard deviation."""
    from orthros_train.convert.checkpoint_io import copy_side_files
    from orthros_train.convert.from_hf import is_output_affine
    from orthros_train.model import OrthrosForCausalLM

    model = OrthrosForCausalLM.from_pretrained(src, attention_type="orthros", sliding_window=window)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_output_affine(name):
                p.fill_(1.0 if name.endswith("gamma") else 0.0)
                if affine_noise > 0:
                    p.add_(torch.randn(p.shape, generator=gen) * affine_noise)
    dst = Path(dst)
    model.save_pretrained(dst)
    copy_side_files(Path(src), dst)
    return dst


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "tie_word_embeddings")


def check_teacher(path: Path, model: dict[str, Any] | None = None, vocab_size: int | None = None) -> None:
    """A teacher given by path is a dense checkpoint directory of the study's shape (``model``: the
    recipe's model section, which the dense and sliding arms train with) and of its tokenizer's
    vocabulary (``vocab_size``); else one line with the fix."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file() or not any(path.glob("*.safetensors")):
        raise UserError(f"--teacher {path}: no checkpoint there (config.json + *.safetensors); point it at a "
                         "dense run's checkpoints/final, or drop --teacher to train one")
    try:
        have = json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"--teacher {path}: {config} is not valid JSON ({exc}); restore it or point --teacher at "
                         "another dense checkpoint") from None
    kind = have.get("attention_type")
    if kind != "dense":
        raise UserError(f"--teacher {path}: attention_type is {kind!r}, the study converts a dense model; point "
                         "it at a dense run's checkpoints/final (e.g. orthros-train --config-name study/dense)")
    if vocab_size is not None and have.get("vocab_size") != vocab_size:
        raise UserError(f"--teacher {path} has a vocabulary of {have.get('vocab_size')} tokens, the study's tokenizer "
                         f"{vocab_size}: its token ids mean other words, so no override makes it this study's "
                         "teacher; pick a dense checkpoint trained with the study's tokenizer (or drop --teacher)")
    # Only the sizes the recipe states (an interpolation such as the tokenizer's vocabulary is not a size yet).
    wrong = [k for k in SHAPE_KEYS if model is not None and isinstance(model.get(k), (int, bool))
             and have.get(k) != model[k]]  # fmt: skip
    if wrong:
        differ = [f"{k} {have.get(k)} (the study's {model[k]})" for k in wrong]
        fix = " ".join(f"model.{k}={have.get(k)}" for k in wrong)
        raise UserError(f"--teacher {path} has another shape: {', '.join(differ)}; the continued arms train the "
                         f"study's shape, so match it (--override {fix}; --quick is the quick shape) or pick "
                         "a teacher of this shape")


def check_out(out: Path) -> None:
    """``out`` is new, empty or this study's; anything else is refused before a file is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pick a folder")
    # A lock left by a killed study is not content (the next study takes it over).
    if not out.is_dir() or (out / MARKER).is_file() or not any(p for p in out.iterdir() if "run.lock" not in p.name):
        return
    found = sorted(p.name for p in out.iterdir())[:4]
    what = "the replication study (study.json)" if (out / "study.json").exists() else f"other files ({found})"
    raise UserError(f"--out {out} holds {what}, not a conversion study; pick an empty or new folder")


def check_window(window: int, seq_len: int) -> None:
    if window >= seq_len:
        raise UserError(f"--window {window} is not smaller than the sequence ({seq_len} tokens): nothing would be "
                         "beyond W; pick --window below the sequence length")
    if 4 * window > passkey_haystack_length(seq_len):
        raise UserError(f"--window {window}: the passkey probe needs a needle 4 windows back, beyond the "
                         f"{seq_len}-token sequence; pick --window <= {passkey_haystack_length(seq_len) // 4}")


# -- the study ---------------------------------------------------------------------------------------------


def check_options(opts: ConversionOptions) -> tuple[list[str], dict[str, Any], int, int]:
    """Everything checked before a file is written: the folder, the teacher, the window. Returns the
    overrides of every small run, the composed dense recipe, its sequence length and the window."""
    check_out(Path(opts.out))
    base = merge_overrides(QUICK_OVERRIDES if opts.quick else [], opts.overrides)
    recipe = _recipe("dense", base)
    seq_len = recipe["trainer"]["seq_len"]
    window = opts.window or recipe["model"]["sliding_window"]
    check_window(window, seq_len)
    if opts.teacher is not None:
        vocab = recipe["model"].get("vocab_size")
        vocab = vocab if isinstance(vocab, int) else recipe.get("data", {}).get("tokenizer_vocab_size")
        check_teacher(opts.teacher, recipe["model"], vocab if isinstance(vocab, int) else None)
    if opts.window is not None:
        base = merge_overrides(base, [f"model.sliding_window={window}"])
    return base, recipe, seq_len, window


def stale_reports(opts: ConversionOptions) -> list[Path]:
    """What a rerun with --overwrite removes first: the results and the report of the runs it replaces."""
    out = Path(opts.out)
    paths = [out / RESULTS, out / SMOLLM2_RESULTS]
    if opts.report is not None:
        paths += [Path(opts.report), Path(opts.report).parent / Path(opts.report).stem]
    return paths


def run_conversion_study(opts: ConversionOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Teacher, conversion, sweep, seeds, evaluation, curves, long context; writes ``<out>/conversion.json``
    and the report (the SmolLM2 section is ``study/smollm2.py``'s). Finished runs are reused, partial ones
    resumed (``study/runs.py``)."""
    study = _Study(opts, log)
    teacher = study.train_teacher()
    conversion = study.convert(teacher)
    sweep = study.sweep(conversion)
    seeds = study.train_seeds(conversion, sweep)
    with torch_threads(opts.eval_threads):
        evaluation = study.evaluate_arms(conversion, seeds)
        curves = study.measure_curves(conversion, sweep.chosen, seeds, evaluation)
        sweep_scores = study.evaluate_sweep(sweep)
        longctx = study.long_context(seeds, sweep.chosen) if opts.longctx else None
    outcome = ConversionOutcome(study.header, teacher, conversion, sweep, seeds, evaluation, curves, sweep_scores,
                                longctx, StudyEnd(load_average(), time.perf_counter() - study.started))
    results = outcome.to_json()
    _check_finite(results)
    write_results(opts, results, log)
    return results


class _Study:
    """One conversion study: its options, the composed recipe and the window; each method is one stage and
    returns its result (``study/stages.py``)."""

    def __init__(self, opts: ConversionOptions, log: Callable[[str], None]) -> None:
        from orthros_train.train.cli import git_commit

        self.opts, self.log, self.out = opts, log, Path(opts.out)
        self.base, self.recipe, self.seq_len, self.window = check_options(opts)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / MARKER).write_text("orthros-study conversion\n")
        if opts.overwrite:  # the report of the runs about to be replaced must not outlive them
            remove_stale(stale_reports(opts), log)
        self.started = time.perf_counter()
        self.header = StudyHeader(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), git_commit=git_commit(), command=opts.command,
            quick=opts.quick, overrides=tuple(self.base), window=self.window, seq_len=self.seq_len, steps=opts.steps,
            seeds=tuple(opts.seeds), cpu_count=os.cpu_count(), load_average_start=load_average())
        self.every = save_every(opts.steps, opts.fractions)

    def train(self, arch: str, run_dir: Path, overrides: list[str]) -> float:
        return train_run(arch, run_dir, merge_overrides(self.base, overrides), self.log, self.opts.train_threads,
                         overwrite=self.opts.overwrite)

    def train_teacher(self) -> Teacher:
        """1. The teacher: the one given with --teacher, or trained here."""
        opts = self.opts
        if opts.teacher is not None:
            return Teacher(Path(opts.teacher))
        teacher_dir = self.out / "teacher"
        extra = [f"optim.lr={TEACHER_LR:g}", f"optim.min_lr={TEACHER_LR:g}", f"trainer.seed={TEACHER_SEED}"]
        if opts.teacher_steps:
            extra.append(f"trainer.max_steps={opts.teacher_steps}")
        seconds = self.train("dense", teacher_dir, extra)
        return Teacher(teacher_dir / "checkpoints" / "final", _run_facts(teacher_dir, seconds, "trained by this study"))

    def convert(self, teacher: Teacher) -> Conversion:
        """2. The models conversion makes of the teacher, made before any run starts (the runs train in
        parallel threads), and how far the converted one is from the teacher."""
        opts, source = self.opts, teacher.checkpoint
        converted = convert_dense_checkpoint(source, self.out / "converted", self.window)
        check = equality_within_window(source, converted, self.seq_len)
        self.log(f"converted: max |logit difference| to the teacher inside W {check['within_w']:.2e}")
        inits = {0.0: converted}
        if opts.affine_noise > 0:
            inits[opts.affine_noise] = convert_dense_checkpoint(
                source, self.out / f"converted-affine{opts.affine_noise:g}", self.window, opts.affine_noise)
        return Conversion(source, converted, inits, check)

    def continue_run(self, arm: str, init: Path, setting: Setting, seed: int, run_dir: Path) -> TrainedRun:
        arch = CONTINUED[arm]
        extra = [f"model.init_from={init}", *setting.overrides(self.opts.steps, seed, arch == "orthros")]
        if self.every:  # the curves' checkpoints (every arm: dense and sliding are the curve's references)
            extra += [f"trainer.save_every={self.every}", "trainer.keep_last_k=0"]
        return TrainedRun(run_dir, self.train(arch, run_dir, extra))

    def in_parallel(self, conversion: Conversion, jobs: list[tuple[str, Setting, int, Path]]) -> list[TrainedRun]:
        """``opts.jobs`` training processes at a time; the first failure stops the study."""
        return run_parallel(self.continue_run, [(arm, conversion.init_of(CONTINUED[arm], setting), setting, seed, d)
                                                for arm, setting, seed, d in jobs], self.opts.jobs)

    def sweep_round(self, conversion: Conversion, settings: list[Setting],
                    done: dict[str, SweepRun]) -> dict[Setting, float | None]:
        """The settings not yet in ``done`` trained (first seed, Orthros) and added to it; every setting's loss."""
        first = self.opts.seeds[0]
        todo = [s for s in settings if s.name not in done]
        jobs = [("orthros_continued", s, first, self.out / "sweep" / f"{s.name}-seed{first}") for s in todo]
        for s, run in zip(todo, self.in_parallel(conversion, jobs)):
            done[s.name] = SweepRun(s, run, _final_eval_loss(run.run_dir))
        return {s: done[s.name].blend_valid_loss for s in settings}

    def sweep(self, conversion: Conversion) -> SweepResult:
        """3. The sweep (first seed, Orthros): the peak rate at the first warm-up, then, one at a time at
        the kept rate, the other warm-ups, gamma/beta started off the identity, and the early freeze."""
        opts, done = self.opts, {}
        scores = self.sweep_round(conversion, [Setting(lr, opts.warmups[0]) for lr in opts.lrs], done)
        best: Setting = pick_lr(scores)
        self.log(f"sweep: rate {best.lr:g} (held-out blend loss {scores[best]:.4f})")
        variants = [best, *(replace(best, warmup=w) for w in opts.warmups[1:])]
        if opts.affine_noise > 0:
            variants.append(replace(best, affine_noise=opts.affine_noise))
        if opts.frozen > 0:
            variants.append(replace(best, frozen=opts.frozen))
        chosen: Setting = pick_lr(self.sweep_round(conversion, variants, done))
        self.log(f"sweep: kept {chosen.name}")
        return SweepResult(f"the trainer's held-out blend loss at the end of the run, seed {opts.seeds[0]}", chosen,
                           tuple(done.values()))

    def train_seeds(self, conversion: Conversion, sweep: SweepResult) -> SeedRuns:
        """4. The seeds: every continued arm with the kept rate and warm-up (Orthros with all of it)."""
        chosen = sweep.chosen
        first, plain = self.opts.seeds[0], replace(chosen, affine_noise=0.0, frozen=0.0)
        jobs = [(arm, chosen if arm == "orthros_continued" else plain, seed, self.out / arm / f"seed{seed}")
                for arm in CONTINUED for seed in self.opts.seeds
                if not (arm == "orthros_continued" and seed == first)]
        trained = self.in_parallel(conversion, jobs)
        runs: dict[str, list[TrainedRun]] = {arm: [] for arm in CONTINUED}
        runs["orthros_continued"].append(sweep.run_of(chosen).run)
        for (arm, *_), run in zip(jobs, trained):
            runs[arm].append(run)
        facts = _run_facts(runs["orthros_continued"][0].run_dir, 0.0, "")
        return SeedRuns({arm: tuple(r) for arm, r in runs.items()}, facts.tokens // facts.steps,
                        time.perf_counter() - self.started, load_average())

    def measure(self, ckpt: Path, **config_overrides: Any) -> dict[str, Any]:
        o = self.opts
        return evaluate_checkpoint(ckpt, self.recipe["data"], self.seq_len, o.recall_documents, o.passkey_documents,
                                   o.valid_tokens, **config_overrides)

    def evaluate_arms(self, conversion: Conversion, seeds: SeedRuns) -> Evaluation:
        """5. The table: the teacher, the converted model, and every continued arm's final checkpoints."""
        self.log("evaluate: teacher, converted, continued arms")
        arms = {"teacher": ArmEvaluation((self.measure(conversion.teacher),)),
                "converted": ArmEvaluation((self.measure(conversion.converted),))}
        for arm in CONTINUED:
            runs = seeds.runs[arm]
            arms[arm] = ArmEvaluation(tuple(self.measure(r.final) for r in runs), tuple(self.opts.seeds),
                                      tuple(r.seconds for r in runs))
        return Evaluation({arm: arms[arm] for arm in ARMS})

    def measure_curves(self, conversion: Conversion, chosen: Setting, seeds: SeedRuns,
                       evaluation: Evaluation) -> Curves:
        """6. Every continued arm at the curve's steps; step 0 is the model it starts from, with its own attention."""
        self.log("evaluate: the recovery curves")
        steps, arms = self.opts.steps, evaluation.arms
        starts = {"orthros_continued": (self.measure(conversion.inits[chosen.affine_noise]) if chosen.affine_noise
                                        else arms["converted"].evals[0]),
                  "dense_continued": arms["teacher"].evals[0],
                  "sliding_continued": self.measure(conversion.teacher, attention_type="sliding",
                                                    sliding_window=self.window)}
        curves = {}
        for arm in CONTINUED:
            curve = []
            for fraction, step in curve_steps(steps, self.opts.fractions):
                if step == 0:
                    point = (starts[arm],)
                elif step == steps:
                    point = arms[arm].evals
                else:
                    point = tuple(self.measure(checkpoint_at(r.run_dir, step, steps)) for r in seeds.runs[arm])
                curve.append(CurvePoint(fraction, step, point))
            curves[arm] = tuple(curve)
        return Curves(curves)

    def evaluate_sweep(self, sweep: SweepResult) -> dict[str, SweepScores]:
        """7. Every run of the sweep evaluated like the arms (the sweep's table), by setting name."""
        return {r.setting.name: SweepScores.of(self.measure(r.run.final)) for r in sweep.runs}

    def long_context(self, seeds: SeedRuns, chosen: Setting) -> LongContext:
        """8. The long-context section, from the kept Orthros run of the first seed."""
        return longctx_section(self.opts, seeds.runs["orthros_continued"][0].run_dir, chosen, self.base, self.recipe,
                               self.window, self.log)


def write_results(opts: ConversionOptions, results: dict[str, Any], log: Callable[[str], None] = _log) -> None:
    """``<out>/conversion.json`` (with the SmolLM2 section if ``<out>/smollm2.json`` holds one) and the report."""
    from orthros_train.eval.common import write_json

    out = Path(opts.out)
    extra = out / SMOLLM2_RESULTS
    if extra.is_file():
        results["smollm2"] = json.loads(extra.read_text())
    tail = out / SMOLLM2_TAIL_RESULTS
    if tail.is_file():
        results["smollm2_tail"] = json.loads(tail.read_text())
    write_json(results, out / RESULTS)
    if opts.report is not None:
        from orthros_train.study.conversion_report import write_conversion_report

        notes = Path(opts.notes).read_text() if opts.notes else None
        write_conversion_report(results, Path(opts.report), notes)
        log(f"report: {opts.report}")


def write_smollm2_results(opts: ConversionOptions, section: dict[str, Any], log: Callable[[str], None] = _log) -> None:
    """The SmolLM2 section merged into the small study's ``conversion.json`` and its report when there is one,
    else a report of its own (``--smollm2-only`` into a new folder)."""
    out = Path(opts.out)
    if (out / RESULTS).is_file():
        write_results(opts, json.loads((out / RESULTS).read_text()), log)
    elif opts.report is not None:
        from orthros_train.study.conversion_report import write_smollm2_report

        write_smollm2_report(section, Path(opts.report), Path(opts.notes).read_text() if opts.notes else None,
                             opts.command)
        log(f"report: {opts.report}")


def rerender(opts: ConversionOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """The report again from ``<out>/conversion.json`` (plus a newer ``smollm2.json``), measuring nothing."""
    out = Path(opts.out)
    if not (out / RESULTS).is_file() and (out / SMOLLM2_RESULTS).is_file():  # a --smollm2-only folder
        section = read_results(out / SMOLLM2_RESULTS, "SmolLM2 section")
        write_smollm2_results(opts, section, log)
        return {"smollm2": section}
    results = read_results(out / RESULTS, "conversion study")
    write_results(opts, results, log)
    return results


# -- pieces --------------------------------------------------------------------------------------------------


def _recipe(arch: str, overrides: list[str]) -> dict[str, Any]:
    """The composed recipe of ``study/<arch>`` with ``overrides``, as the trainer would see it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orthros_train.train.cli import RECIPES_DIR  # also registers the recipes' resolver

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        cfg = compose(config_name=f"study/{arch}", overrides=[o for o in overrides if not o.startswith("hydra")])
    return OmegaConf.to_container(cfg, resolve=False)


def _final_eval_loss(run_dir: Path) -> float | None:
    evals = [m["eval_loss"] for m in read_metrics(run_dir) if m.get("eval_loss") is not None]
    return evals[-1] if evals else None


def _run_facts(run_dir: Path, seconds: float, how: str) -> RunFacts:
    metrics = read_metrics(run_dir)
    recipe = json.loads((run_dir / "recipe.json").read_text())
    return RunFacts(how, steps=metrics[-1]["step"], seed=recipe["trainer"]["seed"], lr=recipe["optim"]["lr"],
                    tokens=metrics[-1]["consumed_samples"] * recipe["trainer"]["seq_len"],
                    blend_valid_loss=_final_eval_loss(run_dir), train_seconds=seconds)


def equality_within_window(teacher: Path, converted: Path, seq_len: int) -> dict[str, float]:
    """Max |logit difference| of the converted model to the teacher inside W (~0: the conversion
    is exact there) and beyond it (the gap continued training closes)."""
    from orthros_train.model import OrthrosForCausalLM

    a = OrthrosForCausalLM.from_pretrained(teacher).eval()
    b = OrthrosForCausalLM.from_pretrained(converted).eval()
    window = b.config.sliding_window
    ids = torch.randint(0, a.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = a(ids).logits
        diff = (reference - b(ids).logits).abs()
    return {"within_w": float(diff[:, :window].max()), "beyond_w": float(diff[:, window:].max()),
            "max_abs_logit": float(reference.abs().max())}


def longctx_ranges(window: int, length: int, trained: int) -> dict[str, tuple[int, int]]:
    """Passkey distances at the extended length: inside W, inside the trained length, and beyond it."""
    hay = passkey_haystack_length(length)
    ranges = {"within_w": (2, window - 1), "w_to_l": (window, trained - 1), "l_to_2l": (trained, 2 * trained - 1),
              "2l_to_4l": (2 * trained, hay)}
    return {k: (lo, min(hi, hay)) for k, (lo, hi) in ranges.items() if lo <= min(hi, hay)}


def longctx_section(opts: ConversionOptions, source_run: Path, setting: Setting, base: list[str],
                    recipe: dict[str, Any], window: int, log: Callable[[str], None]) -> LongContext:
    """The Orthros model trained at L, extended to factor x L with YaRN and trained on briefly there,
    beside the same model unextended, all measured at factor x L."""
    trained = recipe["trainer"]["seq_len"]
    length = opts.longctx_factor * trained
    micro = max(1, recipe["trainer"]["micro_batch_size"] // opts.longctx_factor)  # about the same tokens per step
    scaling = {"rope_type": "yarn", "factor": float(opts.longctx_factor), "original_max_position_embeddings": trained}
    rope = "{" + ",".join(f"{k}:{v}" for k, v in scaling.items()) + "}"
    src = Path(source_run) / "checkpoints" / "final"
    run_dir = Path(opts.out) / "longctx" / f"x{opts.longctx_factor}"
    warmup = round(setting.warmup * opts.longctx_steps)
    extra = [f"model.init_from={src}", f"++model.rope_scaling={rope}", f"++model.max_position_embeddings={length}",
             f"trainer.seq_len={length}", f"trainer.micro_batch_size={micro}",
             f"trainer.max_steps={opts.longctx_steps}", f"optim.lr={setting.lr:g}",
             f"optim.min_lr={setting.lr / 10:g}", f"optim.warmup_steps={warmup}", f"trainer.seed={opts.seeds[0]}"]
    seconds = train_run("orthros", run_dir, merge_overrides(base, extra), log, opts.train_threads,
                        overwrite=opts.overwrite)
    ranges = longctx_ranges(window, length, trained)

    def measure(ckpt: Path, at: int, **config_overrides: Any) -> dict[str, Any]:
        e = evaluate_checkpoint(ckpt, recipe["data"], at, opts.recall_documents, opts.passkey_documents,
                                opts.valid_tokens, ranges if at == length else None, tokenizer_from=src,
                                **config_overrides)
        return {
            "loss": e["essay_valid"]["loss"],
            "loss_within_l": loss_between(e, 0, trained),
            "loss_beyond_l": loss_between(e, trained),
            "recall": e["recall"]["accuracy"],
            "passkey": {hay: {k: v["accuracy"] for k, v in e["passkey"][hay].items()} for hay in ("pairs", "essays")},
        }

    log(f"evaluate long context at {length} tokens")
    longer = {"max_position_embeddings": length}
    rows = {
        "unextended": measure(src, length, **longer),
        "extended_untrained": measure(src, length, rope_scaling=scaling, **longer),
        "extended_continued": measure(run_dir / "checkpoints" / "final", length),
    }
    return LongContext(trained_length=trained, length=length, factor=opts.longctx_factor, rope_scaling=scaling,
                       steps=opts.longctx_steps, micro_batch_size=micro, run=TrainedRun(run_dir, seconds),
                       ranges=ranges, rows=rows)


def _check_finite(results: dict[str, Any]) -> None:
    """A NaN in the table is a bug in the pipeline, not a finding: fail loudly."""
    for arm, row in results["arms"].items():
        for key in ("loss", "loss_beyond_w"):
            if row[key] is None or not math.isfinite(row[key]):
                raise ValueError(f"{arm}: {key} is {row[key]}")
