"""What each stage of the conversion study returns (``study/conversion.py``), and ``conversion.json`` made of it.

Every stage returns a small frozen record: the teacher, the conversion, the sweep, the seeds, the
evaluation of every arm, the recovery curves, the long-context section. ``to_json`` gives a record's
entries of ``conversion.json`` as the report writers read them (``study/conversion_report.py``);
``ConversionOutcome.to_json`` puts them together in one place, in the file's order of keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orthros_train.study.pipeline import loss_between, spread

Record = dict[str, Any]  # what evaluate_checkpoint returns for one model


@dataclass(frozen=True)
class Setting:
    """How the converted model is continued: peak rate, warm-up fraction, gamma/beta noise, frozen fraction."""

    lr: float
    warmup: float
    affine_noise: float = 0.0
    frozen: float = 0.0

    @property
    def name(self) -> str:
        return f"lr{self.lr:g}-warmup{self.warmup:g}-affine{self.affine_noise:g}-frozen{self.frozen:g}"

    def overrides(self, steps: int, seed: int, orthros: bool) -> list[str]:
        """Cosine from ``lr`` to a tenth of it after the warm-up (the shape of recipes/convert_*)."""
        out = [f"optim.lr={self.lr:g}", f"optim.min_lr={self.lr / 10:g}", "optim.schedule=cosine",
               f"optim.warmup_steps={round(self.warmup * steps)}", f"trainer.max_steps={steps}", f"trainer.seed={seed}"]
        if orthros and self.frozen:
            out.append(f"++optim.frozen_steps={round(self.frozen * steps)}")
        return out

    def to_json(self) -> dict[str, float]:
        return {"lr": self.lr, "warmup": self.warmup, "affine_noise": self.affine_noise, "frozen": self.frozen}


# -- the numbers of evaluated models ------------------------------------------------------------------------


def measures(e: Record) -> dict[str, float | None]:
    """The numbers of one evaluated model the table compares."""
    window = e["config"]["sliding_window"]
    pk = e["passkey"]
    return {
        "loss": e["essay_valid"]["loss"],
        "loss_within_w": loss_between(e, 0, window),
        "loss_beyond_w": loss_between(e, window),
        "recall_within_w": e["recall"]["accuracy_within_window"],
        "recall_beyond_w": e["recall"]["accuracy_beyond_window"],
        "passkey_pairs_4_8x_w": pk["pairs"]["4-8x_window"]["accuracy"],
        "passkey_prose_4_8x_w": pk["essays"]["4-8x_window"]["accuracy"],
    }


def summarize_arm(evals: Sequence[Record]) -> dict[str, Any]:
    """Each measure's mean over the evaluated models (one per seed) with ``<measure>_std`` beside it."""
    if not evals:
        raise ValueError("an arm needs at least one evaluated model")
    rows = [measures(e) for e in evals]
    out: dict[str, Any] = {"n": len(rows)}
    for key in rows[0]:
        s = spread([r[key] for r in rows])
        out[key], out[f"{key}_std"] = s["mean"], s["std"]
    return out


def curve_point(fraction: float, step: int, evals: Sequence[Record]) -> dict[str, Any]:
    s = summarize_arm(evals)
    keep = ("loss", "loss_beyond_w", "recall_within_w", "recall_beyond_w")
    return {"fraction": fraction, "step": step, "n": s["n"],
            **{k: s[k] for k in keep}, **{f"{k}_std": s[f"{k}_std"] for k in keep}}


def _bucket_means(evals: Sequence[Record]) -> list[dict[str, Any]]:
    first = evals[0]["recall"]["buckets"]
    return [{**{k: b[k] for k in ("label", "low", "high", "beyond_window", "queries")},
             "accuracy": spread([e["recall"]["buckets"][j]["accuracy"] for e in evals])["mean"]}
            for j, b in enumerate(first)]


def _position_means(evals: Sequence[Record]) -> list[dict[str, Any]]:
    first = evals[0]["essay_valid"]["buckets"]
    return [{**{k: b[k] for k in ("label", "low", "high", "beyond_window", "tokens")},
             "loss": spread([e["essay_valid"]["buckets"][j]["loss"] for e in evals])["mean"]}
            for j, b in enumerate(first)]


# -- the stages' results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedRun:
    """One training run: its folder, and the seconds it trained (the recorded ones when it was reused)."""

    run_dir: Path
    seconds: float

    @property
    def final(self) -> Path:
        return Path(self.run_dir) / "checkpoints" / "final"


@dataclass(frozen=True)
class StudyHeader:
    """What the study ran with and where: the first entries of ``conversion.json``."""

    date: str
    git_commit: str | None
    command: str | None
    quick: bool
    overrides: tuple[str, ...]  # of every small run
    window: int
    seq_len: int
    steps: int
    seeds: tuple[int, ...]
    cpu_count: int | None
    load_average_start: str

    def to_json(self) -> dict[str, Any]:
        return {"date": self.date, "git_commit": self.git_commit, "command": self.command, "quick": self.quick,
                "overrides": list(self.overrides), "window": self.window, "seq_len": self.seq_len,
                "steps": self.steps, "seeds": list(self.seeds), "cpu_count": self.cpu_count,
                "load_average_start": self.load_average_start}


@dataclass(frozen=True)
class RunFacts:
    """A finished run as its metrics and recipe tell it (``how``: where its checkpoint comes from)."""

    how: str
    steps: int
    seed: int
    lr: float
    tokens: int
    blend_valid_loss: float | None
    train_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.how, "steps": self.steps, "seed": self.seed, "lr": self.lr, "tokens": self.tokens,
                "blend_valid_loss": self.blend_valid_loss, "train_seconds": self.train_seconds}


@dataclass(frozen=True)
class Teacher:
    """1. The dense checkpoint every arm starts from; ``facts`` None: given with --teacher."""

    checkpoint: Path
    facts: RunFacts | None = None

    def to_json(self) -> dict[str, Any]:
        if self.facts is None:
            return {"checkpoint": "given with --teacher", "source": Path(self.checkpoint).name}
        return self.facts.to_json()


@dataclass(frozen=True)
class Conversion:
    """2. The teacher as Orthros: the converted checkpoint, the starts of the Orthros runs by gamma/beta
    noise (0: the converted one), and the logit check against the teacher (``equality_within_window``)."""

    teacher: Path
    converted: Path
    inits: Mapping[float, Path]
    check: Mapping[str, float]

    def init_of(self, arch: str, setting: Setting) -> Path:
        """Where a continued run of ``arch`` starts: Orthros from its conversion, dense and sliding from the teacher."""
        return self.inits[setting.affine_noise] if arch == "orthros" else self.teacher

    def to_json(self) -> dict[str, float]:
        return dict(self.check)


@dataclass(frozen=True)
class SweepRun:
    """One run of the sweep (first seed, Orthros) and the trainer's held-out blend loss at its end."""

    setting: Setting
    run: TrainedRun
    blend_valid_loss: float | None


@dataclass(frozen=True)
class SweepScores:
    """What the evaluation adds to a sweep run's row."""

    loss: float | None
    loss_beyond_w: float | None
    recall_beyond_w: float | None

    @classmethod
    def of(cls, e: Record) -> SweepScores:
        m = measures(e)
        return cls(m["loss"], m["loss_beyond_w"], m["recall_beyond_w"])

    def to_json(self) -> dict[str, float | None]:
        return {"loss": self.loss, "loss_beyond_w": self.loss_beyond_w, "recall_beyond_w": self.recall_beyond_w}


@dataclass(frozen=True)
class SweepResult:
    """3. The sweep: the kept setting and every run, in the order they trained."""

    criterion: str
    chosen: Setting
    runs: tuple[SweepRun, ...]

    def run_of(self, setting: Setting) -> SweepRun:
        return next(r for r in self.runs if r.setting.name == setting.name)

    def to_json(self, scores: Mapping[str, SweepScores]) -> dict[str, Any]:
        """``scores``: each run's evaluation, by setting name."""
        return {"criterion": self.criterion, "chosen": self.chosen.to_json(),
                "runs": [{**r.setting.to_json(), "name": r.setting.name, "seconds": r.run.seconds,
                          "blend_valid_loss": r.blend_valid_loss, **scores[r.setting.name].to_json()}
                         for r in self.runs]}


@dataclass(frozen=True)
class SeedRuns:
    """4. Every continued arm's run of each seed (in --seeds order; Orthros's first is the sweep's kept run),
    with the facts of the training as a whole."""

    runs: Mapping[str, tuple[TrainedRun, ...]]
    tokens_per_step: int
    wall_seconds: float
    load_average: str

    def to_json(self) -> dict[str, Any]:
        return {"tokens_per_step": self.tokens_per_step, "train_wall_seconds": self.wall_seconds,
                "load_average_after_training": self.load_average}


@dataclass(frozen=True)
class ArmEvaluation:
    """One arm's evaluated models: one for the teacher and the converted model, one per seed for a continued
    arm (``seeds`` and ``train_seconds`` then beside them)."""

    evals: tuple[Record, ...]
    seeds: tuple[int, ...] = ()
    train_seconds: tuple[float, ...] = ()

    def summary(self) -> dict[str, Any]:
        out = summarize_arm(self.evals)
        if self.train_seconds:
            out["train_seconds"] = spread(list(self.train_seconds))["mean"]
        return out

    def per_seed(self) -> list[dict[str, Any]]:
        return [measures(e) | {"seed": s} for e, s in zip(self.evals, self.seeds)]


@dataclass(frozen=True)
class Evaluation:
    """5. Every arm evaluated (teacher, converted, the continued arms, in that order)."""

    arms: Mapping[str, ArmEvaluation]

    def to_json(self) -> dict[str, Any]:
        arms = self.arms
        return {"arms": {arm: e.summary() for arm, e in arms.items()},
                "runs": {arm: e.per_seed() for arm, e in arms.items() if e.seeds},
                "recall_buckets": {arm: _bucket_means(e.evals) for arm, e in arms.items()},
                "position_buckets": {arm: _position_means(e.evals) for arm, e in arms.items()},
                "chance": arms["teacher"].evals[0]["recall"]["chance"]}


@dataclass(frozen=True)
class CurvePoint:
    """The models of one arm after ``fraction`` of its steps (step 0: the model it starts from)."""

    fraction: float
    step: int
    evals: tuple[Record, ...]

    def to_json(self) -> dict[str, Any]:
        return curve_point(self.fraction, self.step, self.evals)


@dataclass(frozen=True)
class Curves:
    """6. The recovery curve of every continued arm."""

    points: Mapping[str, tuple[CurvePoint, ...]]

    def to_json(self) -> dict[str, Any]:
        curves = {arm: [p.to_json() for p in points] for arm, points in self.points.items()}
        return {"curves": curves, "curve": curves["orthros_continued"]}


@dataclass(frozen=True)
class LongContext:
    """7. The Orthros model extended from ``trained_length`` to ``length`` with YaRN, continued there,
    and every row measured at ``length``."""

    trained_length: int
    length: int
    factor: int
    rope_scaling: Mapping[str, Any]
    steps: int
    micro_batch_size: int
    run: TrainedRun
    ranges: Mapping[str, tuple[int, int]]  # passkey distances
    rows: Mapping[str, dict[str, Any]]  # unextended, extended_untrained, extended_continued

    def to_json(self) -> dict[str, Any]:
        return {"trained_length": self.trained_length, "length": self.length, "factor": self.factor,
                "rope_scaling": dict(self.rope_scaling), "steps": self.steps,
                "micro_batch_size": self.micro_batch_size, "train_seconds": self.run.seconds,
                "tokens": self.steps * self.micro_batch_size * self.length,
                "ranges": {k: list(v) for k, v in self.ranges.items()}, "rows": dict(self.rows)}


@dataclass(frozen=True)
class StudyEnd:
    load_average: str
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"load_average_end": self.load_average, "study_wall_seconds": self.wall_seconds}


@dataclass(frozen=True)
class ConversionOutcome:
    """Every stage's result; ``to_json`` is ``conversion.json`` (without the SmolLM2 section, merged on writing)."""

    header: StudyHeader
    teacher: Teacher
    conversion: Conversion
    sweep: SweepResult
    seeds: SeedRuns
    evaluation: Evaluation
    curves: Curves
    sweep_scores: Mapping[str, SweepScores]
    longctx: LongContext | None
    end: StudyEnd

    def to_json(self) -> dict[str, Any]:
        results = {**self.header.to_json(), "teacher": self.teacher.to_json(),
                   "conversion_check": self.conversion.to_json(), "sweep": self.sweep.to_json(self.sweep_scores),
                   **self.seeds.to_json(), **self.evaluation.to_json(), **self.curves.to_json()}
        if self.longctx is not None:
            results["longctx"] = self.longctx.to_json()
        return results | self.end.to_json()
