"""The training loop: one trainer for every run, from the CPU demo to multi-node H100s.

Every run goes through the same path: megatron-core parallel state (TP/SP, a private
one-process group on a laptop), the tensor-parallel Orthros model, and a DeepSpeed engine for
data parallelism / ZeRO. The loop reads ``OrthrosLayout`` batches, so pretrain/sft/rl differ only
in the layouts the data produces.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from orthros_train.data import build_data
from orthros_train.model import OrthrosForCausalLM
from orthros_train.parallel.engine import build_engine
from orthros_train.parallel.model import ParallelOrthrosForCausalLM, megatron_config
from orthros_train.parallel.setup import DistributedEnv, check_parallel_layout, init_parallel
from orthros_train.parallel.state_dict import LazyCheckpoint, gather_full_state_dict, shard_state_dict
from orthros_train.train.config import RunConfig
from orthros_train.train.metrics import (
    PEAK_BF16_TFLOPS,
    MetricsLog,
    layout_flops,
    model_flops_per_token,
    peak_tflops,
)
from orthros_train.train.optim import lr_at


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def plan_summary(cfg: RunConfig) -> dict[str, Any]:
    """Figures a dry run prints: parameters, tokens per step, steps, FLOPs per token."""
    check_parallel_layout(cfg.parallel, cfg.model)
    with torch.device("meta"):
        model = OrthrosForCausalLM(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    t = cfg.trainer
    flops = model_flops_per_token(cfg.model, t.seq_len)
    return {
        "attention_type": cfg.model.attention_type,
        "parameters": params,
        "non_embedding_parameters": params - cfg.model.vocab_size * cfg.model.hidden_size,
        "parallel": {
            "tensor_parallel": cfg.parallel.tensor_parallel,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "data_parallel": cfg.parallel.data_parallel,
            "zero_stage": cfg.parallel.zero_stage,
            "world_size": cfg.parallel.world_size,
        },
        "global_batch_size": cfg.global_batch_size,
        "tokens_per_step": cfg.tokens_per_step,
        "total_steps": t.max_steps,
        "total_tokens": t.max_steps * cfg.tokens_per_step,
        "recipe_token_budget": t.total_tokens,
        "flops_per_token": flops,
        "total_flops": flops * t.max_steps * cfg.tokens_per_step,
        "seq_len": t.seq_len,
        "sliding_window": cfg.model.sliding_window,
        "init_from": cfg.init.init_from,
        # What a cluster would do: H100 bf16 peak (or trainer.peak_tflops) at a stated 40% MFU.
        "expected_at_40pct_mfu": _expected_throughput(cfg, flops, 0.40),
    }


def _expected_throughput(cfg: RunConfig, flops_per_token: float, mfu: float) -> dict[str, float]:
    peak = cfg.trainer.peak_tflops or PEAK_BF16_TFLOPS["H100"]
    tokens_per_s = mfu * peak * 1e12 * cfg.parallel.world_size / flops_per_token
    return {
        "peak_tflops_per_device": peak,
        "devices": cfg.parallel.world_size,
        "tokens_per_s": tokens_per_s,
        "step_time_s": cfg.tokens_per_step / tokens_per_s,
        "days_for_run": cfg.trainer.max_steps * cfg.tokens_per_step / tokens_per_s / 86400,
    }


def tensor_parallel_grad_norm(model: torch.nn.Module) -> float:
    """Global L2 norm of the gradients, counting TP-sharded tensors' shards and replicated
    tensors once (DeepSpeed reports it only when ZeRO is on)."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    return float((sharded + replicated).sqrt())


class Trainer:
    def __init__(
        self, cfg: RunConfig, resolved_recipe: dict[str, Any] | None = None, env: DistributedEnv | None = None
    ) -> None:
        self.cfg = cfg
        self.recipe = resolved_recipe or {}
        t, p = cfg.trainer, cfg.parallel
        if t.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
        if t.device == "cpu" and p.backend == "auto":
            p.backend = "gloo"
        self.device = init_parallel(p, cfg.model, env or DistributedEnv())
        if t.device == "cpu":
            self.device = torch.device("cpu")
        self.is_main = dist.get_rank() == 0
        self.run_dir = Path(t.run_dir)
        seed_everything(t.seed)
        self.data = build_data(
            cfg.data,
            t.seq_len,
            t.micro_batch_size,
            t.seed,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
        )
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.vocab_size} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; raise model.vocab_size"
            )
        self.model = self._build_model()
        self.engine = build_engine(self.model, p, t, cfg.optim)
        self.step = 0
        self._grad_norm = math.nan
        self.peak = peak_tflops(self.device, t.peak_tflops)

    def _build_model(self) -> ParallelOrthrosForCausalLM:
        """Weights come from the reference model (random init, identical for every TP size) or,
        with ``model.init_from``, from a checkpoint read tensor by tensor."""
        cfg, p = self.cfg, self.cfg.parallel
        tp, tp_rank = p.tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
        if cfg.init.init_from:
            full = LazyCheckpoint(cfg.init.init_from)
        else:
            full = OrthrosForCausalLM(cfg.model).state_dict()
        model = ParallelOrthrosForCausalLM(
            cfg.model, megatron_config(cfg.model, tp, p.sequence_parallel, torch.float32)
        )
        missing, unexpected = model.load_state_dict(shard_state_dict(full, cfg.model, tp, tp_rank), strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(self.device)

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        t, engine = self.cfg.trainer, self.engine
        engine.train()
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        total_loss, tokens, flops = 0.0, 0, 0.0
        for _ in range(t.grad_accum_steps):
            layout = self.data.next_batch().to(self.device)
            flops += layout_flops(self.cfg.model, layout)
            loss = engine(layout).loss
            engine.backward(loss)  # DeepSpeed scales by 1 / grad_accum_steps
            if engine.is_gradient_accumulation_boundary() and self.cfg.parallel.zero_stage == 0:
                self._grad_norm = tensor_parallel_grad_norm(engine.module)
            engine.step()  # steps the optimizer at the accumulation boundary only
            total_loss += float(loss.detach()) / t.grad_accum_steps
            tokens += layout.num_tokens
        grad_norm = engine.get_global_grad_norm()  # None without ZeRO: see _grad_norm
        if grad_norm is None:
            grad_norm = self._grad_norm
        self.step += 1
        # Report the data-parallel mean (every DP rank saw different samples).
        stats = torch.tensor([total_loss, float(tokens), flops], dtype=torch.float64)
        dp_group = parallel_state.get_data_parallel_group()
        dist.all_reduce(stats, group=dp_group)
        dp = parallel_state.get_data_parallel_world_size()
        return {
            "loss": float(stats[0]) / dp,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "tokens": int(stats[1]),
            # Every TP rank of a DP group computes the same layout: count each group once.
            "flops": float(stats[2]),
        }

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Token-weighted validation loss; None when the data has no validation split."""
        self.engine.eval()
        total, weight = 0.0, 0
        for layout in self.data.valid_batches(self.cfg.trainer.eval_batches):
            out = self.engine(layout.to(self.device))
            total += float(out.loss) * layout.num_loss_tokens
            weight += layout.num_loss_tokens
        return total / weight if weight else None

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        log = None
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.json").write_text(json.dumps(self.recipe, indent=2, default=str))
            log = MetricsLog(self.run_dir, self._wandb())
        progress = _progress(t.max_steps, enabled=t.progress and self.is_main)
        history: list[dict[str, Any]] = []
        eval_loss = None
        world = dist.get_world_size()
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
                    "tokens_per_s_per_device": stats["tokens"] / elapsed / world,
                    "model_tflops_per_s": stats["flops"] / elapsed / 1e12,
                    "consumed_samples": self.data.consumed_samples,
                }
                if self.peak is not None:
                    record["mfu"] = stats["flops"] / elapsed / 1e12 / (self.peak * world)
                if self.device.type == "cuda":
                    record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                if (t.eval_every > 0 and self.step % t.eval_every == 0) or self.step == t.max_steps:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        record["eval_loss"] = eval_loss
                history.append(record)
                if log is not None:
                    log.log(record)
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if self.is_main and t.log_every > 0 and (self.step % t.log_every == 0 or self.step == 1):
                    progress.write(
                        f"step {self.step:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                        f"grad {record['grad_norm']:.2f} | {record['tokens_per_s']:.0f} tok/s"
                        + (f" | eval {eval_loss:.4f}" if "eval_loss" in record else "")
                    )
        finally:
            progress.close()
            if log is not None:
                log.close()
        final_dir = self.save("final")
        return {"history": history, "eval_loss": eval_loss, "checkpoint": str(final_dir)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in reference layout, on every rank (ZeRO-3 shards gathered first)."""
        module = self.engine.module
        if self.cfg.parallel.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {k: v.clone() for k, v in gather_full_state_dict(module, self.cfg.model).items()}
        return gather_full_state_dict(module, self.cfg.model)

    def reference_model(self) -> OrthrosForCausalLM:
        """A single-device model with the trained weights (inference, export)."""
        model = OrthrosForCausalLM(self.cfg.model)
        model.load_state_dict({k: v.float().cpu() for k, v in self.full_state_dict().items()})
        return model

    def save(self, name: str) -> Path:
        """Model in reference layout (``OrthrosForCausalLM.from_pretrained`` loads it) + tokenizer."""
        target = self.run_dir / "checkpoints" / name
        model = self.reference_model()
        if self.is_main:
            model.save_pretrained(target)
            self.data.tokenizer.save_pretrained(target)
            (target / "trainer_state.json").write_text(
                json.dumps({"step": self.step, "data": self.data.state_dict()}, indent=2)
            )
        dist.barrier()
        return target

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt`` through prefill + decode (single-device model)."""
        model = self.reference_model().eval()
        ids = self.data.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = model.generate_greedy(ids, max_new_tokens, self.data.eod_token_id)
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
