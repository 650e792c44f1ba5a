"""Training-step time of Orthros vs the dense baselines of the same shape.

    python bench/train_step.py                 # table on the current device
    python bench/train_step.py --json          # the same as one JSON document
    python bench/train_step.py --lengths 1024 4096 --hidden 512 --layers 8

For each sequence length and layout (pretrain: an output token everywhere; sft: output tokens
on ``--answer-fraction`` of the positions, as one answer span at the end of each row) it times
forward + backward + AdamW step of an ``orthros`` model and of a ``dense`` model with identical
weights, and of the peer a user would pick: transformers' ``LlamaForCausalLM`` of the same shape
with ``attn_implementation="sdpa"`` (``--no-peer`` skips it), trained on the same tokens with
labels on the same targets. It reports the ratios and the model FLOPs each step does
(``layout_flops``); ``flop ratio`` is Orthros' FLOPs over the dense model's, the time ratio a
FLOP-bound step would show. An Orthros/peer time ratio below it is flagged ``weak baseline`` (the
peer runs its FLOPs slower than Orthros runs its own). The dense models have no output stream,
so for sft they still pay full causal attention over every token. On CPU the times are process
CPU time (``time.process_time``); on a GPU wall clock after a synchronize.
Targets (issue): pretrain <= 2.0x dense; sft with 10% answer tokens <= 1.15x dense; on a GPU
also MFU. ``--layouts pretrain sft rl`` adds rl rows (prompt + response rows, output tokens on
the response only, per-token advantages as weights).

``--sweep`` adds ``sweep`` rows for sft and rl that separate prompt length from answer tokens:
answer tokens fixed (``--sweep-answer``) while the prompt grows (``--lengths``), then the prompt
fixed (the longest length) while the answer grows (``--sweep-answers``). Each row counts the
attention (query, key) pairs per layer: the base stream's ``T*W`` (linear in the prompt), the
output stream's full attention (about ``answer x T``), and the dense baseline's ``T^2/2``.

    python bench/train_step.py --sweep --lengths 1024 4096 16384 --sweep-answer 128

``--fused`` adds ``fused`` rows: the Orthros model with ``parallel.compile``'s regional
``torch.compile`` (norms, RoPE, SwiGLU activation; ``orthros_train/parallel/compile.py``) against
the same model eager, on the same weights and tokens: the first step's losses (equal to 1e-5) and
the time ratio. Both do the same FLOPs, so a gain comes only from fewer passes over activations.

    python bench/train_step.py --fused --no-peer --lengths 1024 --threads 1

``--tokenwise`` adds ``tokenwise`` rows: ``model.fused_tokenwise=on`` (``model/fused.py``: one
``[x; y]`` buffer, add+RMSNorm, merged q/k/v and gate/up GEMMs, RoPE of q and k in one kernel,
SiLU-mul, the chunked LM head + cross entropy) against ``off`` on the same weights and tokens:
the first step's losses, the time ratio, and beside it the byte model (``tokenwise_bytes``) of
the token-wise passes per layer the fusion removes. Both do the same FLOPs. On a CPU without
``TRITON_INTERPRET`` the fused ops are their plain-torch references, so a CPU ratio measures the
merged GEMMs, the one buffer and the chunked head only; the kernels' gain is a GPU figure.

    python bench/train_step.py --tokenwise --no-peer --layouts pretrain --lengths 1024 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.ops.reference import UNBOUNDED, key_ranges
from orthros_train.parallel.compile import apply_regional_compile
from orthros_train.phase import pretrain_layout, rl_layout, sft_layout
from orthros_train.phase.layout import IGNORE_INDEX
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


def time_steps(model: torch.nn.Module, loss_fn, steps: int, warmup: int, cuda: bool) -> float:
    """Median seconds of forward + backward + AdamW step (process CPU time on CPU)."""
    clock = time.perf_counter if cuda else time.process_time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(clock() - start)
    return statistics.median(times)


def transformers_peer(cfg: OrthrosConfig):
    """transformers' Llama of ``cfg``'s shape with SDPA attention (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="sdpa",
    ))  # fmt: skip


def peer_batch(layout, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids and HF-style labels (``labels[t]`` = target of position ``t - 1``) with the
    layout's targets, so the peer learns exactly what the Orthros model does."""
    ids = layout.input_ids.view(batch, length)
    labels = torch.full((batch * length,), IGNORE_INDEX, dtype=torch.long, device=ids.device)
    target_pos = layout.output_index + 1
    ok = (target_pos % length != 0) & (layout.labels != IGNORE_INDEX)  # targets inside the row
    labels[target_pos[ok]] = layout.labels[ok]
    return ids, labels.view(batch, length)


def build_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """``(cfg, orthros, dense, peer)``: the Orthros model of the command line's shape, its dense twin
    with the same weights, and the transformers peer (None with ``--no-peer``)."""
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
    peer = None
    if not args.no_peer:
        peer = transformers_peer(cfg).to(device=device, dtype=dtype)
    return cfg, orthros, dense, peer


def sweep_rows(args: argparse.Namespace, cfg: OrthrosConfig, device: torch.device, measure) -> list[dict]:
    """The prompt/answer sweep of the SFT and RL layouts: the answer fixed while the prompt grows,
    then the prompt fixed at the longest length while the answer grows."""
    sweep: list[dict] = []
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
    return sweep


def fused_rows(args: argparse.Namespace, orthros: OrthrosForCausalLM, device: torch.device) -> list[dict]:
    """Regional compile vs eager on the pretraining layout of every length: loss of the first
    step on identical weights, and the step times (``time_steps``; compile time in the warm-up)."""
    cuda = device.type == "cuda"
    rows = []
    for length in args.lengths:
        eager, fused = copy.deepcopy(orthros), copy.deepcopy(orthros)
        apply_regional_compile(fused)
        layout = make_layout("pretrain", args.batch, length, args.vocab, args.answer_fraction).to(device)
        losses = [float(m.forward_layout(layout).loss.detach()) for m in (eager, fused)]
        row = {"layout": "fused", "seq_len": length, "eager_loss": losses[0], "fused_loss": losses[1],
               "loss_diff": abs(losses[1] - losses[0])}
        for name, model in (("eager", eager), ("fused", fused)):
            seconds = time_steps(model, lambda m=model, lay=layout: m.forward_layout(lay).loss, args.steps,
                                 max(args.warmup, 2), cuda)  # the compiles happen in the first steps
            row[f"{name}_ms"] = seconds * 1e3
        row["ratio"] = row["fused_ms"] / row["eager_ms"]
        rows.append(row)
    return rows


def _rms_bytes(rows: int, dim: int, b: int, fused: bool, add: bool) -> int:
    """Bytes one RMSNorm (after a residual add when ``add``) moves: eager casts to fp32, squares,
    averages, scales, casts back and multiplies by the weight, each a pass; fused reads the inputs
    and writes the outputs once."""
    if fused:
        return rows * dim * b * (4 if add else 2)
    return rows * dim * ((3 * b if add else 0) + 4 * b + 6 * 4)


def tokenwise_bytes(cfg: OrthrosConfig, n_base: int, n_out: int, b: int) -> dict[str, int]:
    """Forward bytes of the token-wise work of one middle layer, eager vs fused (the backward moves
    about twice as much the same way). GEMM FLOPs are equal; the merged GEMMs read their input once
    instead of three (q/k/v) or two (gate/up) times but copy their weights once per pass."""
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rows = n_base + n_out
    q_el, k_el = rows * h * hd, n_base * kv * hd
    eager = {
        "cat [x; y]": 2 * rows * d * b,
        "norms": _rms_bytes(rows, d, b, False, False) + _rms_bytes(rows, d, b, False, True),
        "projection inputs": (rows + 2 * n_base + 2 * rows) * d * b,
        "output affine": (4 * n_out * h * hd + 2 * q_el) * b,
        "rope q, k": 10 * (q_el + k_el) * b,
        "silu-mul": 5 * rows * i * b,
        "residual add": 3 * rows * d * b,
    }
    fused = {
        "cat [x; y]": 0,
        "norms": _rms_bytes(rows, d, b, True, False) + _rms_bytes(rows, d, b, True, True),
        "projection inputs": (n_base + n_out + rows) * d * b + 2 * ((h + 2 * kv) * hd + 2 * i) * d * b,
        "output affine": (2 * n_out * h * hd + 2 * q_el) * b,
        "rope q, k": 2 * (q_el + k_el) * b,
        "silu-mul": 3 * rows * i * b,
        "residual add": 3 * rows * d * b,
    }
    return {"eager": sum(eager.values()), "fused": sum(fused.values()),
            **{f"eager {k}": v for k, v in eager.items()}, **{f"fused {k}": v for k, v in fused.items()}}


def tokenwise_rows(args: argparse.Namespace, orthros: OrthrosForCausalLM, device: torch.device) -> list[dict]:
    """``model.fused_tokenwise`` on vs off on each main layout and length: the first step's losses
    on identical weights, the step times, and the byte model beside the ratio."""
    from orthros_train.options import FusedTokenwise

    cuda = device.type == "cuda"
    b = next(orthros.parameters()).element_size()
    rows = []
    for length in args.lengths:
        for kind in args.layouts:
            eager, fast = copy.deepcopy(orthros), copy.deepcopy(orthros)
            for model, mode in ((eager, FusedTokenwise.off), (fast, FusedTokenwise.on)):
                for module in model.modules():
                    if hasattr(module, "fusion"):
                        module.fusion = mode
            layout = make_layout(kind, args.batch, length, args.vocab, args.answer_fraction).to(device)
            losses = [float(m.forward_layout(layout, return_logits=False).loss.detach()) for m in (eager, fast)]
            model_bytes = tokenwise_bytes(orthros.config, layout.num_tokens, layout.num_outputs, b)
            row = {"layout": f"tokenwise {kind}", "seq_len": length, "outputs": layout.num_outputs,
                   "eager_loss": losses[0], "fused_loss": losses[1], "loss_diff": abs(losses[1] - losses[0]),
                   "flop_ratio": 1.0, "eager_layer_bytes": model_bytes["eager"],
                   "fused_layer_bytes": model_bytes["fused"],
                   "byte_ratio": model_bytes["fused"] / model_bytes["eager"]}
            for name, model in (("eager", eager), ("fused", fast)):
                seconds = time_steps(model, lambda m=model, lay=layout: m.forward_layout(lay, return_logits=False).loss,
                                     args.steps, args.warmup, cuda)
                row[f"{name}_ms"] = seconds * 1e3
            row["ratio"] = row["fused_ms"] / row["eager_ms"]
            rows.append(row)
    return rows


def machine() -> str:
    """The CPU model (or the platform when it is not readable)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg, orthros, dense, peer = build_models(args, device, dtype)
    peak = peak_tflops(device)
    cuda = device.type == "cuda"

    def measure(layout, row: dict) -> dict:
        for name, model in (("orthros", orthros), ("dense", dense)):
            seconds = time_steps(model, lambda m=model: m.forward_layout(layout).loss, args.steps, args.warmup, cuda)
            flops = layout_flops(model.config, layout)
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_tflops"] = flops / seconds / 1e12
            if peak:
                row[f"{name}_mfu"] = flops / seconds / 1e12 / peak
        row["ratio"] = row["orthros_ms"] / row["dense_ms"]
        row["flop_ratio"] = layout_flops(orthros.config, layout) / layout_flops(dense.config, layout)
        if peer is not None:
            ids, labels = peer_batch(layout, args.batch, row["seq_len"])
            seconds = time_steps(peer, lambda: peer(ids, labels=labels).loss, args.steps, args.warmup, cuda)
            row["peer_ms"] = seconds * 1e3
            row["peer_ratio"] = row["orthros_ms"] / row["peer_ms"]
            row["weak_baseline"] = row["peer_ratio"] < row["flop_ratio"]
        return row

    rows = []
    for length in args.lengths:
        for kind in args.layouts:
            layout = make_layout(kind, args.batch, length, args.vocab, args.answer_fraction).to(device)
            row = {"layout": kind, "seq_len": length, "tokens": layout.num_tokens, "outputs": layout.num_outputs}
            rows.append(measure(layout, row))
    sweep = sweep_rows(args, cfg, device, measure) if args.sweep else []
    fused = fused_rows(args, orthros, device) if args.fused else []
    tokenwise = tokenwise_rows(args, orthros, device) if args.tokenwise else []
    params = sum(p.numel() for p in orthros.parameters())
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "time_basis": "wall clock" if cuda else "process CPU time",
        "peer": None if peer is None else "transformers LlamaForCausalLM (sdpa)",
        "dtype": str(dtype),
        "parameters": params,
        "config": cfg.to_dict(),
        "batch": args.batch,
        "answer_fraction": args.answer_fraction,
        "rows": rows,
        "sweep": sweep,
        "fused": fused,
        "tokenwise": tokenwise,
    }


def table(result: dict) -> str:
    lines = [
        f"device {result['device']} ({result.get('machine', '?')}), {result['threads']} threads, "
        f"{result['date']}, {result['time_basis']}; "
        f"{result['parameters'] / 1e6:.1f}M parameters, batch {result['batch']}, "
        f"window {result['config']['sliding_window']}, sft answers {result['answer_fraction']:.0%}; "
        f"peer: {result['peer'] or 'not run'}",
        f"{'layout':<9}{'T':>7}{'outputs':>9}{'orthros ms':>12}{'dense ms':>10}{'peer ms':>10}{'ratio':>8}"
        f"{'/peer':>8}{'flop ratio':>12}{'orthros TF/s':>14}",
    ]

    def opt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in result["rows"]:
        lines.append(
            f"{r['layout']:<9}{r['seq_len']:>7}{r['outputs']:>9}{r['orthros_ms']:>12.1f}{r['dense_ms']:>10.1f}"
            f"{opt(r.get('peer_ms'), '10.1f')}{r['ratio']:>8.2f}{opt(r.get('peer_ratio'), '8.2f')}"
            f"{r['flop_ratio']:>12.2f}{r['orthros_tflops']:>14.4f}{'  weak baseline' if r.get('weak_baseline') else ''}"
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
    if result.get("fused"):
        lines += ["", "regional torch.compile (parallel.compile) vs eager, pretrain; flop ratio 1.00 (same work: "
                  "fusion saves passes over activations only)",
                  f"{'T':>7}{'eager ms':>10}{'fused ms':>10}{'ratio':>7}{'loss diff':>11}"]
        lines += [f"{r['seq_len']:>7}{r['eager_ms']:>10.1f}{r['fused_ms']:>10.1f}{r['ratio']:>7.2f}"
                  f"{r['loss_diff']:>11.1e}" for r in result["fused"]]
    if result.get("tokenwise"):
        lines += ["", "model.fused_tokenwise on vs off (same weights and tokens); flop ratio 1.00; bytes: the forward "
                  "token-wise bytes of one layer by the byte model (fused / eager)",
                  f"{'layout':<20}{'T':>7}{'eager ms':>10}{'fused ms':>10}{'ratio':>7}{'byte ratio':>12}"
                  f"{'eager MB':>10}{'fused MB':>10}{'loss diff':>11}"]
        lines += [f"{r['layout']:<20}{r['seq_len']:>7}{r['eager_ms']:>10.1f}{r['fused_ms']:>10.1f}{r['ratio']:>7.2f}"
                  f"{r['byte_ratio']:>12.2f}{r['eager_layer_bytes'] / 1e6:>10.2f}{r['fused_layer_bytes'] / 1e6:>10.2f}"
                  f"{r['loss_diff']:>11.1e}" for r in result["tokenwise"]]
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
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' Llama (SDPA)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--fused", action="store_true", help="add regional torch.compile vs eager rows (pretrain)")
    parser.add_argument("--tokenwise", action="store_true",
                        help="add model.fused_tokenwise on vs off rows (the main layouts) with the byte model")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
