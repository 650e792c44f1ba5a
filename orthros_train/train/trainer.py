"""The training loop: one trainer for every run, from the CPU demo to multi-node H100s.

Every run goes through the same path: megatron-core parallel state (TP/SP, a private
one-process group on a laptop), the tensor-parallel Orthros model, and a DeepSpeed engine for
data parallelism / ZeRO. The loop reads ``OrthrosLayout`` batches, so pretrain/sft/rl differ only
in the layouts the data produces.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from orthros_train.data.schedule import build_scheduled_data
from orthros_train.model import OrthrosForCausalLM
from orthros_train.parallel import collectives
from orthros_train.parallel.engine import build_engine
from orthros_train.parallel.model import build_parallel_model
from orthros_train.parallel.setup import DistributedEnv, check_parallel_layout, init_parallel
from orthros_train.parallel.state_dict import (
    LazyCheckpoint,
    gather_full_state_dict,
    load_reference_shards,
)
from orthros_train.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointState,
    TrainingCounters,
    layout_signature,
    verify_checkpoint,
)
from orthros_train.train.config import RunConfig
from orthros_train.train.global_loss import global_loss_units, micro_batch_normalizer
from orthros_train.train.memory import GIB, memory_fit_problem, memory_summary
from orthros_train.train.metrics import (
    PEAK_BF16_TFLOPS,
    MetricsLog,
    layout_flops,
    model_flops_per_token,
    peak_tflops,
)
from orthros_train.train.optim import build_optimizer, lr_at
from orthros_train.train.rl import GRPOObjective, response_logprobs
from orthros_train.train.run_dir import check_fresh_start, check_resume
from orthros_train.train.run_lock import RunLock

# Signals that stop a run after the current step with a checkpoint: SIGTERM/SIGUSR1 (schedulers,
# preemption; exit 0 so the job can be requeued) and SIGINT (Ctrl-C; the CLI exits 130 after the save).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
            "context_parallel": cfg.parallel.context_parallel,
            "data_parallel": cfg.parallel.data_parallel,
            "zero_stage": cfg.parallel.zero_stage,
            "recompute": cfg.parallel.recompute,
            "world_size": cfg.parallel.world_size,
        },
        # derived from the world size (orthros_train/train/config.py resolve_batch_geometry)
        "global_batch_size": cfg.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": t.grad_accum_steps,
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
        "memory_per_gpu": memory_summary(cfg),  # analytic model, per sequence-length stage
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
    # Summed where the gradients are (no host copy per parameter); the TP sum of the sharded
    # part is reduced on the device the TP group's backend needs (CUDA under NCCL).
    group = parallel_state.get_tensor_model_parallel_group()
    sums = {True: [], False: []}
    for p in model.parameters():
        if p.grad is not None:
            sums[bool(getattr(p, "tensor_model_parallel", False))].append(p.grad.detach().double().pow(2).sum())
    device = collectives.comm_device(group)

    def total(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).sum().to(device) if parts else torch.zeros((), dtype=torch.float64, device=device)

    sharded, replicated = total(sums[True]), total(sums[False])
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        collectives.all_reduce(sharded, group=group)
    return float((sharded + replicated).sqrt())


def _data_vocab_key(cfg: RunConfig) -> str:
    """The recipe key that fixed the data's vocabulary, for the mismatch message."""
    if cfg.rl is not None:
        return "model.init_from / data.tokenizer"
    if cfg.data.source == "embedded":
        return f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size}"
    named = f", data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer else ""
    return f"the tokenizer recorded with data.paths{named}"


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        resolved_recipe: dict[str, Any] | None = None,
        env: DistributedEnv | None = None,
        job_id: str | None = None,
    ) -> None:
        """``job_id``: the scheduler's job id (``SLURM_JOB_ID``, read by the entry point): a
        requeued job takes its own run-directory lock over."""
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
        self._check_memory_fit()
        self.run_dir = Path(t.run_dir)
        self.run_lock = self._lock_run_dir(job_id)  # before anything reads or writes the directory
        seed_everything(t.seed)
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        if cfg.rl is not None:  # RL: rollouts sampled with the current weights, or read from a file
            from orthros_train.train.rollouts import build_rollout_data

            self.data = build_rollout_data(cfg, self._sampling_policy, dp_rank, dp_size, self._policy_logprobs)
        else:
            self.data = build_scheduled_data(  # build_data itself unless trainer.seq_len_schedule is set
                cfg.data,
                t.seq_len,
                t.micro_batch_size,
                t.seq_len_schedule,
                t.grad_accum_steps,
                t.seed,
                dp_rank=dp_rank,
                dp_size=dp_size,
            )
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {self.data.vocab_size} tokens ({_data_vocab_key(cfg)}) but "
                f"model.vocab_size is {cfg.model.vocab_size}: its ids would index past the embedding; set "
                f"model.vocab_size={self.data.vocab_size} or more, or use the recipe the data was made for"
            )
        self.model = self._build_model()
        self.grpo = self._grpo_objective() if cfg.rl is not None else None  # before the engine wraps the model
        self.engine = build_engine(
            self.model,
            p,
            build_optimizer(self.model, cfg.optim),
            micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
            bf16=t.precision == "bf16",
            grad_clip=cfg.optim.grad_clip,
        )
        self.step = 0
        self._grad_norm = math.nan
        self.peak = peak_tflops(self.device, t.peak_tflops)
        self.skipped_steps = 0
        self.nonfinite_in_a_row = 0
        self.wandb_run_id: str | None = None
        self.checkpoints = CheckpointManager(self.run_dir, t.keep_last_k, t.checkpoint_hashes, t.async_save)
        self._stop_signal = 0
        self.resumed_from = self._resume()

    def _check_memory_fit(self) -> None:
        """Refuse, before anything is allocated, a layout the memory model says overflows this GPU
        (an out-of-memory error would come minutes later, after the model and data are built)."""
        if self.device.type != "cuda":
            return
        device_gib = torch.cuda.get_device_properties(self.device).total_memory / GIB
        peak = memory_summary(self.cfg)["peak_gib"]
        problem = memory_fit_problem(peak, device_gib, torch.cuda.get_device_name(self.device))
        if problem is None:
            return
        if not self.cfg.trainer.allow_memory_overflow:
            raise ValueError(f"{problem}; trainer.allow_memory_overflow=true starts anyway")
        if self.is_main:
            print(f"WARNING: {problem} (starting anyway: trainer.allow_memory_overflow=true)", file=sys.stderr)

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint saves and restores: the engine, the data state, the counters."""
        return CheckpointState(
            engine=self.engine,
            model_config=self.cfg.model,
            data=self.data,
            tokenizer=self.data.tokenizer,
            layout=layout_signature(self.cfg.parallel, self.cfg.trainer.precision),
            counters=TrainingCounters(self.step, self.skipped_steps, self.wandb_run_id),
            recipe=self.recipe,
        )

    def _lock_run_dir(self, job_id: str | None) -> RunLock | None:
        """Rank 0 takes the run directory's lock (released at exit, ``close``); every rank learns
        the outcome, so a refused launch stops on all of them with rank 0's message (collective)."""
        lock, problem = None, ""
        if self.is_main:
            lock = RunLock(self.run_dir, job_id=job_id)
            try:
                lock.acquire()
                atexit.register(lock.release)  # any normal exit, an error included, frees the directory
            except ValueError as exc:
                lock, problem = None, str(exc)
        problem = collectives.broadcast_object(problem, src=0)
        if problem:
            raise ValueError(problem)
        return lock

    def close(self) -> None:
        """Release the run directory (the process may go on, e.g. a test or a notebook)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _resume(self) -> Path | None:
        mode = self.cfg.trainer.resume
        stale = check_fresh_start(self.run_dir, mode, self.cfg.trainer.overwrite)
        if stale:  # trainer.overwrite=true: the run that was here goes first
            if self.is_main:
                print(f"trainer.overwrite=true: deleting the previous run's {', '.join(stale)}", file=sys.stderr)
                for path in map(Path, stale):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            collectives.barrier()
        if mode == "none":
            return None
        if mode == "auto":
            path = self.checkpoints.find_latest()
            if path is None:
                return None
        else:
            path = Path(mode)
            problem = verify_checkpoint(path) if path.is_dir() else "no such directory"
            if problem:
                raise ValueError(f"trainer.resume={mode}: {problem}")
        for line in check_resume(path, self.recipe, self.cfg.trainer.resume_changes):  # the same run only
            if self.is_main:
                print(line, file=sys.stderr, flush=True)
        counters = self.checkpoints.load(self.checkpoint_state(), path).counters
        self.step, self.skipped_steps, self.wandb_run_id = counters.step, counters.skipped_steps, counters.wandb_run_id
        if self.is_main:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return path

    def save_checkpoint(self, asynchronous: bool | None = None) -> Path | None:
        """A checkpoint of the current step; a failed save is reported and training goes on.
        ``asynchronous`` defaults to ``trainer.async_save``."""
        try:
            return self.checkpoints.save(self.checkpoint_state(), asynchronous)
        except CheckpointError as exc:
            if self.is_main:
                print(f"ERROR: {exc}", file=sys.stderr, flush=True)
            return None

    def _build_model(self) -> OrthrosForCausalLM:
        """This rank's shard of the model, built directly: random weights drawn from
        ``trainer.seed`` (the same at every TP size) or, with ``init.init_from``, a checkpoint's
        read tensor by tensor."""
        cfg = self.cfg
        if not cfg.init.init_from:
            return build_parallel_model(cfg.model, cfg.parallel, seed=cfg.trainer.seed).to(self.device)
        try:
            weights = LazyCheckpoint(cfg.init.init_from)  # opened first: a bad path fails before any build
        except FileNotFoundError as exc:
            where = "it does not exist" if not Path(cfg.init.init_from).exists() else str(exc)
            raise ValueError(
                f"model.init_from={cfg.init.init_from} holds no *.safetensors weights ({where}):"
                " run the job that writes it first (a recipe's comment names it; e.g. sft_tiny_cpu starts"
                " from `orthros-train --config-name tiny_cpu`), point it at a checkpoint's model/ or"
                " final/ directory, or set model.init_from=null to start from random weights"
            ) from exc
        except ValueError as exc:  # a truncated or corrupt weights file, named with its size
            raise ValueError(f"model.init_from={cfg.init.init_from}: {exc}") from exc
        model = build_parallel_model(cfg.model, cfg.parallel, seed=None)  # every weight is loaded next
        load_reference_shards(model, weights, cfg.model)
        return model.to(self.device)

    # -- RL -------------------------------------------------------------------------------------
    def _grpo_objective(self) -> GRPOObjective:
        """GRPO on this run's sharded policy; with a KL term, the frozen reference is a copy of
        the initial policy, sharded like it (taken before DeepSpeed partitions or steps it)."""
        reference = None
        if self.cfg.rl.kl_coef > 0:
            frozen = self._build_model()
            frozen.load_state_dict(self.model.state_dict())
            reference = partial(self._response_logprobs, frozen.eval().requires_grad_(False))
        return GRPOObjective(
            self.cfg.rl,
            self.cfg.data.loss_average,
            self._policy_logprobs,
            reference,
            parallel_state.get_data_parallel_group(),
        )

    def _policy_logprobs(self, layout: Any) -> torch.Tensor:
        """The current policy's log-probs of the layout's labels (no grad; collective)."""
        return self._response_logprobs(self.engine.module, layout.to(self.device))

    @torch.no_grad()
    def _response_logprobs(self, model: torch.nn.Module, layout: Any) -> torch.Tensor:
        was = model.training
        model.eval()
        try:
            return response_logprobs(model, layout).detach()
        finally:
            model.train(was)

    @contextmanager
    def _sampling_policy(self) -> Iterator[torch.nn.Module]:
        """The policy RL samples rollouts with: this rank's own shards, no second model. Every
        rank of a TP group decodes the same rows (the logits are gathered over TP) with the same
        seeds, so they pick the same tokens; under SP or CP a cached forward runs as under TP
        alone. Under ZeRO-3 the rank's shards are gathered over DP once for the sampling, and
        the per-module gather hooks lifted meanwhile (DeepSpeed's own
        ``unwrap_model_for_generation``), so DP ranks decode their prompts without waiting on
        each other's forwards (collective on entry and exit)."""
        if self.cfg.parallel.zero_stage == 3:
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

            with unwrap_model_for_generation(self.engine):
                yield self.engine.module
        else:
            yield self.engine.module

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``grad_accum_steps`` micro batches.

        The loss is the mean over the step's whole global batch (every micro-batch, DP and CP
        rank; ``orthros_train/train/global_loss.py``), so neither the gradient nor the logged
        loss depends on how the batch is split. An RL step's micro-batches are rollouts whose
        GRPO objective becomes per-token loss weights (``GRPOObjective``).

        A micro batch whose loss is NaN/Inf on any rank contributes zero gradients instead, and
        the step is then taken with lr = 0: the weights stay exactly as they were (Adam's moments
        decay by one step). The step is counted as skipped.
        """
        t, engine = self.cfg.trainer, self.engine
        engine.train()
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        dp = parallel_state.get_data_parallel_world_size()
        dp_group = parallel_state.get_data_parallel_group()
        micro = [self.data.next_batch().to(self.device) for _ in range(t.grad_accum_steps)]
        layouts = [m.layout for m in micro] if self.grpo is not None else micro
        units = global_loss_units(layouts, self.cfg.data.loss_average, dp_group)
        normalizer = micro_batch_normalizer(units, t.grad_accum_steps, dp)
        values: list[float | None] = [None] * len(micro)
        extra: dict[str, float] = {}
        if self.grpo is not None:
            layouts, values, extra = self.grpo.prepare(micro, units)
        total_loss, tokens, flops, nonfinite = 0.0, 0, 0.0, False
        for layout, value in zip(layouts, values):
            flops += layout_flops(self.cfg.model, layout)
            loss = engine(layout, loss_normalizer=normalizer).loss
            if loss is None:  # no labelled token in this micro batch: it adds nothing
                loss = sum((p * 0).sum() for p in engine.module.parameters() if p.requires_grad)
            # every rank must take the same path: one reduction of the flag where the loss is
            if collectives.any_flag(~torch.isfinite(loss.detach())):
                nonfinite = True
                loss = sum((p * 0).sum() for p in engine.module.parameters() if p.requires_grad)
            engine.backward(loss)  # DeepSpeed scales by 1 / grad_accum_steps
            if engine.is_gradient_accumulation_boundary():
                if self.cfg.parallel.zero_stage == 0:
                    self._grad_norm = tensor_parallel_grad_norm(engine.module)
                    nonfinite = nonfinite or not math.isfinite(self._grad_norm)
                for group in engine.optimizer.param_groups:
                    group["lr"] = 0.0 if nonfinite else lr
                if nonfinite:
                    for p in engine.module.parameters():
                        if p.grad is not None:
                            p.grad.zero_()
            engine.step()  # steps the optimizer at the accumulation boundary only
            # This micro batch's share of the step's loss (GRPO: the objective's own value).
            share = float(loss.detach()) / (t.grad_accum_steps * dp) if value is None else value
            total_loss += share if not nonfinite else math.nan
            tokens += layout.num_tokens
        grad_norm = engine.get_global_grad_norm()  # None without ZeRO: see _grad_norm
        if grad_norm is None:
            grad_norm = self._grad_norm
        grad_norm = float(grad_norm)
        if not nonfinite and not math.isfinite(grad_norm):
            nonfinite = True  # under ZeRO the norm is known only after the update: count, stop if it repeats
        self.step += 1
        # Every DP rank holds its share of the global mean: their sum is the step's loss.
        stats = collectives.reduce_floats([total_loss, float(tokens), flops], group=dp_group)
        return {
            "loss": float(stats[0]),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": int(stats[1]),
            # Every TP rank of a DP group computes the same layout: count each group once.
            "flops": float(stats[2]),
            "nonfinite": nonfinite,
            "objective": extra,  # RL: rewards, clip fraction, KL (global means)
        }

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation loss per labelled token; None when the data has no validation split."""
        self.engine.eval()
        total, weight = 0.0, 0
        for layout in self.data.valid_batches(self.cfg.trainer.eval_batches):
            out = self.engine(layout.to(self.device), loss_normalizer=1.0)  # sum(w * CE)
            if out.loss is not None:
                total += float(out.loss)
                weight += layout.num_loss_tokens
        return total / weight if weight else None

    # -- the loop -----------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self._stop_signal == signal.SIGINT:
                # A second Ctrl-C: leave now. A save in progress is in a hidden temporary directory
                # until its atomic rename, so the checkpoints already published stay intact.
                sys.stderr.write("orthros-train: second Ctrl-C: exiting at once without saving\n")
                sys.stderr.flush()
                if self.run_lock is not None:
                    self.run_lock.release()
                os._exit(130)
            if self.is_main:
                sys.stderr.write(
                    f"orthros-train: Ctrl-C: finishing step {self.step + 1}, saving a checkpoint, then exiting "
                    "(Ctrl-C again exits at once without saving)\n"
                )
                sys.stderr.flush()
        self._stop_signal = signum  # acted on at the end of the current step

    def _should_stop(self) -> bool:
        return collectives.any_flag(bool(self._stop_signal))  # one preempted rank stops them all

    def fit(self) -> dict[str, Any]:
        """Train to ``trainer.max_steps`` (or a stop signal), save and export. The stop signals'
        handlers stay installed through the final save: a Ctrl-C there is a second one."""
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        try:
            return self._fit()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        log = None
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.json").write_text(json.dumps(self.recipe, indent=2, default=str))
            log = MetricsLog(self.run_dir, self._wandb())
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        progress = _progress(t.max_steps, enabled=t.progress and self.is_main, initial=self.step)
        history: list[dict[str, Any]] = []
        eval_loss = None
        world = dist.get_world_size()
        running_loss: float | None = None
        preempted = False
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
                    "skipped_steps": self.skipped_steps,
                    **stats["objective"],
                }
                if stats["nonfinite"]:
                    self.skipped_steps += 1
                    self.nonfinite_in_a_row += 1
                    record.update(skipped=True, skipped_steps=self.skipped_steps)
                    if self.is_main:
                        progress.write(f"step {self.step}: non-finite loss or grad norm, update skipped")
                    if self.nonfinite_in_a_row >= t.max_nonfinite_steps:
                        raise NonFiniteTrainingError(
                            f"{self.nonfinite_in_a_row} consecutive steps with a NaN/Inf loss or gradient norm "
                            f"(last at step {self.step}); stopping. Lower optim.lr, check the data near sample "
                            f"{self.data.consumed_samples}, or resume from an earlier checkpoint."
                        )
                else:
                    self.nonfinite_in_a_row = 0
                    if (
                        running_loss is not None
                        and t.loss_spike_factor > 0
                        and self.grpo is None  # a GRPO loss hovers around 0, of either sign
                        and stats["loss"] > t.loss_spike_factor * running_loss
                    ):
                        record["loss_spike"] = True
                        if self.is_main:
                            progress.write(
                                f"step {self.step}: loss spike {stats['loss']:.3f} vs mean {running_loss:.3f}"
                            )
                    running_loss = stats["loss"] if running_loss is None else 0.95 * running_loss + 0.05 * stats["loss"]
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
                        + (f" | reward {record['reward_mean']:.3f}" if "reward_mean" in record else "")
                    )
                if t.save_every > 0 and self.step % t.save_every == 0 and self.step < t.max_steps:
                    self.save_checkpoint()
                if t.fail_at_step is not None and self.step == t.fail_at_step:
                    os._exit(17)  # fault injection (tests): die without cleanup, like a lost node
                if self._should_stop():
                    preempted = True
                    break
        finally:
            self.checkpoints.wait()  # an async save in flight finishes before the run ends or fails
            progress.close()
            if log is not None:
                log.close()
        if not history and self.resumed_from is not None:
            saved: Path | None = self.resumed_from  # resumed at the end: nothing new to save
        else:
            saved = self.save_checkpoint(asynchronous=False)  # the process is about to end
        if preempted:
            if self.is_main:
                name = "Ctrl-C" if self._stop_signal == signal.SIGINT else f"signal {self._stop_signal}"
                print(f"stopped by {name} at step {self.step}; checkpoint {saved}", flush=True)
            return {
                "history": history,
                "eval_loss": eval_loss,
                "checkpoint": str(saved),
                "preempted": True,
                "signal": self._stop_signal,
            }
        if saved is None:
            raise CheckpointError(f"the final checkpoint of step {self.step} could not be saved (see above)")
        final_dir = self.export("final")
        return {"history": history, "eval_loss": eval_loss, "checkpoint": str(final_dir), "preempted": False}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in reference layout, on every rank (ZeRO-3 shards gathered first)."""
        module = self.engine.module
        if self.cfg.parallel.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {k: v.clone() for k, v in gather_full_state_dict(module, self.cfg.model).items()}
        return gather_full_state_dict(module, self.cfg.model)

    def reference_model(self, state: dict[str, torch.Tensor] | None = None) -> OrthrosForCausalLM:
        """A single-device model with the trained weights (inference, export). Without ``state``
        this gathers it (collective); writers pass the state they gathered on every rank, so only
        the rank that writes builds the model."""
        state = self.full_state_dict() if state is None else state
        model = OrthrosForCausalLM(self.cfg.model)
        model.load_state_dict({k: v.float().cpu() for k, v in state.items()})
        return model

    def export(self, name: str) -> Path:
        """The weights in reference layout + tokenizer (``OrthrosForCausalLM.from_pretrained``)."""
        target = self.run_dir / "checkpoints" / name
        state = self.full_state_dict()  # collective
        if self.is_main:
            self.reference_model(state).save_pretrained(target)
            self.data.tokenizer.save_pretrained(target)
        collectives.barrier()
        return target

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of ``prompt`` through prefill + decode (single-device model).
        Collective: every rank joins the gather, only the main rank builds the model and
        generates (the others return "")."""
        state = self.full_state_dict()
        if not self.is_main:
            return ""
        model = self.reference_model(state).eval()
        ids = self.data.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = model.generate_greedy(ids, max_new_tokens, self.data.eod_token_id)
        return self.data.tokenizer.decode(new[0].tolist())

    def _wandb(self) -> Any | None:
        w = self.cfg.trainer.wandb
        if not w.enabled or w.mode == "disabled":
            return None
        try:  # optional: a machine without wandb (the GPU image) trains with trainer.wandb.enabled=false
            import wandb
        except ImportError as err:
            raise ValueError(
                f"trainer.wandb.enabled=true but wandb cannot be imported ({err}): install it "
                "(pip install 'orthros-train[wandb]') or pass trainer.wandb.enabled=false"
            ) from None

        run = wandb.init(
            project=w.project,
            name=w.name,
            group=w.group,
            mode=w.mode,
            dir=str(self.run_dir),
            config=self.recipe,
            id=self.wandb_run_id,  # a resumed run continues its wandb run
            resume="allow" if self.wandb_run_id else None,
            reinit="finish_previous",
            settings=wandb.Settings(quiet=True),  # no banner or end-of-run summary on the console
        )
        self.wandb_run_id = run.id
        return run


def _progress(total: int, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, desc="train")


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive NaN/Inf steps."""
