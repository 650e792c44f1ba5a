"""What a step leaves behind: its record in ``metrics.jsonl`` (and wandb), the progress bar, and a
console line every ``log_every`` steps. Only rank 0 writes; every rank builds the record."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.options import WandbMode
from orthros_train.train.config import TrainerConfig, WandbConfig
from orthros_train.train.metrics import TERA, MetricsLog
from orthros_train.train.step import StepStats

log = logging.getLogger(__name__)


class StepLog:
    def __init__(
        self,
        run_dir: Path,
        cfg: TrainerConfig,
        is_main: bool,
        world_size: int,
        peak_tflops: float | None,
        device: torch.device,
        initial_step: int,
        wandb_run: Any | None = None,
    ) -> None:
        from tqdm.auto import tqdm

        self.cfg = cfg
        self.is_main = is_main
        self.world = world_size
        self.peak = peak_tflops
        self.device = device
        self.metrics = MetricsLog(run_dir, wandb_run, initial_step) if is_main else None
        self.progress = tqdm(total=cfg.max_steps, initial=initial_step, disable=not (cfg.progress and is_main),
                             dynamic_ncols=True, desc="train")

    def record(self, step: int, stats: StepStats, elapsed: float, consumed_samples: int, skipped_steps: int) -> dict:
        """The step's metrics record (``metrics.jsonl``'s keys)."""
        record: dict[str, Any] = {
            "step": step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": stats.tokens / elapsed,
            "tokens_per_s_per_device": stats.tokens / elapsed / self.world,
            "model_tflops_per_s": stats.flops / elapsed / TERA,
            "consumed_samples": consumed_samples,
            "skipped_steps": skipped_steps,
            **stats.objective,
        }
        if stats.router_loss is not None:
            record["router_loss"] = stats.router_loss  # included in loss
        if self.peak is not None:
            record["mfu"] = stats.flops / elapsed / TERA / (self.peak * self.world)
        if self.device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return record

    def write(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(record)
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        step, every = record["step"], self.cfg.log_every
        if every > 0 and (step % every == 0 or step == 1):
            log.info(
                "step %6d | loss %.4f | lr %.2e | grad %.2f | %.0f tok/s%s%s", step, record["loss"], record["lr"],
                record["grad_norm"], record["tokens_per_s"],
                f" | eval {record['eval_loss']:.4f}" if "eval_loss" in record else "",
                f" | reward {record['reward_mean']:.3f}" if "reward_mean" in record else "",
            )

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()


def start_wandb(cfg: WandbConfig, run_dir: Path, recipe: dict, run_id: str | None) -> Any | None:
    """The run's wandb run (``run_id``: the one a resumed run continues); None when disabled."""
    if not cfg.enabled or cfg.mode == WandbMode.disabled:
        return None
    try:  # optional: a machine without wandb (the GPU image) trains with trainer.wandb.enabled=false
        import wandb
    except ImportError as err:
        raise UserError(
            f"trainer.wandb.enabled=true but wandb cannot be imported ({err}): install it "
            "(pip install 'orthros-train[wandb]') or pass trainer.wandb.enabled=false"
        ) from None
    return wandb.init(
        project=cfg.project, name=cfg.name, group=cfg.group, mode=str(cfg.mode), dir=str(run_dir), config=recipe,
        id=run_id, resume="allow" if run_id else None,
        reinit="finish_previous", settings=wandb.Settings(quiet=True),  # no banner or end-of-run summary
    )  # fmt: skip


__all__ = ["StepLog", "start_wandb"]
