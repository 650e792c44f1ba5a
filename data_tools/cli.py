"""``orthros-data``: tokenize corpora, build SFT/RL sets, inspect indexed datasets.

    orthros-data tokenize INPUT... --tokenizer PATH --output PREFIX [--workers N]
    orthros-data sft INPUT... --tokenizer PATH --output PREFIX [--train-turns all|last]
    orthros-data rl INPUT... --tokenizer PATH --output PREFIX [--reference-field answer]
    orthros-data inspect PATH [--tokenizer PATH] [--json]

Exit status 2 for bad input (the message names the file and, where there is one, the line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from orthros_train.common.blank import text_arg
from orthros_train.data.indexed import DataError
from orthros_train.errors import UserError, first_line, report_bug


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 workers, shards of 0 records or batches of 0 records
    cannot make progress; argparse turns the ValueError into a usage error naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", type=text_arg,
                   help="json/jsonl(.gz)/txt/parquet/csv/arrow files, directories, globs, or a hub dataset name")
    p.add_argument("--tokenizer", required=True, type=text_arg, help="local HF tokenizer directory or tokenizer.json")
    p.add_argument("--output", required=True, metavar="PREFIX", type=text_arg,
                   help="output prefix: shards PREFIX_00000.bin/.idx, ..., summary PREFIX.json")
    p.add_argument("--workers", type=_positive_int, default=1, help="tokenizer worker processes (default 1)")
    p.add_argument("--docs-per-shard", type=_positive_int, default=100_000,
                   help="raw records per shard (default 100000)")
    p.add_argument("--batch-size", type=_positive_int, default=256, help="records per tokenizer call (default 256)")
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="bad records (malformed JSON, missing fields, empty, non-UTF-8): stop with an error "
                        "(default) or skip and count them in the summary")
    p.add_argument("--hub-split", default="train", help="split of a hub dataset input")
    p.add_argument("--hub-config", default=None, help="config name of a hub dataset input")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="rebuild even if PREFIX.json exists for other settings")


def _chat(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages-field", default="messages", help="list of {role, content} (default messages)")
    p.add_argument("--prompt-field", default="prompt", help="prompt text when there is no messages field")
    p.add_argument("--system-field", default=None, help="optional system prompt field (with --prompt-field)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (overrides, or stands in for, the tokenizer's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthros-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    tok = sub.add_parser("tokenize", help="corpus -> indexed dataset shards (.bin/.idx), EOD after each document")
    _common(tok)
    tok.add_argument("--text-field", default="text", help="document text field of json/parquet/csv records")
    tok.add_argument("--txt-sample-by", choices=("document", "line", "paragraph"), default="document",
                     help="what one document of a .txt file is (default: the whole file)")
    tok.add_argument("--no-eod", action="store_true", help="do not append the EOD token to each document")
    tok.add_argument("--eod-token", default=None, help="EOD token (default: the tokenizer's EOS)")
    tok.add_argument("--add-special-tokens", action="store_true", help="let the tokenizer add BOS etc. per document")

    sft = sub.add_parser("sft", help="chat JSONL -> conversations with the assistant spans recorded")
    _common(sft)
    _chat(sft)
    sft.add_argument("--response-field", default="response", help="response text with --prompt-field")
    sft.add_argument("--train-turns", choices=("all", "last"), default="all",
                     help="which assistant turns get loss (default all)")

    rl = sub.add_parser("rl", help="prompt sets -> rendered prompts (+ optional reference answers)")
    _common(rl)
    _chat(rl)
    rl.add_argument("--reference-field", default=None, help="reference answer field kept beside each prompt")

    ins = sub.add_parser("inspect", help="counts, length histogram, a decoded sample, answer-span coverage")
    ins.add_argument("path", help="output prefix / summary JSON / directory / .bin or .idx prefix")
    ins.add_argument("--tokenizer", default=None, help="tokenizer to decode the sample (default: from the summary)")
    ins.add_argument("--sample", type=_nonnegative_int, default=0, help="which document to decode (default 0)")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _options(args: argparse.Namespace):
    from data_tools.pretokenize import TokenizeOptions
    from orthros_train.data.chat import ChatFields

    kwargs = dict(
        inputs=args.inputs, tokenizer=args.tokenizer, output=args.output, kind="pretrain",
        workers=args.workers, docs_per_shard=args.docs_per_shard, batch_size=args.batch_size,
        on_error=args.on_error, hub_split=args.hub_split, hub_config=args.hub_config,
        progress=not args.no_progress, overwrite=args.overwrite,
    )
    if args.command == "tokenize":
        kwargs.update(text_field=args.text_field, txt_sample_by=args.txt_sample_by, append_eod=not args.no_eod,
                      eod_token=args.eod_token, add_special_tokens=args.add_special_tokens)
    else:
        fields = ChatFields(messages=args.messages_field, prompt=args.prompt_field,
                            response=getattr(args, "response_field", "response"), system=args.system_field,
                            reference=getattr(args, "reference_field", None))
        kwargs.update(kind=args.command, fields=fields, chat_template=args.chat_template,
                      train_turns=getattr(args, "train_turns", "all"))
    return TokenizeOptions(**kwargs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("orthros_data").setLevel(logging.INFO)
    logging.getLogger("orthros_train.data.cache").setLevel(logging.INFO)  # "waiting for OUTPUT.lock, held by ..."
    try:
        if args.command == "inspect":
            from data_tools.inspect_data import format_report, inspect_dataset
            from orthros_train.common.tokenizer import load_tokenizer
            from orthros_train.data.indexed import load_summary

            # an explicit --tokenizer must load; the one the summary records may since have moved
            tok_path = args.tokenizer or (load_summary(args.path) or {}).get("tokenizer", {}).get("path")
            explicit = args.tokenizer is not None
            tokenizer = load_tokenizer(tok_path) if tok_path and (explicit or os.path.exists(tok_path)) else None
            report = inspect_dataset(args.path, tokenizer, sample=args.sample)
            print(json.dumps(report, indent=2) if args.json else format_report(report))
            return 0
        from data_tools.pretokenize import run

        summary = run(_options(args))
        skipped = summary.get("skipped") or {}
        print(
            f"{args.output}.json: {summary['documents']:,} documents, {summary['tokens']:,} tokens in "
            f"{len([s for s in summary['shards'] if s['prefix']])} shard(s)"
            + (f"; skipped {skipped}" if skipped else "")
        )
        return 0
    except (DataError, UserError) as e:
        print(f"orthros-data: error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("orthros-data: interrupted; finished shards are kept, run the same command again to resume",
              file=sys.stderr)
        return 130
    except OSError as e:  # disk full, a file system gone read-only mid-run: the file, not a traceback
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"orthros-data: error: {e.strerror or e}{where}; finished shards are kept, fix it and run the "
              "same command again to resume", file=sys.stderr)
        return 1
    except Exception as e:  # a bug (a ValueError from inside a library included): its traceback, where to report
        report_bug(f"orthros-data {args.command}", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
