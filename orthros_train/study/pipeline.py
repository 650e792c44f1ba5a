"""Train the study's runs (a learning-rate sweep, then seeds), evaluate them, collect every number in one dict.

``run_study`` is the list of stages; each returns a frozen record, and ``study.json`` is made of those records
in one place (``StudyOutcome.to_json``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError

ARCHS = ("orthros", "dense", "sliding")
# Arms beyond the three models, chosen with --archs: (the recipe they train, their overrides).
# orthros_sinks: the Orthros model from scratch with S = 4 sink tokens (model.sink_tokens), beside S = 0.
EXTRA_ARCHS: dict[str, tuple[str, list[str]]] = {"orthros_sinks": ("orthros", ["++model.sink_tokens=4"])}

# The reduced study (--quick, tests/test_study.py): a ~0.1M-parameter shape and a handful of
# steps, enough to run every stage end to end in seconds per run on the shared CPU.
QUICK_OVERRIDES = [
    "model.hidden_size=32",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.intermediate_size=64",
    "model.sliding_window=8",
    "trainer.seq_len=96",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=12",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "optim.warmup_steps=2",
    "data.recall_mix.documents=64",
    "data.recall_mix.pairs=6",
    "data.recall_mix.keys=8",
]


@dataclass
class StudyOptions:
    out: Path = Path("runs/study")  # run directories and study.json
    # None: no report. The CLI's default is <out>/study.md: a study run from the repository root
    # must not overwrite the committed docs/study.md unless that path is asked for.
    report: Path | None = None  # figures go beside it, in <stem>/
    archs: tuple[str, ...] = ARCHS
    steps: int | None = None  # trainer.max_steps for every run (None: the recipes')
    quick: bool = False
    seeds: tuple[int, ...] = (1234, 1235, 1236)  # trainer.seed of the final runs (init and data order)
    # The learning-rate sweep: every rate trains with the first seed; the rate with the lowest
    # held-out blend loss (the trainer's validation, not a probe) is kept and trains the other
    # seeds. Its first-seed run is one of the final runs, so the sweep costs len(lrs) - 1 runs.
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    skip_train: bool = False  # evaluate existing run directories only
    train_archs: tuple[str, ...] | None = None  # the runs to (re)train (None: all of ``archs``)
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every run
    train_threads: int | None = 1  # OMP threads of each training process (None: inherit)
    jobs: int = 1  # training processes at a time (2 on a 2-core machine: one core each)
    recall_documents: int = 32  # held-out synthetic documents scored per model
    passkey_documents: int = 32  # needle-in-prose probes per model and distance range
    valid_tokens: int | None = None  # cap on held-out essay tokens (None: all of them)
    prefill_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    prefill_repeats: int = 1
    prefill_threads: int = 1  # one thread: process CPU time is then compute time, robust to load
    eval_threads: int = 1  # torch threads while evaluating (two measured ~30x slower under load)
    notes: Path | None = None  # hand-written analysis included in the report verbatim
    command: str | None = None  # how the study was invoked (recorded in the report)
    overwrite: bool = False  # delete and retrain every run (default: reuse finished runs, resume partial ones)

    def __post_init__(self) -> None:
        if not self.archs:
            raise UserError(f"--archs needs at least one model, from {', '.join((*ARCHS, *EXTRA_ARCHS))}")
        check_seeds_and_rates(self.seeds, self.lrs)
        stray = [a for a in (self.train_archs or ()) if a not in self.archs]
        if stray:
            raise UserError(
                f"--train-archs {','.join(stray)} not in --archs {','.join(self.archs)}: the study evaluates only "
                f"--archs, so a run it does not evaluate is not trained; add them to --archs or drop them"
            )
        check_arch_overrides(self.archs, self.overrides)
        if self.overwrite and (self.skip_train or self.train_archs is not None):
            raise UserError("--overwrite retrains every run: it cannot go with --skip-train or --train-archs")
        if self.jobs < 1:
            raise UserError(f"jobs must be >= 1, got {self.jobs}")
        for name in ("recall_documents", "passkey_documents", "prefill_repeats", "prefill_threads", "eval_threads"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "valid_tokens", "train_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1 (or unset), got {value}")


logger = logging.getLogger(__name__)


def _override_key(override: str) -> str:
    """``model.sink_tokens`` of ``+model.sink_tokens=2``, ``++model.sink_tokens=2`` or ``~model.sink_tokens``."""
    return override.split("=", 1)[0].lstrip("+~").strip()


# Keys the study sets for every run itself: the rate and seed come after --override on the command
# line (``run_overrides``), so an override of them is dropped; the run directory comes before it, so
# an override would train every run into one folder (the second resumes the first's checkpoints).
STUDY_KEYS = {"optim.lr": "--lrs", "optim.min_lr": "--lrs", "trainer.seed": "--seeds", "trainer.run_dir": "--out"}


def check_arch_overrides(archs: Sequence[str], overrides: Sequence[str]) -> None:
    """An --override of a key that an arch fixes (``orthros_sinks``'s ``model.sink_tokens``) would
    be dropped for that arch (its own ``++`` override comes last and wins) while the report labels
    the row by the arch's value; ``model.attention_type`` is what every arch is; ``STUDY_KEYS`` are
    set per run by the study. All refused, naming the override and the flag or arch to use,
    instead of a study that silently trains something else."""
    for override in overrides:
        key = _override_key(override)
        if key in STUDY_KEYS:
            flag = STUDY_KEYS[key]
            raise UserError(f"--override {override}: the study sets {key} of every run itself (from {flag}), so the "
                            f"override would be dropped or would mix the runs; use {flag} instead")
        if key == "model.attention_type":
            raise UserError(f"--override {override}: model.attention_type is what each of --archs "
                            f"{','.join(archs)} trains; choose the models with --archs instead")
        for arch in archs:
            fixed = {_override_key(o): o.lstrip("+") for o in EXTRA_ARCHS.get(arch, (arch, []))[1]}
            if key in fixed:
                raise UserError(f"--override {override} sets {key}, which --archs {arch} fixes ({fixed[key]}): "
                                f"the arch's value would win and the report label its row by it; drop the override, "
                                f"or train it as another arch (e.g. --archs orthros --override {override})")
    for override in overrides:
        if not _override_key(override):
            raise UserError(f"--override {override!r} names no key: give key=value (e.g. trainer.max_steps=100)")


def check_seeds_and_rates(seeds: Sequence[int], lrs: Sequence[float]) -> None:
    """At least one of each; seeds distinct (a repeated seed is the same run twice); rates finite and > 0."""
    if not seeds:
        raise UserError("--seeds needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {','.join(map(str, seeds))} repeats a seed; give each seed once")
    if not lrs:
        raise UserError("--lrs needs at least one learning rate (one: no sweep)")
    bad = [lr for lr in lrs if not (math.isfinite(lr) and 0 < lr <= 1)]
    if bad:  # above 1 is a typo (3e3 for 3e-3) the trainer would refuse only after the study started
        raise UserError(f"--lrs {','.join(f'{lr:g}' for lr in lrs)}: every rate must be a finite number > 0 "
                         f"and at most 1 ({', '.join(f'{lr:g}' for lr in bad)} is not)")
    if len(set(lrs)) != len(lrs):
        raise UserError(f"--lrs {','.join(f'{lr:g}' for lr in lrs)} repeats a rate; give each rate once")


def _log(msg: str) -> None:
    """The study's progress line (``orthros-study`` shows the package's log on stdout)."""
    logger.info("[orthros-study %s] %s", time.strftime("%H:%M:%S"), msg)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:  # not Linux
        return "n/a"


def run_name(lr: float, seed: int) -> str:
    return f"lr{lr:g}-seed{seed}"


def run_overrides(lr: float, seed: int) -> list[str]:
    """What one run of the sweep or of the seeds sets on top of the recipe (constant rate after warm-up)."""
    return [f"optim.lr={lr:g}", f"optim.min_lr={lr:g}", f"trainer.seed={seed}"]


def train_command(arch: str, run_dir: Path, overrides: list[str], recipe: str | None = None) -> list[str]:
    """The real CLI (``orthros-train``) in a fresh interpreter: the study trains like a user does.
    ``recipe``: the config name (default ``study/<arch>``)."""
    return [sys.executable, "-m", "orthros_train.train.cli", "--config-name", recipe or f"study/{arch}",
            f"trainer.run_dir={run_dir}", *overrides]


def train_run(arch: str, run_dir: Path, overrides: list[str], log: Callable[[str], None] = _log,
              threads: int | None = 1, recipe: str | None = None, stop_after_s: float | None = None,
              overwrite: bool = False) -> float:
    """Train one run into ``run_dir`` (its output in ``train.log``); returns seconds.

    A finished run of the same command is reused, a partial one resumed, a run of another command
    refused; ``overwrite`` deletes it first (``study/runs.py``). ``threads``: OMP_NUM_THREADS of the
    training process. One thread measured ~3x faster than two on the shared 2-core machine (OpenMP
    workers wait on each other when the cores are busy). ``stop_after_s``: a time budget; past it
    the run gets SIGTERM, which the trainer answers by finishing its step and saving a checkpoint
    (it then exits 0, without the final export).
    """
    from orthros_train.study.runs import train_or_reuse

    cmd = train_command(arch, Path(run_dir), overrides, recipe)
    return train_or_reuse(cmd, Path(run_dir), log, threads, stop_after_s, overwrite)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_trained(run_dirs: Sequence[Path], why: str) -> None:
    """Every run the study reads but does not train holds a finished run (metrics, recipe, final
    checkpoint); otherwise one message names each missing piece and the fix."""
    missing = []
    for run_dir in run_dirs:
        lacks = [name for name in ("metrics.jsonl", "recipe.json", "checkpoints/final/config.json")
                 if not (Path(run_dir) / name).is_file()]
        if lacks:
            missing.append(f"{run_dir} (no {', '.join(lacks)})")
    if missing:
        shown = "; ".join(missing[:6]) + (f"; and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise UserError(
            f"{why}, but these runs are not trained: {shown}. Point --out at the folder of a study that trained "
            "them, train them (drop --skip-train, or list them in --train-archs), or match --archs/--lrs/--seeds "
            "to the runs that exist"
        )


def held_out_essays(data: dict[str, Any]) -> list[list[int]]:
    """Token ids of the corpus documents the run held out (the last ``valid_documents``)."""
    from orthros_train.data import DataConfig, prepare_embedded
    from orthros_train.eval.ppl import indexed_documents

    cfg = DataConfig(**data)
    output, _ = prepare_embedded(cfg)
    docs = list(indexed_documents(output))
    return docs[-cfg.valid_documents:]


def _accuracy(correct: Sequence[bool]) -> float | None:
    return sum(correct) / len(correct) if correct else None


def recall_eval(model: torch.nn.Module, tokenizer, data: dict[str, Any], seq_len: int, documents: int
                ) -> dict[str, Any]:
    """Recall accuracy on fresh documents from the training task's generator (a seed it never used)."""
    from orthros_train.data.embedded import EOD_TOKEN
    from orthros_train.data.synthetic_recall import RecallMix, make_recall_document
    from orthros_train.eval.recall import score_sample, summarize

    mix = RecallMix.from_dict(data["recall_mix"])
    eod = tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    ranges = mix.ranges(len(tokenizer), reserved=(eod,))
    rng = random.Random(1_000_003 + mix.seed)  # training documents use mix.seed
    length = (mix.length or seq_len) - 1  # as trained: the document before its EOD
    window = model.config.sliding_window
    correct: list[bool] = []
    distances: list[int] = []
    for _ in range(documents):
        doc = make_recall_document(rng, length, mix.pairs_of_document(rng), ranges)
        correct.extend(score_sample(model, doc))
        distances.extend(doc.distances)
    return {
        "documents": documents,
        "queries": len(correct),
        "chance": mix.chance,
        "accuracy": _accuracy(correct),
        "accuracy_within_window": _accuracy([c for c, d in zip(correct, distances) if d < window]),
        "accuracy_beyond_window": _accuracy([c for c, d in zip(correct, distances) if d >= window]),
        "buckets": summarize(correct, distances, window, length + 1),
    }


def passkey_haystack_length(seq_len: int) -> int:
    """The longest even haystack whose query lands where training put a key followed by a value.

    A training document is ``seq_len - 1`` tokens and its EOD; its last key (position
    ``seq_len - 2``) is always followed by the EOD, so the models learn to predict the EOD there
    (dense and Orthros can tell the position, a sliding window cannot). The query must come
    earlier: haystack + needle + query <= ``seq_len - 2`` tokens, with the query on an even
    position so that a key-value haystack stays in step around the needle.
    """
    return (seq_len - 5) // 2 * 2


def passkey_ranges(window: int, seq_len: int) -> dict[str, tuple[int, int]]:
    """Needle distances probed: inside the window, and 4-8 windows back (capped by the trained length)."""
    far = (4 * window, min(8 * window, passkey_haystack_length(seq_len)))
    if far[0] > far[1]:
        raise UserError(f"seq_len {seq_len} is too short for a needle 4 windows (4 x {window}) back")
    return {"within_window": (2, window - 1), "4-8x_window": far}


def passkey_eval(model: torch.nn.Module, tokenizer, data: dict[str, Any], essays: list[list[int]], seq_len: int,
                 documents: int, ranges: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """One key-value needle, asked for again at the end of the sequence: accuracy per distance range.

    Two haystacks: ``pairs``, a recall document of the training task over other keys (the
    distribution the models were trained on), and ``essays``, held-out prose (a needle in a
    context the models never saw one in). ``ranges``: name -> (lowest, highest) distance
    (default ``passkey_ranges``: inside the window and 4-8 windows back).
    """
    from orthros_train.data.embedded import EOD_TOKEN
    from orthros_train.data.passkey import haystack_slice
    from orthros_train.data.synthetic_recall import RecallMix, make_passkey_document, make_recall_document
    from orthros_train.eval.recall import score_sample

    mix = RecallMix.from_dict(data["recall_mix"])
    eod = tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    token_ranges = mix.ranges(len(tokenizer), reserved=(eod,))
    text = [t for doc in essays for t in doc if t != eod]
    haystack_len = passkey_haystack_length(seq_len)
    if len(text) < haystack_len:
        raise UserError(f"held-out essays have {len(text)} tokens, fewer than one {haystack_len}-token haystack")
    rng = random.Random(2_000_003 + mix.seed)
    out: dict[str, Any] = {"documents": documents, "chance": mix.chance}
    for haystack in ("pairs", "essays"):
        out[haystack] = {}
        for name, (lo, hi) in (ranges or passkey_ranges(model.config.sliding_window, seq_len)).items():
            correct = []
            for _ in range(documents):
                distance = rng.randint(lo, hi)
                if haystack == "pairs":
                    hay = make_recall_document(rng, haystack_len, mix.pairs_of_document(rng), token_ranges).input_ids
                    distance += distance % 2 if distance < hi else -(distance % 2)  # even: the needle on a key slot
                else:
                    hay = haystack_slice(rng, text, haystack_len)
                correct.extend(score_sample(model, make_passkey_document(rng, hay, distance, token_ranges)))
            out[haystack][name] = {"low": lo, "high": hi, "accuracy": _accuracy(correct)}
    return out


def evaluate_checkpoint(ckpt: Path, data: dict[str, Any], seq_len: int, recall_documents: int,
                        passkey_documents: int, valid_tokens: int | None = None,
                        passkey_distances: dict[str, tuple[int, int]] | None = None,
                        tokenizer_from: Path | None = None, **config_overrides: Any) -> dict[str, Any]:
    """Held-out essay loss (overall, per position bucket), recall vs distance and passkey of one
    checkpoint, on the held-out data of the run recipe's ``data`` section, at ``seq_len`` tokens.

    ``config_overrides``: config fields that change no weight (``rope_scaling``, ``attention_type``).
    ``tokenizer_from``: where the tokenizer is read (default ``ckpt``; transformers' AutoTokenizer
    parses the checkpoint's config.json and fails on one with YaRN scaling).
    """
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.eval.ppl import run_ppl
    from orthros_train.infer.loading import load_model

    model = load_model(ckpt, device="cpu", **config_overrides)
    tokenizer = load_tokenizer(tokenizer_from or ckpt, pad_with_eos=True)
    essays = held_out_essays(data)
    ppl = run_ppl(model, essays, seq_len=seq_len, batch_tokens=8 * seq_len, max_tokens=valid_tokens, log=None)
    cfg = model.config
    return {
        "attention_type": cfg.attention_type,
        "parameters": cfg.num_parameters(),
        "config": cfg.to_dict(),
        "essay_valid": {k: ppl[k] for k in ("loss", "perplexity", "tokens", "windows", "buckets")},
        "recall": recall_eval(model, tokenizer, data, seq_len, recall_documents),
        "passkey": passkey_eval(model, tokenizer, data, essays, seq_len, passkey_documents, passkey_distances),
    }


def evaluate_run(run_dir: Path, opts: StudyOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Validation loss (overall, per position bucket), recall vs distance, passkey and training facts of a run."""
    run_dir = Path(run_dir)
    recipe = json.loads((run_dir / "recipe.json").read_text())
    seq_len = recipe["trainer"]["seq_len"]
    metrics = read_metrics(run_dir)
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    last = [m["loss"] for m in metrics[-10:]]
    log(f"evaluate {run_dir.parent.name}/{run_dir.name}: essays, recall, passkey")
    measured = evaluate_checkpoint(run_dir / "checkpoints" / "final", recipe["data"], seq_len, opts.recall_documents,
                                   opts.passkey_documents, opts.valid_tokens)
    timing = run_dir / "study_train.json"  # written by train_run
    return {
        **{k: measured[k] for k in ("attention_type", "parameters", "config")},
        "steps": metrics[-1]["step"],
        "tokens": metrics[-1]["consumed_samples"] * seq_len,
        "seq_len": seq_len,
        "seed": recipe["trainer"]["seed"],
        "lr": recipe["optim"]["lr"],
        "git_commit": recipe.get("git_commit"),
        "train_seconds": json.loads(timing.read_text())["seconds"] if timing.is_file() else None,
        "final_train_loss": sum(last) / len(last),  # mean of the last 10 steps: one step is noisy
        "blend_valid_loss": evals[-1]["eval_loss"] if evals else None,  # trainer's eval: essays + synthetic
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics),
        **{k: measured[k] for k in ("essay_valid", "recall", "passkey")},
        "curve": [{"step": m["step"], "loss": m["loss"], "eval_loss": m.get("eval_loss")} for m in metrics],
    }


def pick_lr(sweep: dict[Any, float | None]) -> Any:
    """The rate (or setting) with the lowest held-out blend loss (a run without one, e.g. diverged, never wins)."""
    scored = {lr: loss for lr, loss in sweep.items() if loss is not None and math.isfinite(loss)}
    if not scored:
        raise UserError(f"no run of the sweep {sorted(sweep)} has a finite held-out loss (every run diverged or "
                        "failed): lower --lrs, or read the runs' train.log")
    return min(scored, key=lambda lr: scored[lr])


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample standard deviation, min and max over seeds (None entries skipped)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the report compares, each as ``spread`` over the seeds of one architecture."""
    def bucket_acc(j: int) -> dict[str, Any]:
        return spread([r["recall"]["buckets"][j]["accuracy"] for r in runs])

    first = runs[0]
    return {
        "seeds": [r["seed"] for r in runs],
        "essay_loss": spread([r["essay_valid"]["loss"] for r in runs]),
        "essay_loss_beyond_window": spread([_loss_beyond_window(r) for r in runs]),
        "blend_valid_loss": spread([r["blend_valid_loss"] for r in runs]),
        "final_train_loss": spread([r["final_train_loss"] for r in runs]),
        "recall_within_window": spread([r["recall"]["accuracy_within_window"] for r in runs]),
        "recall_beyond_window": spread([r["recall"]["accuracy_beyond_window"] for r in runs]),
        "recall_buckets": [{**{k: b[k] for k in ("label", "low", "high", "beyond_window", "queries")},
                            "accuracy": bucket_acc(j)} for j, b in enumerate(first["recall"]["buckets"])],
        "passkey": {hay: {name: spread([r["passkey"][hay][name]["accuracy"] for r in runs]) for name in ranges}
                    for hay, ranges in first["passkey"].items() if isinstance(ranges, dict)},
        "train_seconds": spread([r["train_seconds"] for r in runs]),
    }


def _loss_beyond_window(r: dict[str, Any]) -> float | None:
    return loss_between(r, r["essay_valid"]["buckets"][0]["high"])


def loss_between(r: dict[str, Any], low: int, high: int | None = None) -> float | None:
    """Token-weighted essay loss of the position buckets inside ``[low, high)`` (``high`` None: to the end)."""
    inside = [b for b in r["essay_valid"]["buckets"]
              if b["low"] >= low and (high is None or b["high"] <= high) and b["tokens"]]
    return sum(b["loss"] * b["tokens"] for b in inside) / sum(b["tokens"] for b in inside) if inside else None


def prefill_eval(ckpt: Path, opts: StudyOptions) -> dict[str, Any]:
    """Time to first token: Orthros, the dense model on the same weights (the default, fastest
    attention backend) and transformers' SDPA Llama of the same shape (``eval/bench.py``)."""
    from orthros_train.eval.bench import bench_prefill

    threads = torch.get_num_threads()
    torch.set_num_threads(opts.prefill_threads)
    try:
        return bench_prefill(str(ckpt), opts.prefill_lengths, device="cpu", decode_tokens=0,
                             repeats=opts.prefill_repeats, log=None)
    finally:
        torch.set_num_threads(threads)


def _train_archs(opts: StudyOptions) -> tuple[str, ...]:
    return () if opts.skip_train else (opts.train_archs or opts.archs)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside (a study's evaluation), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the stages' results --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyStart:
    """What the study ran with and where: the first entries of ``study.json``."""

    date: str
    git_commit: str | None
    command: str | None
    quick: bool
    overrides: tuple[str, ...]  # of every run
    seeds: tuple[int, ...]
    lrs: tuple[float, ...]
    cpu_count: int | None
    load_average: str

    def to_json(self) -> dict[str, Any]:
        return {"date": self.date, "git_commit": self.git_commit, "command": self.command, "quick": self.quick,
                "overrides": list(self.overrides), "seeds": list(self.seeds), "lrs": list(self.lrs),
                "cpu_count": self.cpu_count, "load_average_start": self.load_average}


@dataclass(frozen=True)
class RateSweep:
    """One model's learning-rate sweep at the first seed: the held-out blend loss of every rate, the kept rate."""

    seed: int
    best_lr: float
    losses: Mapping[float, float | None]

    def to_json(self, rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """``rows``: every rate's run evaluated (``_sweep_row``), by rate."""
        return {"seed": self.seed, "best_lr": self.best_lr,
                "blend_valid_loss": {f"{lr:g}": loss for lr, loss in self.losses.items()}, "runs": dict(rows)}


@dataclass(frozen=True)
class Training:
    """The sweep and the seeds: every model's sweep, and the training as a whole."""

    sweeps: Mapping[str, RateSweep]
    wall_seconds: float | None  # None: nothing trained here (--skip-train)
    load_average: str

    def to_json(self) -> dict[str, Any]:
        return {"train_wall_seconds": self.wall_seconds, "load_average_after_training": self.load_average}


@dataclass(frozen=True)
class ModelEvaluation:
    """One model's runs evaluated: the sweep's row of every rate, and every seed at the kept rate."""

    sweep_rows: Mapping[str, dict[str, Any]]
    runs: tuple[dict[str, Any], ...]  # evaluate_run's record of each seed


@dataclass(frozen=True)
class Prefill:
    """Time to first token (``prefill_eval``) and the load it was measured under."""

    load_average: str
    measured: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"load_average_prefill": self.load_average, "prefill": self.measured}


@dataclass(frozen=True)
class StudyOutcome:
    """Every stage's result; ``to_json`` is ``study.json``, in its order of keys."""

    start: StudyStart
    training: Training
    evaluations: Mapping[str, ModelEvaluation]
    prefill: Prefill | None
    load_average_end: str
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        evaluations, sweeps = self.evaluations, self.training.sweeps
        return {**self.start.to_json(),
                "sweep": {arch: sweeps[arch].to_json(e.sweep_rows) for arch, e in evaluations.items()},
                "runs": {arch: list(e.runs) for arch, e in evaluations.items()},
                "summary": {arch: aggregate(list(e.runs)) for arch, e in evaluations.items()},
                **self.training.to_json(), **(self.prefill.to_json() if self.prefill is not None else {}),
                "load_average_end": self.load_average_end, "study_wall_seconds": self.wall_seconds}


# -- the stages -----------------------------------------------------------------------------------------------


def run_study(opts: StudyOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Sweep, train the seeds (unless ``skip_train``), evaluate, time the prefill; writes ``study.json`` and the
    report. Finished runs are reused, partial ones resumed (``study/runs.py``)."""
    overrides = _study_overrides(opts)
    start = _study_start(opts, overrides)
    started = time.perf_counter()
    if opts.overwrite:  # the report of the runs about to be replaced must not outlive them
        _refuse_linked_runs(opts)  # before anything is deleted: a refusal leaves the study as it was
        _remove_stale_reports(opts, log)
    sweeps, trained = _train_sweep_and_seeds(opts, overrides, log)
    training = Training(sweeps, time.perf_counter() - started if trained else None, load_average())
    with torch_threads(opts.eval_threads):
        evaluations = {arch: _evaluate_model(arch, sweeps[arch].best_lr, opts, log) for arch in opts.archs}
    prefill = _time_prefill(opts, sweeps, log)
    outcome = StudyOutcome(start, training, evaluations, prefill, load_average(), time.perf_counter() - started)
    results = outcome.to_json()
    _check_finite(results)
    _write_study(opts, results, log)
    return results


def _study_overrides(opts: StudyOptions) -> list[str]:
    """The Hydra overrides of every run: the quick shape, --steps, then --override."""
    overrides = list(QUICK_OVERRIDES if opts.quick else [])
    if opts.steps is not None:
        overrides.append(f"trainer.max_steps={opts.steps}")
    return overrides + list(opts.overrides)


def _study_start(opts: StudyOptions, overrides: list[str]) -> StudyStart:
    from orthros_train.train.cli import git_commit

    return StudyStart(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      git_commit=git_commit(),  # the commit the study's code ran from (the runs record theirs too)
                      command=opts.command, quick=opts.quick, overrides=tuple(overrides), seeds=tuple(opts.seeds),
                      lrs=tuple(opts.lrs), cpu_count=os.cpu_count(), load_average=load_average())


def _refuse_linked_runs(opts: StudyOptions) -> None:
    """--overwrite deletes each run directory ``<out>/<arch>/<run>``: a model folder or a run
    directory that is a symbolic link would have it delete outside --out, so both are refused
    up front, before the reports or any run are removed."""
    from orthros_train.study.runs import refuse_symlink

    for arch in opts.archs:
        refuse_symlink(Path(opts.out) / arch, "model folder")
        for lr, seed in itertools.product(opts.lrs, opts.seeds):
            refuse_symlink(Path(opts.out) / arch / run_name(lr, seed), "run directory")


def _remove_stale_reports(opts: StudyOptions, log: Callable[[str], None]) -> None:
    from orthros_train.study.runs import remove_stale

    stale = [Path(opts.out) / "study.json"]
    if opts.report is not None:
        stale += [Path(opts.report), Path(opts.report).parent / Path(opts.report).stem]
    remove_stale(stale, log)


def _time_prefill(opts: StudyOptions, sweeps: Mapping[str, RateSweep], log: Callable[[str], None]) -> Prefill | None:
    """The prefill benchmark on the kept Orthros run of the first seed (none without Orthros or lengths)."""
    if "orthros" not in opts.archs or not opts.prefill_lengths:
        return None
    log(f"prefill benchmark at {opts.prefill_lengths} tokens (load average {load_average()})")
    load = load_average()
    best = sweeps["orthros"].best_lr
    return Prefill(load, prefill_eval(Path(opts.out) / "orthros" / run_name(best, opts.seeds[0]) / "checkpoints"
                                      / "final", opts))


def _write_study(opts: StudyOptions, results: dict[str, Any], log: Callable[[str], None]) -> None:
    """``<out>/study.json`` and the report."""
    from orthros_train.eval.common import write_json

    write_json(results, Path(opts.out) / "study.json")
    if opts.report is not None:
        from orthros_train.study.report import write_report

        notes = Path(opts.notes).read_text() if opts.notes else None
        write_report(results, Path(opts.report), notes)
        log(f"report: {opts.report}")


def _train_sweep_and_seeds(opts: StudyOptions, overrides: list[str], log: Callable[[str], None]
                           ) -> tuple[dict[str, RateSweep], tuple[str, ...]]:
    """The sweep of every model first (its runs are independent), then the other seeds at the kept
    rates; returns every model's sweep and the models it trained."""
    from orthros_train.study.runs import run_parallel

    out, train = Path(opts.out), _train_archs(opts)

    def one(arch: str, lr: float, seed: int) -> float:
        recipe, extra = EXTRA_ARCHS.get(arch, (arch, []))
        return train_run(recipe, out / arch / run_name(lr, seed), overrides + extra + run_overrides(lr, seed),
                         log, opts.train_threads, overwrite=opts.overwrite)

    # What is read but not trained must exist before anything trains (a study takes hours).
    reused = [a for a in opts.archs if a not in train]
    why = "--skip-train evaluates existing runs" if opts.skip_train else f"--train-archs leaves {reused} to --out"
    check_trained([out / arch / run_name(lr, opts.seeds[0]) for arch in reused for lr in opts.lrs], why)
    run_parallel(one, [(arch, lr, opts.seeds[0]) for arch in train for lr in opts.lrs], opts.jobs)
    sweeps = {arch: _read_sweep(out / arch, opts, log) for arch in opts.archs}
    check_trained([out / arch / run_name(sweeps[arch].best_lr, seed) for arch in reused for seed in opts.seeds[1:]],
                  why)
    run_parallel(one, [(arch, sweeps[arch].best_lr, seed) for arch in train for seed in opts.seeds[1:]], opts.jobs)
    return sweeps, train


def _read_sweep(model_dir: Path, opts: StudyOptions, log: Callable[[str], None]) -> RateSweep:
    """One model's sweep as its runs' metrics tell it: the last held-out blend loss of every rate."""
    sweep: dict[float, float | None] = {}
    for lr in opts.lrs:
        evals = [m["eval_loss"] for m in read_metrics(model_dir / run_name(lr, opts.seeds[0]))
                 if m.get("eval_loss") is not None]
        sweep[lr] = evals[-1] if evals else None
    best = pick_lr(sweep)
    log(f"{model_dir.name}: learning rate {best:g} (held-out blend loss {sweep[best]:.3f})")
    return RateSweep(opts.seeds[0], best, sweep)


def _evaluate_model(arch: str, best: float, opts: StudyOptions, log: Callable[[str], None]) -> ModelEvaluation:
    """Every run of one model's sweep and of its seeds; the kept rate's runs make ``runs`` and ``summary``."""
    out = Path(opts.out)
    sweep_runs = {f"{lr:g}": evaluate_run(out / arch / run_name(lr, opts.seeds[0]), opts, log)
                  for lr in opts.lrs if lr != best}
    rows = {lr: _sweep_row(r) for lr, r in sweep_runs.items()}
    runs = [evaluate_run(out / arch / run_name(best, seed), opts, log) for seed in opts.seeds]
    rows[f"{best:g}"] = _sweep_row(runs[0])
    return ModelEvaluation(rows, tuple(runs))


def _sweep_row(r: dict[str, Any]) -> dict[str, Any]:
    return {"blend_valid_loss": r["blend_valid_loss"], "essay_loss": r["essay_valid"]["loss"],
            "recall": r["recall"]["accuracy"], "train_seconds": r["train_seconds"]}


def rerender_report(opts: StudyOptions) -> dict[str, Any]:
    """Write the report again from ``<out>/study.json`` (e.g. with new ``notes``), measuring nothing."""
    from orthros_train.study.report import write_report

    if opts.report is None:
        raise UserError("--report-only needs a --report path")
    results = read_results(Path(opts.out) / "study.json", "study")
    write_report(results, Path(opts.report), Path(opts.notes).read_text() if opts.notes else None)
    return results


def read_results(source: Path, what: str) -> dict[str, Any]:
    """The JSON a finished ``what`` wrote, for ``--report-only``; a missing or broken file is named with the fix."""
    if not source.is_file():
        raise UserError(f"--report-only rewrites the report from {source}, which does not exist: point --out at "
                         f"a finished {what}'s folder")
    try:
        return json.loads(source.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{source} is not valid JSON ({err}): rerun the study or restore the file") from err


def _check_finite(results: dict[str, Any]) -> None:
    """A NaN in a table is a bug in the pipeline, not a finding: fail loudly."""
    for arch, runs in results["runs"].items():
        for r in runs:
            for value, what in ((r["final_train_loss"], "training loss"), (r["essay_valid"]["loss"], "essay loss")):
                if not math.isfinite(value):
                    raise ValueError(f"{arch} seed {r['seed']}: {what} is {value}")
