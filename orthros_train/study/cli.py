"""``orthros-study``: run the replication study and write its report (``<out>/study.md``; the committed one is
docs/study.md, written only with ``--report docs/study.md``; see ``orthros_train.study``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from orthros_train.eval.common import nonnegative_int, parse_lengths, positive_int
from orthros_train.logging_setup import configure_logging
from orthros_train.study.pipeline import ARCHS, StudyOptions, rerender_report, run_study


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orthros-study",
        description="Train recipes/study/{orthros,dense,sliding}.yaml (same shape, data and tokens): a learning-rate "
        "sweep per model, then several seeds at the kept rate; evaluate essay loss, loss by position, associative "
        "recall vs distance, a passkey probe and prefill time; write <out>/study.md (or --report).",
    )
    p.add_argument("--out", type=Path, default=Path("runs/study"), help="run directories and study.json")
    p.add_argument("--report", type=Path, default=None,
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
    p.add_argument("--archs", default=",".join(ARCHS), help=f"subset of {','.join(ARCHS)}")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every run (repeatable), e.g. trainer.micro_batch_size=4")
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
    p.add_argument("--notes", type=Path, default=None, help="hand-written analysis to include in the report")
    return p


def _numbers(text: str, kind: type, flag: str) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise SystemExit(f"orthros-study: {flag} takes comma-separated numbers, got {text!r}") from exc
    if not values:
        raise SystemExit(f"orthros-study: {flag} needs at least one value")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    archs = tuple(a for a in args.archs.split(",") if a)
    unknown = sorted((set(archs) | set((args.train_archs or "").split(",")) - {""}) - set(ARCHS))
    if unknown:
        raise SystemExit(f"orthros-study: unknown --archs {unknown}; choose from {', '.join(ARCHS)}")
    argv = sys.argv[1:] if argv is None else argv
    try:
        prefill_lengths = parse_lengths(args.prefill_lengths) if args.prefill_lengths else []
    except ValueError as exc:
        raise SystemExit(f"orthros-study: --prefill-lengths: {exc}") from exc
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
    )
    if args.notes is not None and not args.notes.is_file():
        raise SystemExit(f"orthros-study: --notes {args.notes}: no such file")
    configure_logging()  # the study's progress lines
    try:
        if args.report_only:
            rerender_report(opts)
        else:
            run_study(opts)
    except ValueError as exc:
        print(f"orthros-study: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
