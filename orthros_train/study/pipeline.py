"""Train the study's three runs, evaluate their checkpoints, collect every number in one dict."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ARCHS = ("orthros", "dense", "sliding")

# The reduced study (--quick, tests/test_study.py): a ~0.2M-parameter shape and a few dozen
# steps, enough to run every stage end to end in about a minute per run on the shared CPU.
QUICK_OVERRIDES = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.intermediate_size=128",
    "model.sliding_window=16",
    "trainer.seq_len=128",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=24",
    "trainer.eval_every=12",
    "trainer.eval_batches=1",
    "optim.warmup_steps=4",
    "data.recall_mix.documents=200",
    "data.recall_mix.pairs=8",
    "data.recall_mix.keys=32",
]


@dataclass
class StudyOptions:
    out: Path = Path("runs/study")  # run directories and study.json
    report: Path | None = Path("docs/study.md")  # None: no report (figures go beside it, in <stem>/)
    archs: tuple[str, ...] = ARCHS
    steps: int | None = None  # trainer.max_steps for every run (None: the recipes')
    quick: bool = False
    skip_train: bool = False  # evaluate existing run directories only
    train_archs: tuple[str, ...] | None = None  # the runs to (re)train (None: all of ``archs``)
    overrides: list[str] = field(default_factory=list)  # extra Hydra overrides for every run
    train_threads: int | None = 1  # OMP threads of each training process (None: inherit)
    recall_documents: int = 64  # held-out synthetic documents scored per model
    valid_tokens: int | None = None  # cap on held-out essay tokens (None: all of them)
    prefill_lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    prefill_repeats: int = 1
    prefill_threads: int = 1  # one thread: process CPU time is then compute time, robust to load
    notes: Path | None = None  # hand-written analysis included in the report verbatim
    command: str | None = None  # how the study was invoked (recorded in the report)


def _log(msg: str) -> None:
    print(f"[orthros-study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:  # not Linux
        return "n/a"


def train_command(arch: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """The real CLI (``orthros-train``) in a fresh interpreter: the study trains like a user does."""
    return [sys.executable, "-m", "orthros_train.train.cli", "--config-name", f"study/{arch}",
            f"trainer.run_dir={run_dir}", *overrides]


def train_run(arch: str, run_dir: Path, overrides: list[str], log: Callable[[str], None] = _log,
              threads: int | None = 1) -> float:
    """Train one run from scratch into ``run_dir`` (its output in ``train.log``); returns seconds.

    ``threads``: OMP_NUM_THREADS of the training process. One thread measured ~3x faster than
    two on the shared 2-core machine (OpenMP workers wait on each other when the cores are busy).
    """
    run_dir = Path(run_dir)
    if run_dir.exists():
        # A leftover run would be resumed (trainer.resume=auto) and its metrics appended to. What
        # a dry run of the recipe leaves (Hydra's .hydra/ and log) counts as a run directory too.
        ours = {".hydra", "cli.log", "train.log"}
        if not (run_dir / "recipe.json").is_file() and not {p.name for p in run_dir.iterdir()} <= ours:
            raise FileExistsError(f"{run_dir} exists and is not a study run directory; pick another --out")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = train_command(arch, run_dir, overrides)
    log(f"train {arch}: {' '.join(cmd[1:])}")
    start = time.perf_counter()
    env = os.environ.copy()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with (run_dir / "train.log").open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (run_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"training {arch} failed (exit {proc.returncode}); end of {run_dir}/train.log:\n{tail}")
    log(f"train {arch}: done in {seconds / 60:.1f} min")
    (run_dir / "study_train.json").write_text(json.dumps({"seconds": seconds, "command": cmd[1:]}) + "\n")
    return seconds


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out_essays(data: dict[str, Any]) -> list[list[int]]:
    """Token ids of the corpus documents the run held out (the last ``valid_documents``)."""
    from orthros_train.data import DataConfig, prepare_embedded
    from orthros_train.eval.ppl import indexed_documents

    cfg = DataConfig(**data)
    output, _ = prepare_embedded(cfg)
    docs = list(indexed_documents(output))
    return docs[-cfg.valid_documents:]


def recall_eval(model: torch.nn.Module, tokenizer, data: dict[str, Any], seq_len: int, documents: int
                ) -> dict[str, Any]:
    """MQAR accuracy on fresh documents from the training task's generator (a seed it never used)."""
    from orthros_train.data.embedded import EOD_TOKEN
    from orthros_train.data.synthetic_recall import RecallMix, make_recall_document, token_ranges
    from orthros_train.eval.recall import score_sample, summarize

    mix = RecallMix.from_dict(data["recall_mix"])
    eod = tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    ranges = token_ranges(len(tokenizer), mix.keys, reserved=(eod,))
    rng = random.Random(1_000_003 + mix.seed)  # training documents use mix.seed
    length = (mix.length or seq_len) - 1  # as trained: the document before its EOD
    window = model.config.sliding_window
    correct: list[bool] = []
    distances: list[int] = []
    for _ in range(documents):
        doc = make_recall_document(rng, length, mix.pairs, ranges, mix.min_distance)
        correct.extend(score_sample(model, doc))
        distances.extend(doc.distances)
    within = [c for c, d in zip(correct, distances) if d < window]
    beyond = [c for c, d in zip(correct, distances) if d >= window]
    return {
        "documents": documents,
        "queries": len(correct),
        "chance": 1.0 / mix.keys,  # a value drawn uniformly from the value range
        "accuracy": sum(correct) / len(correct),
        "accuracy_within_window": sum(within) / len(within) if within else None,
        "accuracy_beyond_window": sum(beyond) / len(beyond) if beyond else None,
        "buckets": summarize(correct, distances, window, length + 1),
    }


def evaluate_run(run_dir: Path, opts: StudyOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Validation loss (overall, per position bucket), recall vs distance and training facts of a run."""
    from orthros_train.eval.ppl import run_ppl
    from orthros_train.infer.loading import load_model, load_tokenizer

    run_dir = Path(run_dir)
    recipe = json.loads((run_dir / "recipe.json").read_text())
    ckpt = run_dir / "checkpoints" / "final"
    model = load_model(ckpt, device="cpu")
    tokenizer = load_tokenizer(ckpt)
    seq_len = recipe["trainer"]["seq_len"]
    metrics = read_metrics(run_dir)
    evals = [m for m in metrics if m.get("eval_loss") is not None]
    last = [m["loss"] for m in metrics[-10:]]
    log(f"evaluate {run_dir.name}: held-out essays")
    ppl = run_ppl(model, held_out_essays(recipe["data"]), seq_len=seq_len, batch_tokens=8 * seq_len,
                  max_tokens=opts.valid_tokens, log=None)
    log(f"evaluate {run_dir.name}: recall on {opts.recall_documents} held-out synthetic documents")
    recall = recall_eval(model, tokenizer, recipe["data"], seq_len, opts.recall_documents)
    cfg = model.config
    return {
        "attention_type": cfg.attention_type,
        "parameters": cfg.num_parameters(),
        "config": cfg.to_dict(),
        "steps": metrics[-1]["step"],
        "tokens": metrics[-1]["consumed_samples"] * seq_len,
        "seq_len": seq_len,
        "seed": recipe["trainer"]["seed"],
        "git_commit": recipe.get("git_commit"),
        "final_train_loss": sum(last) / len(last),  # mean of the last 10 steps: one step is noisy
        "blend_valid_loss": evals[-1]["eval_loss"] if evals else None,  # trainer's eval: essays + synthetic
        "mean_tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics),
        "essay_valid": {k: ppl[k] for k in ("loss", "perplexity", "tokens", "windows", "buckets")},
        "recall": recall,
        "curve": [{"step": m["step"], "loss": m["loss"], "eval_loss": m.get("eval_loss")} for m in metrics],
    }


def prefill_eval(ckpt: Path, opts: StudyOptions) -> dict[str, Any]:
    """Time to first token with Orthros and with dense attention on the Orthros run's weights."""
    from orthros_train.eval.bench import bench_prefill

    threads = torch.get_num_threads()
    torch.set_num_threads(opts.prefill_threads)
    try:
        return bench_prefill(str(ckpt), opts.prefill_lengths, device="cpu", decode_tokens=0,
                             repeats=opts.prefill_repeats, log=None)
    finally:
        torch.set_num_threads(threads)


def run_study(opts: StudyOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Train (unless ``skip_train``), evaluate, write ``study.json`` and the report; returns the results."""
    out = Path(opts.out)
    from orthros_train.train.cli import git_commit

    overrides = list(QUICK_OVERRIDES if opts.quick else [])
    if opts.steps is not None:
        overrides.append(f"trainer.max_steps={opts.steps}")
    overrides += list(opts.overrides)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git_commit": git_commit(),  # the commit the study's code ran from (the runs record theirs too)
        "command": opts.command,
        "quick": opts.quick,
        "overrides": overrides,
        "cpu_count": os.cpu_count(),
        "load_average_start": load_average(),
        "train_seconds": {},
        "runs": {},
    }
    if not opts.skip_train:
        for arch in opts.train_archs or opts.archs:
            results["train_seconds"][arch] = train_run(arch, out / arch, overrides, log, opts.train_threads)
    results["load_average_after_training"] = load_average()
    for arch in opts.archs:
        results["runs"][arch] = evaluate_run(out / arch, opts, log)
        timing = out / arch / "study_train.json"  # written by train_run, also for runs trained earlier
        if arch not in results["train_seconds"] and timing.is_file():
            results["train_seconds"][arch] = json.loads(timing.read_text())["seconds"]
        results["runs"][arch]["train_seconds"] = results["train_seconds"].get(arch)
    if "orthros" in opts.archs and opts.prefill_lengths:
        log(f"prefill benchmark at {opts.prefill_lengths} tokens (load average {load_average()})")
        results["load_average_prefill"] = load_average()
        results["prefill"] = prefill_eval(out / "orthros" / "checkpoints" / "final", opts)
    results["load_average_end"] = load_average()
    _check_finite(results)
    from orthros_train.eval.common import write_json

    write_json(results, out / "study.json")
    if opts.report is not None:
        from orthros_train.study.report import write_report

        notes = Path(opts.notes).read_text() if opts.notes else None
        write_report(results, Path(opts.report), notes)
        log(f"report: {opts.report}")
    return results


def rerender_report(opts: StudyOptions) -> dict[str, Any]:
    """Write the report again from ``<out>/study.json`` (e.g. with new ``notes``), measuring nothing."""
    from orthros_train.study.report import write_report

    if opts.report is None:
        raise ValueError("--report-only needs a --report path")
    results = json.loads((Path(opts.out) / "study.json").read_text())
    write_report(results, Path(opts.report), Path(opts.notes).read_text() if opts.notes else None)
    return results


def _check_finite(results: dict[str, Any]) -> None:
    """A NaN in a table is a bug in the pipeline, not a finding: fail loudly."""
    for arch, r in results["runs"].items():
        for key in ("final_train_loss",):
            if not math.isfinite(r[key]):
                raise ValueError(f"{arch}: {key} is {r[key]}")
        if not math.isfinite(r["essay_valid"]["loss"]):
            raise ValueError(f"{arch}: validation loss is {r['essay_valid']['loss']}")
