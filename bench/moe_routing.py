"""Mixture-of-experts Orthros: what each routing policy costs (experts read per step) and what it
does to quality and load balance.

    python bench/moe_routing.py reads --json reads.json          # a converted Qwen3-MoE-style model
    python bench/moe_routing.py study --out runs/moe_study       # train + evaluate every policy (~1 h)
    python bench/moe_routing.py study --out DIR --quick          # the reduced pipeline (minutes)

``reads``: a random Qwen3-MoE-style model (fine-grained experts: 64, top-8) built by transformers,
converted with ``orthros-convert``'s code (gamma = 1, beta = 0) and generated from prompts longer
than the window, once per policy (the same weights). Per sparse layer and step it counts the
distinct experts a decode step touches in the whole batch (the expert weights the step reads from
memory: the cost a decode step is bound by on a GPU) and per request (its base + output pair),
and, for the prompt, the distinct experts of its last position's pair (the prompt's one output
token and its base token).

``study``: the replication study's data and training (``orthros_train.study.pipeline``: the blend
of essays and synthetic key-value recall, the same tokens for every run) on an MoE variant of its
shape, once per policy and seed, plus the dense-MLP Orthros model with as many active MLP weights;
every run is evaluated as the study evaluates (held-out essay loss overall and beyond W, recall
within and beyond W, passkey), and each MoE run also for load balance (tokens per expert on the
held-out essays) and expert reads while generating. Prints markdown tables; ``--json`` writes all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.model.moe import Routing, SparseMoE
from orthros_train.options import MoERouting

POLICIES = tuple(p.value for p in MoERouting)


# -- what a step reads --------------------------------------------------------------------------


def _attach_logs(model: OrthrosForCausalLM) -> dict[int, list[Routing]]:
    logs: dict[int, list[Routing]] = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.routing_log = logs[i] = []
    return logs


def _detach_logs(model: OrthrosForCausalLM) -> None:
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.routing_log = None


def _per_request(routing: Routing, batch: int) -> list[int]:
    """Distinct experts of each request's tokens in one decode call (rows: base tokens, then outputs)."""
    experts, n_base = routing.experts, routing.pairs.num_base
    rows = []
    for r in range(batch):
        mine = [experts[r]] if n_base else []
        if routing.pairs.num_out:
            mine.append(experts[n_base + r] if n_base else experts[r])
        rows.append(int(torch.cat(mine).unique().numel()))
    return rows


def generation_reads(model: OrthrosForCausalLM, prompts: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Experts touched while ``generate_greedy`` reads ``prompts`` [B, T] and writes ``new_tokens``."""
    logs = _attach_logs(model)
    try:
        with torch.no_grad():
            model.generate_greedy(prompts, max_new_tokens=new_tokens)
    finally:
        _detach_logs(model)
    b, k, cfg = prompts.shape[0], model.config.num_experts_per_tok, model.config
    step_distinct, pair_distinct, prefill_pairs = [], [], []
    for calls in logs.values():
        prefill, decode = calls[0], calls[1:]
        n_base = prefill.pairs.num_base
        for r in range(b):  # the pair at each prompt's last position: its output token and base token
            mine = [prefill.experts[n_base + r]]
            if n_base:
                mine.append(prefill.experts[int(prefill.pairs.out_base_row[r])])
            prefill_pairs.append(int(torch.cat(mine).unique().numel()))
        for routing in decode:
            step_distinct.append(int(routing.experts.unique().numel()))
            pair_distinct.extend(_per_request(routing, b))
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # bf16 gate, up, down
    mean_step = statistics.fmean(step_distinct)
    return {
        "batch": b,
        "prompt_tokens": prompts.shape[1],
        "new_tokens": new_tokens,
        "top_k": k,
        "experts_per_request_pair": statistics.fmean(pair_distinct),
        "max_experts_per_request_pair": max(pair_distinct),
        "experts_per_decode_step": mean_step,  # per sparse layer, whole batch
        "expert_mib_per_decode_step": mean_step * len(logs) * expert_bytes / 2**20,
        "experts_per_prefill_last_pair": statistics.fmean(prefill_pairs),
    }


def converted_model(workdir: Path, window: int = 16, experts: int = 64, top_k: int = 8) -> Path:
    """A random fine-grained Qwen3-MoE (transformers) converted to Orthros in ``workdir``."""
    import transformers

    from orthros_train.convert.from_hf import convert_from_hf

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=32, norm_topk_prob=True, initializer_range=0.1,
    )
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    hf.save_pretrained(workdir / "hf")
    # no global tail: with it a decode step's base query sees the output query's keys, and at the
    # conversion's gamma = 1, beta = 0 the two tokens of a pair are the same computation, so every
    # policy would route them alike (the table compares the policies on the paper's layer)
    convert_from_hf(workdir / "hf", workdir / "orthros", sliding_window=window, global_tail=0)
    return workdir / "orthros"


def reads_table(ckpt: Path, prompt_len: int, new_tokens: int, batches: list[int], seed: int = 0) -> list[dict]:
    rows = []
    for policy in POLICIES:
        model = OrthrosForCausalLM.from_pretrained(ckpt, moe_routing=policy).eval()
        for b in batches:
            gen = torch.Generator().manual_seed(seed)
            prompts = torch.randint(0, model.config.vocab_size, (b, prompt_len), generator=gen)
            rows.append({"policy": policy, **generation_reads(model, prompts, new_tokens)})
    return rows


def print_reads(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print("| policy | batch | experts per request pair (max) | experts per decode step | MiB of experts per "
          "step (bf16) | experts of the prompt's last pair |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['policy']} | {r['batch']} | {r['experts_per_request_pair']:.2f} "
              f"({r['max_experts_per_request_pair']}) | {r['experts_per_decode_step']:.1f} | "
              f"{r['expert_mib_per_decode_step']:.2f} | {r['experts_per_prefill_last_pair']:.2f} |")


# -- load balance -------------------------------------------------------------------------------


def load_balance(model: OrthrosForCausalLM, documents: list[list[int]], seq_len: int) -> dict[str, Any]:
    """Tokens per expert over ``documents`` in the pretraining layout (both streams), per stream:
    max / mean over experts and the coefficient of variation, averaged over the sparse layers."""
    cfg = model.config
    counts = {"base": torch.zeros(cfg.num_hidden_layers, cfg.num_experts),
              "output": torch.zeros(cfg.num_hidden_layers, cfg.num_experts)}
    flat = [t for doc in documents for t in doc]
    logs = _attach_logs(model)
    try:
        with torch.no_grad():
            for start in range(0, len(flat) - seq_len + 1, seq_len):
                model(torch.tensor(flat[start : start + seq_len])[None])
                for layer, calls in logs.items():
                    for routing in calls:
                        n_base = routing.pairs.num_base
                        for stream, rows in (("base", routing.experts[:n_base]), ("output", routing.experts[n_base:])):
                            counts[stream][layer] += torch.bincount(rows.flatten(), minlength=cfg.num_experts).float()
                    calls.clear()
    finally:
        _detach_logs(model)
    out = {}
    for stream, c in counts.items():
        used = c[c.sum(1) > 0]
        if not used.numel():
            continue
        mean = used.mean(1, keepdim=True)
        out[stream] = {"max_over_mean": float((used.max(1).values / mean[:, 0]).mean()),
                       "cv": float((used.std(1) / mean[:, 0]).mean()), "layers": int(used.shape[0])}
    return out


# -- the small-scale study --------------------------------------------------------------------------

# An MoE variant of the study's shape (recipes/study/common.yaml: hidden 128, W 16, 128-token
# sequences): 3 layers so that two of them route a pair (the last layer's base stream runs no MLP),
# 8 experts of width 64, top-2 (128 active MLP features per token, against the dense model's 128).
# (``+``: the study's model group does not list the MoE keys; Hydra adds them.)
MOE_OVERRIDES = [
    "model.num_hidden_layers=3",
    "+model.num_experts=8",
    "+model.num_experts_per_tok=2",
    "+model.moe_intermediate_size=64",
    "+model.norm_topk_prob=true",
    "+model.router_aux_loss_coef=0.01",
]
DENSE_OVERRIDES = ["model.num_hidden_layers=3", "model.intermediate_size=128"]
QUICK = ["trainer.max_steps=30", "data.recall_mix.documents=200"]


def study(out: Path, seeds: list[int], lr: float, steps: int | None, quick: bool, recall_docs: int,
          passkey_docs: int, log, overwrite: bool = False) -> dict[str, Any]:
    from orthros_train.infer.loading import load_model
    from orthros_train.study.pipeline import (
        StudyOptions,
        aggregate,
        evaluate_run,
        held_out_essays,
        load_average,
        run_name,
        run_overrides,
        train_run,
    )

    extra = (QUICK if quick else []) + ([f"trainer.max_steps={steps}"] if steps else [])
    arms = {**{p: MOE_OVERRIDES + [f"+model.moe_routing={p}"] for p in POLICIES}, "dense_mlp": DENSE_OVERRIDES}
    opts = StudyOptions(out=out, recall_documents=recall_docs, passkey_documents=passkey_docs,
                        seeds=tuple(seeds), lrs=(lr,))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seeds": seeds,
                               "lr": lr, "overrides": {k: v + extra for k, v in arms.items()},
                               "load_average_start": load_average(), "arms": {}}
    threads = torch.get_num_threads()
    for arm, overrides in arms.items():
        runs = []
        for seed in seeds:
            run_dir = out / arm / run_name(lr, seed)
            # A finished run of the same command is reused, a partial one resumed (study/runs.py).
            train_run("orthros", run_dir, overrides + extra + run_overrides(lr, seed), log, overwrite=overwrite)
            torch.set_num_threads(1)
            try:
                result = evaluate_run(run_dir, opts, log)
                if arm != "dense_mlp":
                    recipe = json.loads((run_dir / "recipe.json").read_text())
                    model = load_model(run_dir / "checkpoints" / "final", device="cpu").eval()
                    essays = held_out_essays(recipe["data"])
                    result["load_balance"] = load_balance(model, essays, recipe["trainer"]["seq_len"])
                    prompt = torch.tensor([t for d in essays for t in d][: 4 * 96]).view(4, 96)
                    result["reads"] = generation_reads(model, prompt, 16)
            finally:
                torch.set_num_threads(threads)
            runs.append(result)
        summary = aggregate(runs)
        if arm != "dense_mlp":
            for key in ("max_over_mean", "cv"):
                for stream in ("base", "output"):
                    values = [r["load_balance"][stream][key] for r in runs if stream in r["load_balance"]]
                    summary.setdefault("load_balance", {}).setdefault(stream, {})[key] = statistics.fmean(values)
            summary["reads"] = {k: statistics.fmean(r["reads"][k] for r in runs)
                                for k in ("experts_per_request_pair", "experts_per_decode_step")}
        results["arms"][arm] = {"summary": summary, "runs": runs}
    results["load_average_end"] = load_average()
    return results


def _pm(s: dict[str, Any], scale: float = 1.0, fmt: str = ".3f") -> str:
    if s.get("mean") is None:
        return "n/a"
    return f"{s['mean'] * scale:{fmt}} ± {s['std'] * scale:{fmt}}"


def print_study(results: dict[str, Any]) -> None:
    print(f"\nSmall-scale study, {len(results['seeds'])} seeds, lr {results['lr']:g} ({results['date']})\n")
    print("| arm | essay loss | essay loss beyond W | recall within W | recall beyond W | passkey 4-8x W "
          "(pairs) | experts per pair | max/mean tokens per expert (base, output) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for arm, entry in results["arms"].items():
        s = entry["summary"]
        passkey = s["passkey"].get("pairs", {}).get("4-8x_window", {})
        reads = s.get("reads", {}).get("experts_per_request_pair")
        lb = s.get("load_balance", {})
        balance = (f"{lb['base']['max_over_mean']:.2f}, {lb['output']['max_over_mean']:.2f}"
                   if "base" in lb and "output" in lb else "-")
        print(f"| {arm} | {_pm(s['essay_loss'])} | {_pm(s['essay_loss_beyond_window'])} | "
              f"{_pm(s['recall_within_window'], 100, '.1f')}% | {_pm(s['recall_beyond_window'], 100, '.1f')}% | "
              f"{_pm(passkey, 100, '.1f')}% | {'-' if reads is None else f'{reads:.2f}'} | {balance} |")


def _positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (a bad one is refused before anything runs)."""
    from orthros_train.eval.common import positive_int

    values = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one positive integer")
    return values


def _seeds(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integer seeds") from None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one seed, each once")
    return values


def build_parser() -> argparse.ArgumentParser:
    from orthros_train.eval.common import positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reads", help="experts read per step, per policy, on a converted model")
    r.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens (window 16)")
    r.add_argument("--new-tokens", type=positive_int, default=16)
    r.add_argument("--batches", type=_positive_ints, default=[1, 8], help="batch sizes (comma-separated)")
    r.add_argument("--json", type=Path, default=None)
    s = sub.add_parser("study", help="train and evaluate every policy on the study's data")
    s.add_argument("--out", type=Path, default=Path("runs/moe_study"))
    s.add_argument("--seeds", type=_seeds, default=[1234, 1235, 1236])
    s.add_argument("--lr", type=positive_float, default=3e-3)
    s.add_argument("--steps", type=positive_int, default=None)
    s.add_argument("--quick", action="store_true")
    s.add_argument("--recall-documents", type=positive_int, default=32)
    s.add_argument("--passkey-documents", type=positive_int, default=32)
    s.add_argument("--json", type=Path, default=None)
    s.add_argument("--overwrite", action="store_true",
                   help="delete the runs in --out and train them again (default: reuse finished runs, resume "
                   "partial ones, refuse a run of another configuration)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    print(f"machine: {sys.platform}, torch threads 1, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.command == "reads":
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = converted_model(Path(tmp))
            cfg = OrthrosConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
            rows = reads_table(ckpt, args.prompt, args.new_tokens, args.batches)
        print_reads(rows, f"Converted Qwen3-MoE-style model: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, "
                          f"{len(cfg.sparse_layers)} sparse layers, W={cfg.sliding_window}, prompt {args.prompt} "
                          f"tokens, {args.new_tokens} decode steps (gamma = 1, beta = 0, random weights)")
        result: Any = {"model": cfg.to_dict(), "rows": rows}
    else:
        from orthros_train.study.cli import run_owned

        found: dict[str, Any] = {}

        def work() -> None:
            found["result"] = study(args.out, args.seeds, args.lr, args.steps, args.quick, args.recall_documents,
                                    args.passkey_documents, lambda msg: print(msg, flush=True), args.overwrite)

        code = run_owned("moe_routing study", args.out, "MoE routing study", work)
        if code:
            return code
        result = found["result"]
        print_study(result)
        print_reads([{"policy": arm, **run["reads"]} for arm, e in result["arms"].items() if arm != "dense_mlp"
                     for run in e["runs"][:1]], "Trained models (first seed), held-out essay prompts")
    if args.json is not None:
        from orthros_train.common.files import write_atomic

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(result, indent=1, default=str) + "\n", durable=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
