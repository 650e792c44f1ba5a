"""Checkpoint size and save cost on the tiny recipe, one process.

    python bench/checkpoint.py                                  # h256 x 4 and h512 x 8 layers
    python bench/checkpoint.py --models 512x8 --zero 1 --precision bf16

For each model it trains one step, then saves three times synchronously and three times
asynchronously (best of 3) and prints the bytes per parameter on disk (``model/``, ``optimizer/``,
the rest) and what a save costs: process CPU seconds of the whole save (``time.process_time``,
every thread), CPU seconds of the training thread (``time.thread_time``: what an async save keeps
on the step), and the wall time until ``save_checkpoint`` returns and until the checkpoint is
published. torch runs with one thread. The figures in docs/checkpoints.md come from this script.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from orthros_train.parallel.setup import destroy_parallel
from orthros_train.train.config import run_config_from_dict
from orthros_train.train.trainer import Trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def make_trainer(run_dir: Path, hidden: int, layers: int, zero: int, precision: str, asynchronous: bool) -> Trainer:
    overrides = [
        f"model.hidden_size={hidden}", f"model.num_hidden_layers={layers}", f"parallel.zero_stage={zero}",
        f"trainer.precision={precision}", f"trainer.async_save={asynchronous}", f"trainer.run_dir={run_dir}",
        "trainer.micro_batch_size=2", "trainer.seq_len=64", "trainer.keep_last_k=1", "trainer.progress=false",
        "trainer.wandb.enabled=false", "trainer.wandb.name=bench", "trainer.resume=none",
    ]  # fmt: skip
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        cfg = compose("tiny_cpu", overrides=overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    return Trainer(run_config_from_dict(resolved), resolved)


def measure(trainer: Trainer, repeats: int) -> dict[str, float]:
    rows = []
    for _ in range(repeats):
        trainer.train_step()
        cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
        path = trainer.save_checkpoint()
        returned = time.perf_counter() - wall
        on_step = time.thread_time() - thread
        trainer.checkpoints.wait()
        rows.append((time.process_time() - cpu, on_step, returned, time.perf_counter() - wall))
    best = [min(r[i] for r in rows) for i in range(4)]
    parts = {"model": 0, "optimizer": 0, "other": 0}
    for f in path.rglob("*"):
        if f.is_file():
            top = f.relative_to(path).parts[0]
            parts[top if top in parts else "other"] += f.stat().st_size
    return {
        "save_cpu": best[0],
        "thread_cpu": best[1],
        "returned": best[2],
        "published": best[3],
        "peak_host": trainer.checkpoints.last_budget.peak,
        **parts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["256x4", "512x8"], help="HIDDENxLAYERS")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread, "
        f"{datetime.date.today()}, ZeRO-{args.zero} {args.precision}, one process, best of {args.repeats}"
    )
    print(
        "| model | params | bytes/param: model/ + optimizer/ + rest | mode | save CPU (all threads) "
        "| training-thread CPU | returned after (wall) | published after (wall) | peak host |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    first = True
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            hidden, layers = (int(x) for x in model.split("x"))
            for asynchronous in (False, True):
                if not first:
                    destroy_parallel()
                first = False
                run = Path(tmp) / f"{model}-{asynchronous}"
                trainer = make_trainer(run, hidden, layers, args.zero, args.precision, asynchronous)
                n = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.engine.module.parameters())
                r = measure(trainer, args.repeats)
                print(
                    f"| h{hidden} x {layers} | {n / 1e6:.1f}M | {r['model'] / n:.2f} + {r['optimizer'] / n:.2f} + "
                    f"{r['other'] / n:.2f} | {'async' if asynchronous else 'sync'} | {r['save_cpu']:.2f} s | "
                    f"{r['thread_cpu']:.2f} s | {r['returned']:.2f} s | {r['published']:.2f} s | "
                    f"{r['peak_host'] / 1e6:.0f} MB |",
                    flush=True,
                )
    destroy_parallel()


if __name__ == "__main__":
    main()
