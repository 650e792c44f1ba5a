"""Training-step time of Orthros vs the dense baseline of the same shape.

    python bench/train_step.py                 # table on the current device
    python bench/train_step.py --json          # the same as one JSON document
    python bench/train_step.py --lengths 1024 4096 --hidden 512 --layers 8

For each sequence length and layout (pretrain: an output token everywhere; sft: output tokens
on ``--answer-fraction`` of the positions, as one answer span at the end of each row) it times
forward + backward + AdamW step of an ``orthros`` model and of a ``dense`` model with identical
weights, and reports the ratio and the model FLOPs each step does (``layout_flops``). The dense
model has no output stream, so for sft it still pays full causal attention over every token.
Targets (issue): pretrain <= 2.0x dense; sft with 10% answer tokens <= 1.15x dense; on a GPU
also MFU. ``--layouts pretrain sft rl`` adds rl rows (prompt + response rows, output tokens on
the response only, per-token advantages as weights).

``--sweep`` adds ``sweep`` rows for sft and rl that separate prompt length from answer tokens:
answer tokens fixed (``--sweep-answer``) while the prompt grows (``--lengths``), then the prompt
fixed (the longest length) while the answer grows (``--sweep-answers``). Each row counts the
attention (query, key) pairs per layer: the base stream's ``T*W`` (linear in the prompt), the
output stream's full attention (about ``answer x T``), and the dense baseline's ``T^2/2``.

    python bench/train_step.py --sweep --lengths 1024 4096 16384 --sweep-answer 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.ops.reference import UNBOUNDED, key_ranges
from orthros_train.phase import pretrain_layout, rl_layout, sft_layout
from orthros_train.train.metrics import layout_flops, peak_tflops

LAYOUTS = ("pretrain", "sft", "rl")


def make_layout(kind: str, batch: int, length: int, vocab: int, answer_fraction: float, n_answer: int | None = None):
    """``batch`` rows of ``length`` tokens; sft/rl: the last ``n_answer`` tokens of each row are the
    answer/response (default ``answer_fraction`` of the row)."""
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    if kind == "pretrain":
        return pretrain_layout(ids)
    if n_answer is None:
        n_answer = max(1, int(length * answer_fraction))
    spans = [[(length - n_answer, length)]] * batch
    if kind == "sft":
        return sft_layout(ids, spans)
    if kind == "rl":  # advantages in [-1, 1] as per-token weights
        weights = torch.rand((batch, length), generator=torch.Generator().manual_seed(1)) * 2 - 1
        return rl_layout(ids, spans, weights)
    raise ValueError(f"unknown layout {kind!r}; choose from {LAYOUTS}")


def attention_pairs(layout, window: int) -> dict[str, int]:
    """(query, key) pairs per layer: base stream (window W), output stream (full), dense baseline."""
    cu = layout.cu_seqlens.cpu()
    base = torch.arange(layout.num_tokens)
    start, end = key_ranges(base, torch.full_like(base, window), cu)
    d_start, d_end = key_ranges(base, torch.full_like(base, UNBOUNDED), cu)
    out = layout.output_index.cpu()
    o_start, o_end = key_ranges(out, torch.full_like(out, UNBOUNDED), cu)
    return {
        "base_pairs": int((end - start + 1).sum()),
        "output_pairs": int((o_end - o_start + 1).sum()),
        "dense_pairs": int((d_end - d_start + 1).sum()),
    }


def time_steps(model: OrthrosForCausalLM, layout, steps: int, warmup: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        if layout.input_ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.forward_layout(layout).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if layout.input_ids.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = OrthrosConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        sliding_window=args.window,
    )
    torch.manual_seed(0)
    orthros = OrthrosForCausalLM(cfg).to(device=device, dtype=dtype)
    dense = OrthrosForCausalLM(OrthrosConfig(**{**cfg.to_dict(), "attention_type": "dense"})).to(device, dtype)
    dense.load_state_dict(orthros.state_dict())
    peak = peak_tflops(device)
    def measure(layout, row: dict) -> dict:
        for name, model in (("orthros", orthros), ("dense", dense)):
            seconds = time_steps(model, layout, args.steps, args.warmup)
            flops = layout_flops(model.config, layout)
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_tflops"] = flops / seconds / 1e12
            if peak:
                row[f"{name}_mfu"] = flops / seconds / 1e12 / peak
        row["ratio"] = row["orthros_ms"] / row["dense_ms"]
        return row

    rows = []
    for length in args.lengths:
        for kind in args.layouts:
            layout = make_layout(kind, args.batch, length, args.vocab, args.answer_fraction).to(device)
            row = {"layout": kind, "seq_len": length, "tokens": layout.num_tokens, "outputs": layout.num_outputs}
            rows.append(measure(layout, row))
    sweep = []
    if args.sweep:
        longest = max(args.lengths)
        points = [(length, args.sweep_answer) for length in sorted(args.lengths)]  # answer fixed, prompt grows
        points += [(longest, a) for a in sorted(args.sweep_answers) if a != args.sweep_answer]  # prompt fixed
        for kind in ("sft", "rl"):
            for length, answer in points:
                if answer >= length:
                    continue
                layout = make_layout(kind, args.batch, length, args.vocab, 0.0, n_answer=answer).to(device)
                row = {"layout": kind, "seq_len": length, "prompt_tokens": length - answer, "answer_tokens": answer,
                       "outputs": layout.num_outputs, **attention_pairs(layout, cfg.sliding_window)}
                row["orthros_pairs"] = row["base_pairs"] + row["output_pairs"]
                sweep.append(measure(layout, row))
    params = sum(p.numel() for p in orthros.parameters())
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "parameters": params,
        "config": cfg.to_dict(),
        "batch": args.batch,
        "answer_fraction": args.answer_fraction,
        "rows": rows,
        "sweep": sweep,
    }


def table(result: dict) -> str:
    lines = [
        f"device {result['device']}, {result['parameters'] / 1e6:.1f}M parameters, batch {result['batch']}, "
        f"window {result['config']['sliding_window']}, sft answers {result['answer_fraction']:.0%}",
        f"{'layout':<9}{'T':>7}{'outputs':>9}{'orthros ms':>12}{'dense ms':>10}{'ratio':>8}{'orthros TF/s':>14}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['layout']:<9}{r['seq_len']:>7}{r['outputs']:>9}{r['orthros_ms']:>12.1f}{r['dense_ms']:>10.1f}"
            f"{r['ratio']:>8.2f}{r['orthros_tflops']:>14.4f}"
        )
    if result.get("sweep"):
        lines += [
            "",
            "attention pairs per layer (batch total): prompt vs answer tokens",
            f"{'layout':<7}{'prompt':>8}{'answer':>8}{'base T*W':>12}{'output ~N*T':>13}{'dense T^2/2':>13}"
            f"{'orthros ms':>12}{'dense ms':>10}{'ratio':>7}",
        ]
        for r in result["sweep"]:
            lines.append(
                f"{r['layout']:<7}{r['prompt_tokens']:>8}{r['answer_tokens']:>8}{r['base_pairs']:>12}"
                f"{r['output_pairs']:>13}{r['dense_pairs']:>13}{r['orthros_ms']:>12.1f}{r['dense_ms']:>10.1f}"
                f"{r['ratio']:>7.2f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--answer-fraction", type=float, default=0.10)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["pretrain", "sft"],
                        help="layouts of the main rows (default: pretrain sft)")
    parser.add_argument("--sweep", action="store_true", help="add sft/rl rows: prompt length vs answer tokens")
    parser.add_argument("--sweep-answer", type=int, default=64, help="answer tokens while the prompt grows")
    parser.add_argument("--sweep-answers", type=int, nargs="+", default=[16, 64, 256],
                        help="answer tokens at the longest length")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
