"""``orthros-eval``: check the Orthros claims on a checkpoint, one command each.

    orthros-eval niah CKPT --lengths 1k,4k,16k --depths 0..100:11       needle in a haystack (JSON + heatmap)
    orthros-eval recall CKPT --length 4k --num-pairs 32                MQAR accuracy vs distance
    orthros-eval ppl CKPT DATA... --seq-len 4k                         perplexity, per position bucket
    orthros-eval lm-eval CKPT --tasks pg_lambada,hellaswag             any lm-eval task (offline: local YAML)
    orthros-eval bench-prefill CKPT|CONFIG|PRESET --lengths 1k..64k    TTFT + decode tok/s vs SDPA peers

Every command writes JSON under ``--output-dir`` (default ``eval_results/``) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from orthros_train.common.blank import text_arg
from orthros_train.errors import UserError, first_line, report_bug
from orthros_train.eval.common import (
    nonnegative_int,
    nonnegative_size,
    parse_depths,
    parse_lengths,
    parse_overrides,
    positive_float,
    positive_int,
    positive_size,
    write_json,
)


def _common(p: argparse.ArgumentParser, output: bool = True) -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: as stored)")
    p.add_argument(
        "--attention-backend", default=None, help="reference | triton | auto (default: the checkpoint's setting)"
    )
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config field to change at load time, e.g. sliding_window=256 (repeatable)")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (CPU)")
    if output:
        p.add_argument("--output-dir", type=text_arg, default="eval_results",
                       help="where JSON/PNG go (default: eval_results)")


def build_parser() -> argparse.ArgumentParser:
    parts = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        prog="orthros-eval",
        description=parts[0].replace("``", ""),
        epilog="examples:\n" + parts[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # One function per subcommand, in the order --help lists them.
    _add_niah(sub)
    _add_recall(sub)
    _add_ppl(sub)
    _add_lm_eval(sub)
    _add_bench_prefill(sub)
    return parser


def _add_niah(sub) -> None:
    """The needle in a haystack subcommand."""
    p = sub.add_parser("niah", help="needle in a haystack on the Paul Graham essays")
    p.add_argument("checkpoint", type=text_arg)  # '' would be the current directory
    p.add_argument("--lengths", default="1k,2k,4k", help="prompt lengths in tokens: 1k,4k,16k or 1k..128k")
    p.add_argument("--depths", default="0..100:11", help="needle depths in percent: 0,50,100 or 0..100:11")
    p.add_argument("--needle", default=None, help="the needle sentence (default: the San Francisco sandwich)")
    p.add_argument("--question", default=None)
    p.add_argument("--answer", default=None, help="expected answer (exact match after normalisation)")
    p.add_argument("--answer-prefix", default=None, help="text the model continues after 'Answer:'")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--max-new-tokens", type=positive_int, default=None)
    p.add_argument("--prefill-chunk-size", type=nonnegative_size, default=None)
    p.add_argument("--no-snap", action="store_true", help="insert at the exact token depth, not at a sentence end")
    p.add_argument("--no-plot", action="store_true")
    _common(p)


def _add_recall(sub) -> None:
    """The associative recall subcommand."""
    p = sub.add_parser("recall", help="multi-query associative recall (MQAR) vs distance")
    p.add_argument("checkpoint", type=text_arg)  # '' would be the current directory
    p.add_argument("--length", type=positive_size, default=2048)
    p.add_argument("--num-pairs", type=positive_int, default=16)
    p.add_argument("--num-samples", type=positive_int, default=8)
    p.add_argument("--format", choices=["auto", "text", "tokens"], default="auto")
    p.add_argument("--min-distance", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    _common(p)


def _add_ppl(sub) -> None:
    """The perplexity subcommand."""
    p = sub.add_parser("ppl", help="perplexity on text files or an indexed dataset, per position bucket")
    p.add_argument("checkpoint", type=text_arg)  # '' would be the current directory
    p.add_argument("data", nargs="+", type=text_arg,
                   help="text files/dirs, embedded:paul_graham, or an indexed dataset prefix")
    p.add_argument("--seq-len", type=positive_size, default=2048)
    p.add_argument("--batch-tokens", type=positive_size, default=8192)
    p.add_argument("--max-tokens", type=positive_size, default=None)
    p.add_argument("--bucket-window", type=positive_int, default=None,
                   help="bucket width (default: the sliding window)")
    _common(p)


def _add_lm_eval(sub) -> None:
    """The lm-evaluation-harness subcommand."""
    p = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks through the Orthros adapter")
    p.add_argument("checkpoint", type=text_arg)  # '' would be the current directory
    p.add_argument("--tasks", required=True, help="comma-separated task names (pg_lambada, pg_passkey, ...)")
    p.add_argument("--limit", type=positive_float, default=None,
                   help="examples per task (>= 1), or a fraction of each task (< 1)")
    p.add_argument("--num-fewshot", type=nonnegative_int, default=None)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-length", type=positive_size, default=None)
    p.add_argument("--include-path", action="append", type=text_arg, default=[], help="folder of your own task YAMLs")
    p.add_argument("--tasks-dir", type=text_arg, default=None,
                   help="where the example tasks are written (default: ~/.cache)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=("orthros", "vllm"), default="orthros",
                   help="orthros: the project's model in this process (CKPT: an Orthros checkpoint); vllm: lm-eval's "
                   "vllm model serving CKPT, an export of `orthros-convert to-hf` (needs vLLM: make serve-env)")
    _common(p)


def _add_bench_prefill(sub) -> None:
    """The prefill benchmark subcommand."""
    p = sub.add_parser(
        "bench-prefill",
        help="TTFT and decode tokens/s: Orthros vs transformers' SDPA Llama and the dense baseline of the same shape",
    )
    p.add_argument("model", type=text_arg, help="checkpoint dir, config JSON/YAML, or a preset (tiny, 3m, 20m, 1p3b)")
    p.add_argument("--lengths", default="1k..16k", help="1k..64k (powers of two) or 1k,4k,32k")
    p.add_argument("--decode-tokens", type=nonnegative_int, default=32, help="decode steps per round and model")
    p.add_argument("--decode-rounds", type=positive_int, default=3, help="rounds the two models take turns (median)")
    p.add_argument("--repeats", type=positive_int, default=1, help="prefill timings per length (best of)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--prefill-chunk-size", type=nonnegative_size, default=None,
                   help="prompt tokens per prefill forward (default: each model's own, 0: one forward)")
    p.add_argument("--baseline", choices=["dense", "sliding"], default="dense")
    p.add_argument("--max-baseline-length", type=positive_size, default=None, help="skip the baselines above this")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer (Llama/Qwen3, SDPA)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="Orthros and the dense baseline decode through the static step, captured in a CUDA graph "
                        "on a GPU (generate's cuda_graph); the peer decodes eagerly")  # fmt: skip
    p.add_argument("--global-tails", default="",
                   help="also time the prefill with each global tail R (comma-separated, e.g. 10,32,128): its ratio "
                   "to Orthros without it beside the FLOP ratio (docs/convert.md, 'The global tail')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the machine-readable result here")
    p.add_argument("--no-plot", action="store_true")
    _common(p)


def check_device(name: str | None) -> None:
    """``--device cuda`` on a machine torch sees no GPU on: say so before anything loads."""
    import torch

    if name and name != "auto":
        try:
            torch.device(name)
        except RuntimeError:
            raise UserError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if name and name.startswith("cuda") and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise UserError(
            f"--device {name}: no CUDA device is visible ({build}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu, or run where a GPU is visible"
        )


BACKENDS = ("auto", "reference", "sdpa", "triton")


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--override`` and ``--attention-backend`` as config fields, checked before anything loads."""
    overrides = parse_overrides(args.override)
    if args.attention_backend:
        overrides["attention_backend"] = args.attention_backend
    backend = overrides.get("attention_backend")
    if backend is not None and backend not in BACKENDS:
        raise UserError(f"--attention-backend {backend}: choose one of {', '.join(BACKENDS)}")
    if backend == "triton" and _runs_on_cpu(args.device) and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            "--attention-backend triton needs a CUDA device, and this run is on the CPU; use "
            "--attention-backend reference (or auto), or run with --device cuda where a GPU is visible"
        )
    return overrides


def _runs_on_cpu(device: str | None) -> bool:
    import torch

    if device in (None, "auto"):
        return not torch.cuda.is_available()
    return not str(device).startswith("cuda")


def _load(args: argparse.Namespace, tokenizer_required: bool = True):
    from orthros_train.common.safetensors_io import check_safetensors_files
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.infer.loading import is_checkpoint, load_model, not_a_checkpoint_hint

    if not is_checkpoint(args.checkpoint):
        raise UserError(not_a_checkpoint_hint(args.checkpoint))
    overrides = model_overrides(args)
    check_safetensors_files(args.checkpoint)
    model = load_model(args.checkpoint, device=args.device, dtype=args.dtype, **overrides)
    tokenizer = load_tokenizer(args.checkpoint, required=tokenizer_required, pad_with_eos=True)
    return model, tokenizer


def cmd_niah(args: argparse.Namespace) -> dict[str, Any]:
    from orthros_train.eval.niah import Needle, run_niah, save_niah

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)  # before the model loads
    model, tokenizer = _load(args)
    warn_beyond_positions(model, "--lengths", lengths)
    needle = Needle()
    for field in ("needle", "question", "answer", "answer_prefix"):
        if getattr(args, field) is not None:
            setattr(needle, field, getattr(args, field))
    result = run_niah(
        model, tokenizer, lengths, depths, needle,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        prefill_chunk_size=args.prefill_chunk_size, snap_to_sentence=not args.no_snap,
    )  # fmt: skip
    result["checkpoint"] = str(args.checkpoint)
    paths = save_niah(result, args.output_dir, plot=not args.no_plot)
    print(f"niah: mean exact match {result['mean_exact_match']:.3f} over {len(result['results'])} cells -> {paths}")
    return paths


def warn_beyond_positions(model: Any, flag: str, lengths: list[int]) -> None:
    """Lengths past the checkpoint's max_position_embeddings run (RoPE extrapolates; measuring that
    may be the point), but the result is not what the model was made for: say so, naming both."""
    limit = getattr(model.config, "max_position_embeddings", None)
    beyond = [n for n in lengths if limit and n > limit]
    if beyond:
        print(
            f"orthros-eval: warning: {flag} {','.join(map(str, beyond))} exceed(s) the checkpoint's "
            f"max_position_embeddings={limit}: those positions were never trained (results measure extrapolation); "
            f"use lengths <= {limit}, or --override max_position_embeddings=N if the model supports more",
            file=sys.stderr,
            flush=True,
        )


def cmd_recall(args: argparse.Namespace) -> dict[str, Any]:
    from orthros_train.eval.recall import run_recall, save_recall

    model, tokenizer = _load(args, tokenizer_required=args.format == "text")
    warn_beyond_positions(model, "--length", [args.length])
    result = run_recall(
        model, tokenizer, length=args.length, num_pairs=args.num_pairs, num_samples=args.num_samples,
        fmt=args.format, min_distance=args.min_distance, seed=args.seed,
    )  # fmt: skip
    result["checkpoint"] = str(args.checkpoint)
    paths = save_recall(result, args.output_dir, plot=not args.no_plot)
    print(f"recall ({result['format']}): accuracy {result['accuracy']:.3f}, beyond the window {result['window']}: "
          f"{_f(result['accuracy_beyond_window'])}, within: {_f(result['accuracy_within_window'])}")  # fmt: skip
    for b in result["buckets"]:
        print(f"  distance {b['label']:>16}: {_f(b['accuracy'])} ({b['queries']} queries)")
    print(f"-> {paths}")
    return paths


def cmd_ppl(args: argparse.Namespace) -> dict[str, Any]:
    from orthros_train.eval.ppl import run_ppl, save_ppl, token_documents

    needs_tok = any(not _looks_indexed(d) for d in args.data)
    model, tokenizer = _load(args, tokenizer_required=needs_tok)
    warn_beyond_positions(model, "--seq-len", [args.seq_len])
    result = run_ppl(
        model, token_documents(args.data, tokenizer), seq_len=args.seq_len, batch_tokens=args.batch_tokens,
        max_tokens=args.max_tokens, bucket_window=args.bucket_window,
    )  # fmt: skip
    result["checkpoint"], result["data"] = str(args.checkpoint), list(args.data)
    paths = save_ppl(result, args.output_dir)
    print(f"ppl: {result['perplexity']:.3f} (loss {result['loss']:.4f}) over {result['tokens']} tokens")
    for b in result["buckets"]:
        if b["tokens"]:
            print(
                f"  positions {b['label']:>16}: loss {b['loss']:.4f}, ppl {b['perplexity']:.3f} ({b['tokens']} tokens)"
            )
    print(f"-> {paths}")
    return paths


def _looks_indexed(spec: str) -> bool:
    from orthros_train.eval.ppl import _is_indexed

    return not spec.startswith("embedded:") and _is_indexed(spec)


def cmd_lm_eval(args: argparse.Namespace) -> dict[str, Any]:
    from orthros_train.eval.harness import run_lm_eval

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError(f"--tasks {args.tasks!r} names no task; e.g. --tasks pg_lambada,pg_passkey")
    common = dict(limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                  max_length=args.max_length, include_paths=args.include_path, tasks_dir=args.tasks_dir,
                  seed=args.seed)  # fmt: skip
    try:
        if args.backend == "vllm":
            result = _lm_eval_vllm(args, tasks, common)
        else:
            model, tokenizer = _load(args)
            result = run_lm_eval(model, tokenizer, tasks, **common)
    except ConnectionError as exc:  # datasets: "Couldn't reach 'X' on the Hub (OfflineModeIsEnabled)"
        raise UserError(
            f"task(s) {', '.join(tasks)}: {exc}. The task reads its dataset from the Hugging Face Hub, which is "
            "unreachable or switched off (offline mode: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE). Run it once with "
            "network access (the dataset is cached afterwards), or use a task whose YAML reads local files "
            "(dataset_path: json with dataset_kwargs.data_files, as the example tasks do; docs/eval.md)"
        ) from exc
    result["checkpoint"] = str(args.checkpoint)
    path = write_json(result, Path(args.output_dir) / "lm_eval.json")
    for task, metrics in result["results"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, (int, float)))
        print(f"lm-eval {task}: {shown}")
    print(f"-> {path}")
    return {"json": str(path)}


def _lm_eval_vllm(args: argparse.Namespace, tasks: list[str], common: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``vllm`` model on an exported checkpoint (``lm_eval_cli.run_vllm_lm_eval``)."""
    import importlib.util

    export = Path(args.checkpoint)
    config = export / "config.json"
    if not config.is_file() or "auto_map" not in json.loads(config.read_text()):
        raise UserError(
            f"--backend vllm serves an exported checkpoint (a folder whose config.json has auto_map), and "
            f"{export} is not one: export it with `orthros-convert to-hf {export} EXPORT_DIR` and pass EXPORT_DIR"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UserError("--backend vllm needs vLLM in this environment: run it from .venv-serve (make serve-env), "
                         "or use the in-process route (--backend orthros, the default)")
    from orthros_train.eval.lm_eval_cli import run_vllm_lm_eval

    dtype = args.dtype or "auto"
    return run_vllm_lm_eval(str(export), tasks, dtype=dtype, **common)


def _tails(text: str) -> list[int]:
    """``--global-tails 10,32,128``: integers >= 1 (R = 0 is the Orthros column itself)."""
    try:
        tails = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--global-tails {text!r}: give integers >= 1, comma-separated (e.g. 10,32,128)") from None
    if any(t < 1 for t in tails):
        raise UserError(f"--global-tails {text!r}: every R must be >= 1 (R = 0 is the Orthros column itself)")
    return tails


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    from orthros_train.eval.bench import TABLE_HEADER, bench_prefill, format_table

    overrides = model_overrides(args)
    lengths = parse_lengths(args.lengths)
    print(TABLE_HEADER.splitlines()[0])
    result = bench_prefill(
        args.model, lengths, device=args.device, dtype=args.dtype, baseline=args.baseline,
        decode_tokens=args.decode_tokens, repeats=args.repeats,
        chunk_size="auto" if args.prefill_chunk_size is None else (args.prefill_chunk_size or None),
        batch_size=args.batch_size, max_baseline_length=args.max_baseline_length, seed=args.seed,
        decode_rounds=args.decode_rounds, peer=not args.no_peer, cuda_graph=args.cuda_graph,
        overrides=overrides, global_tails=_tails(args.global_tails),
    )  # fmt: skip
    out = Path(args.output_dir)
    paths = {"json": str(write_json(result, out / "bench_prefill.json"))}
    if args.json:
        paths["json_copy"] = str(write_json(result, args.json))
    table = format_table(result)
    (out / "bench_prefill.md").write_text(table + "\n")
    paths["table"] = str(out / "bench_prefill.md")
    if not args.no_plot:
        from orthros_train.eval.plots import bench_plot

        env = result["environment"]
        title = (f"{args.model}: Orthros vs {result['peer']} and the {args.baseline} baseline "
                 f"({env['device']}, {env['torch_threads']} threads, {result['time_basis']})")
        paths["png"] = str(bench_plot(result["rows"], out / "bench_prefill.png", title))
    print(table)
    print(f"-> {paths}")
    return paths


def _check_writable(flag: str, folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = err.strerror or err
        raise UserError(f"{flag} {folder}: cannot create it ({why}); choose a writable folder") from err
    if not os.access(folder, os.W_OK):
        raise UserError(f"{flag} {folder}: not writable; choose a writable folder")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


COMMANDS = {"niah": cmd_niah, "recall": cmd_recall, "ppl": cmd_ppl, "lm-eval": cmd_lm_eval, "bench-prefill": cmd_bench}


def attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--lengths -1k`` -> ``--lengths=-1k``: argparse takes a value starting with '-' for an
    option (and answers "expected one argument"); attached, the value reaches the flag's own check,
    which names the problem (lengths must be >= 1)."""
    takes_value: set[str] = set()
    for action in parser._actions:  # the subcommands' flags too
        for sub in getattr(action, "choices", None) or {}:
            sub_parser = action.choices[sub]
            if isinstance(sub_parser, argparse.ArgumentParser):
                takes_value |= {o for a in sub_parser._actions if a.nargs is None and a.option_strings
                                and not isinstance(a, argparse._StoreConstAction) for o in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        negative = nxt is not None and len(nxt) > 1 and nxt[0] == "-" and (nxt[1].isdigit() or nxt[1] == ".")
        if arg in takes_value and negative:
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_dash_values(parser, sys.argv[1:] if argv is None else list(argv)))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        check_device(args.device)
        for flag, folder in (("--output-dir", getattr(args, "output_dir", None)),
                             ("--json", Path(args.json).parent if getattr(args, "json", None) else None)):
            if folder is not None:
                _check_writable(flag, Path(folder))  # before a long run, not when its results are written
        COMMANDS[args.command](args)
    except (UserError, OSError, ImportError) as exc:  # OSError: a missing input, an unwritable --output-dir
        print(f"orthros-eval {args.command}: {first_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"orthros-eval {args.command}: interrupted (Ctrl-C); nothing was written", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug (a ValueError from inside torch included): its traceback, and where to report
        report_bug(f"orthros-eval {args.command}", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
