"""The training loop: one trainer for every run, from the CPU demo up.

The loop reads ``OrthrosLayout`` batches from the data object, so pretrain/sft/rl differ only in
the layouts the data produces. Distributed engines, resume and fault handling plug in around
``train_step`` and ``save`` (later issues) without a second loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orthros_train.data import build_data
from orthros_train.model import OrthrosForCausalLM
from orthros_train.train.config import RunConfig
from orthros_train.train.metrics import MetricsLog, model_flops_per_token
from orthros_train.train.optim import build_optimizer, lr_at, set_lr


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def plan_summary(cfg: RunConfig) -> dict[str, Any]:
    """Figures a dry run prints: parameters, tokens per step, steps, FLOPs per token."""
    with torch.device("meta"):
        model = OrthrosForCausalLM(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    t = cfg.trainer
    total_steps = t.max_steps
    flops = model_flops_per_token(cfg.model, t.seq_len)
    return {
        "attention_type": cfg.model.attention_type,
        "parameters": params,
        "non_embedding_parameters": params - cfg.model.vocab_size * cfg.model.hidden_size,
        "tokens_per_step": t.tokens_per_step,
        "total_steps": total_steps,
        "total_tokens": total_steps * t.tokens_per_step,
        "recipe_token_budget": t.total_tokens,
        "flops_per_token": flops,
        "total_flops": flops * total_steps * t.tokens_per_step,
        "seq_len": t.seq_len,
        "sliding_window": cfg.model.sliding_window,
        "init_from": cfg.init.init_from,
    }


class Trainer:
    def __init__(self, cfg: RunConfig, resolved_recipe: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.recipe = resolved_recipe or {}
        t = cfg.trainer
        self.run_dir = Path(t.run_dir)
        self.device = resolve_device(t.device)
        seed_everything(t.seed)
        self.data = build_data(cfg.data, t.seq_len, t.micro_batch_size, t.seed)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.vocab_size} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; raise model.vocab_size"
            )
        self.model = OrthrosForCausalLM(cfg.model)
        if cfg.init.init_from:
            self.model.load_pretrained_weights(cfg.init.init_from)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.step = 0
        self.flops_per_token = model_flops_per_token(cfg.model, t.seq_len)

    # -- one optimizer step -------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.trainer.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> dict[str, float]:
        t, model = self.cfg.trainer, self.model
        model.train()
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        set_lr(self.optimizer, lr)
        total_loss, tokens = 0.0, 0
        for _ in range(t.grad_accum_steps):
            layout = self.data.next_batch().to(self.device)
            with self._autocast():
                loss = model.forward_layout(layout).loss
            (loss / t.grad_accum_steps).backward()
            total_loss += float(loss.detach()) / t.grad_accum_steps
            tokens += layout.num_tokens
        clip = self.cfg.optim.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": total_loss, "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses, weights = [], []
        for layout in self.data.valid_batches(self.cfg.trainer.eval_batches):
            layout = layout.to(self.device)
            with self._autocast():
                out = self.model.forward_layout(layout)
            losses.append(float(out.loss) * layout.num_loss_tokens)
            weights.append(layout.num_loss_tokens)
        return sum(losses) / max(sum(weights), 1)

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.json").write_text(json.dumps(self.recipe, indent=2, default=str))
        log = MetricsLog(self.run_dir, self._wandb())
        progress = _progress(t.max_steps, enabled=t.progress)
        history: list[dict[str, Any]] = []
        eval_loss = None
        try:
            while self.step < t.max_steps:
                start = time.perf_counter()
                stats = self.train_step()
                elapsed = time.perf_counter() - start
                record = {
                    "step": self.step,
                    "loss": stats["loss"],
                    "lr": stats["lr"],
                    "grad_norm": stats["grad_norm"],
                    "tokens_per_s": stats["tokens"] / elapsed,
                    "model_tflops_per_s": self.flops_per_token * stats["tokens"] / elapsed / 1e12,
                    "consumed_samples": self.data.consumed_samples,
                }
                if (t.eval_every > 0 and self.step % t.eval_every == 0) or self.step == t.max_steps:
                    eval_loss = self.evaluate()
                    record["eval_loss"] = eval_loss
                log.log(record)
                history.append(record)
                progress.update(1)
                progress.set_postfix(
                    loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{record['lr']:.2e}"
                )
                if t.log_every > 0 and (self.step % t.log_every == 0 or self.step == 1):
                    progress.write(
                        f"step {self.step:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                        f"grad {record['grad_norm']:.2f} | {record['tokens_per_s']:.0f} tok/s"
                        + (f" | eval {eval_loss:.4f}" if "eval_loss" in record else "")
                    )
        finally:
            progress.close()
            log.close()
        final_dir = self.save("final")
        return {"history": history, "eval_loss": eval_loss, "checkpoint": str(final_dir)}

    def save(self, name: str) -> Path:
        """Model + tokenizer (loadable with ``OrthrosForCausalLM.from_pretrained``) + optimizer."""
        target = self.run_dir / "checkpoints" / name
        self.model.save_pretrained(target)
        self.data.tokenizer.save_pretrained(target)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "step": self.step, "data": self.data.state_dict()},
            target / "trainer_state.pt",
        )
        return target

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt`` through prefill + decode."""
        self.model.eval()
        ids = self.data.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = self.model.generate_greedy(ids.to(self.device), max_new_tokens, self.data.eod_token_id)
        return self.data.tokenizer.decode(new[0].tolist())

    def _wandb(self) -> Any | None:
        w = self.cfg.trainer.wandb
        if not w.enabled or w.mode == "disabled":
            return None
        import wandb

        return wandb.init(
            project=w.project,
            name=w.name,
            group=w.group,
            mode=w.mode,
            dir=str(self.run_dir),
            config=self.recipe,
            reinit="finish_previous",
        )


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, dynamic_ncols=True, desc="train")
