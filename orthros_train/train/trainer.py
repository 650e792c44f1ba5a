"""The training loop: one trainer for every run, from the CPU demo to multi-node H100s.

Every run goes through the same path: megatron-core parallel state (TP/SP, a private
one-process group on a laptop), the tensor-parallel Orthros model, and a DeepSpeed engine for
data parallelism / ZeRO. The parts are built by ``train/build.py``; one optimizer step is
``train/step.py``'s; the loop below runs steps and hands each one to the components whose
cadence it is: the health policy (``health.py``), the step log (``step_log.py``), evaluation
(``evaluation.py``), checkpoints (``checkpointing.py``) and the stop signals (``stop_signals.py``).
Pretraining, SFT and RL differ only in their data and their objective (``objective.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orthros_train.logging_setup import RANK_ZERO
from orthros_train.model import OrthrosForCausalLM
from orthros_train.options import Precision
from orthros_train.parallel import collectives
from orthros_train.parallel.compile import check_compile_toolchain
from orthros_train.parallel.engine import build_engine
from orthros_train.parallel.setup import DistributedEnv
from orthros_train.parallel.state_dict import gather_full_state_dict
from orthros_train.train.build import (
    build_data,
    build_model,
    build_objective,
    check_memory_fit,
    lock_run_dir,
    seed_everything,
    set_determinism,
    start_processes,
)
from orthros_train.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointState,
    TrainingCounters,
    layout_signature,
)
from orthros_train.train.checkpointing import Checkpointing
from orthros_train.train.config import RunConfig
from orthros_train.train.evaluation import Evaluator
from orthros_train.train.health import LossSpikeDetector, NonFiniteGuard, NonFiniteTrainingError
from orthros_train.train.metrics import peak_tflops
from orthros_train.train.optim import build_optimizer, lr_at
from orthros_train.train.plan import attention_routes
from orthros_train.train.rl import Policy
from orthros_train.train.run_dir import publish_directory
from orthros_train.train.step import StepStats, TrainStep
from orthros_train.train.step_log import StepLog, start_wandb
from orthros_train.train.stop_signals import StopSignals
from orthros_train.train.teacher import check_teacher, check_teacher_unchanged

log = logging.getLogger(__name__)

# Fault injection (trainer.fail_at_step, tests): the process dies without cleanup, like a lost
# node; torchrun sees this exit code.
LOST_NODE_EXIT_CODE = 17


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
        self.cfg, self.recipe = cfg, resolved_recipe or {}
        self.run_lock = None
        self._restore_determinism = lambda: None  # set_determinism's restore once applied
        t, p = cfg.trainer, cfg.parallel
        self.device = start_processes(cfg, env or DistributedEnv())
        self.is_main = dist.get_rank() == 0
        check_memory_fit(cfg, self.device)
        if p.compile:
            check_compile_toolchain(self.device.type)  # torch.compile would fail inside the first step
        check_teacher(cfg)  # a missing teacher or another vocabulary, before the run directory is touched
        self.run_dir = Path(t.run_dir)
        self.run_lock = lock_run_dir(self.run_dir, job_id)  # before anything reads or writes the directory
        try:
            self._build(cfg)
        except BaseException:  # a refused resume, a bad corpus: the lock and the process-wide switches go back
            self.close()
            raise

    def _build(self, cfg: RunConfig) -> None:
        """The run's data, model, engine and checkpointing, resumed where the run directory says."""
        t, p = cfg.trainer, cfg.parallel
        seed_everything(t.seed)
        self._restore_determinism = set_determinism(t.deterministic)
        policy = Policy(self.device, zero_stage=p.zero_stage) if cfg.rl is not None else None
        self.data = build_data(cfg, policy)
        self.model = build_model(cfg, self.device)
        if self.is_main:  # one line: the kernel of each kind of layout (the dry run also says why)
            routes = attention_routes(cfg, self.device.type)[self.device.type]
            log.info("attention route on %s: %s", self.device.type,
                     "; ".join(f"{layout} -> {route.split(':')[0]}" for layout, route in routes.items()
                               if layout != "decided by"))
        # before the engine wraps the model
        objective = build_objective(cfg, self.model, policy, self.device, tokenizer=self.data.tokenizer)
        self.teacher = getattr(objective, "teacher", None)  # distillation's frozen dense twin, if any
        self.engine = build_engine(
            self.model, p, build_optimizer(self.model, cfg.optim), micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps, bf16=t.precision == Precision.bf16, grad_clip=cfg.optim.grad_clip,
        )  # fmt: skip
        if policy is not None:
            policy.attach(self.engine)
        self.guard = NonFiniteGuard(self.engine.module, t.max_nonfinite_steps)
        self.step_fn = TrainStep(self.engine, objective, self.guard, cfg.model, cfg.data,
                                 p.zero_stage, self.device)
        self.spikes = LossSpikeDetector(t.loss_spike_factor if objective.watch_loss_spikes else 0.0)
        self.evaluator = Evaluator(self.engine, self.data, self.device, t)
        self.step, self.wandb_run_id = 0, None
        manager = CheckpointManager(self.run_dir, t.keep_last_k, t.checkpoint_hashes, t.async_save)
        self.checkpointing = Checkpointing(manager, t, self.recipe, self.checkpoint_state, self.is_main)
        counters = self.checkpointing.resume()
        if counters is not None and self.teacher is not None:  # the teacher is not saved: it must be the same
            meta = json.loads((self.checkpointing.resumed_from / "meta.json").read_text())
            check_teacher_unchanged(meta.get("teacher"), self.teacher.identity, self.checkpointing.resumed_from)
        if counters is not None:
            self.step, self.wandb_run_id = counters.step, counters.wandb_run_id
            self.guard.skipped = counters.skipped_steps

    @property
    def checkpoints(self) -> CheckpointManager:
        """Where the run's checkpoints are written (settable: another manager, another place)."""
        return self.checkpointing.manager

    @checkpoints.setter
    def checkpoints(self, manager: CheckpointManager) -> None:
        self.checkpointing.manager = manager

    @property
    def skipped_steps(self) -> int:
        return self.guard.skipped

    @property
    def resumed_from(self) -> Path | None:
        return self.checkpointing.resumed_from

    def checkpoint_state(self) -> CheckpointState:
        """What a checkpoint saves and restores: the engine, the data state, the counters."""
        return CheckpointState(
            engine=self.engine, model_config=self.cfg.model, data=self.data, tokenizer=self.data.tokenizer,
            layout=layout_signature(self.cfg.parallel, self.cfg.trainer.precision),
            counters=TrainingCounters(self.step, self.guard.skipped, self.wandb_run_id), recipe=self.recipe,
            teacher=self.teacher.identity if self.teacher is not None else None,
        )  # fmt: skip

    def save_checkpoint(self, asynchronous: bool | None = None) -> Path | None:
        return self.checkpointing.save(asynchronous)

    def close(self) -> None:
        """Release the run directory (the process may go on, e.g. a test or a notebook)."""
        if self.run_lock is not None:
            self.run_lock.release()
        self._restore_determinism()

    def train_step(self) -> StepStats:
        """One optimizer step over ``grad_accum_steps`` micro batches (``train/step.py``)."""
        t = self.cfg.trainer
        batches = [self.data.next_batch() for _ in range(t.grad_accum_steps)]
        stats = self.step_fn(batches, lr_at(self.step, self.cfg.optim, t.max_steps), step=self.step)
        self.step += 1
        return stats

    def evaluate(self) -> float | None:
        return self.evaluator.evaluate()

    def fit(self) -> dict[str, Any]:
        """Train to ``trainer.max_steps`` (or a stop signal), save and export. The stop signals'
        handlers stay installed through the final save: a Ctrl-C there is a second one."""
        t = self.cfg.trainer
        steps = self._step_log()
        history: list[dict[str, Any]] = []
        with StopSignals(lambda: self.step, self.is_main, self.close) as stop:
            try:
                while self.step < t.max_steps:
                    start = time.perf_counter()
                    stats = self.train_step()
                    record = steps.record(self.step, stats, time.perf_counter() - start, self.data.consumed_samples,
                                        self.guard.skipped)
                    self._check_health(stats, record)
                    if self.evaluator.due(self.step) and (eval_loss := self.evaluate()) is not None:
                        record["eval_loss"] = eval_loss
                    history.append(record)
                    steps.write(record)
                    self.checkpointing.after_step(self.step)
                    if t.fail_at_step is not None and self.step == t.fail_at_step:
                        # Said on every rank and flushed: os._exit skips the handlers' own flush.
                        log.error("trainer.fail_at_step=%d: this process is killed on purpose after step %d (exit "
                                  "%d, a test hook that simulates a lost node; checkpoints are kept and a relaunch "
                                  "resumes); leave trainer.fail_at_step null for a normal run", t.fail_at_step,
                                  self.step, LOST_NODE_EXIT_CODE)
                        for handler in logging.getLogger().handlers:
                            with contextlib.suppress(ValueError, OSError):  # a handler on a closed stream
                                handler.flush()
                        os._exit(LOST_NODE_EXIT_CODE)
                    if stop.requested():
                        break
            finally:
                self.checkpoints.wait()  # an async save in flight finishes before the run ends or fails
                steps.close()
            return self._finish(history, stop)

    def _check_health(self, stats: StepStats, record: dict[str, Any]) -> None:
        """Count a skipped step (too many in a row stop the run) and flag a loss spike."""
        self.guard.count(not stats.nonfinite, self.step, self.data.consumed_samples)
        if stats.nonfinite:
            record.update(skipped=True, skipped_steps=self.guard.skipped)
            log.warning("step %d: non-finite loss or grad norm, update skipped", self.step, extra=RANK_ZERO)
        elif (mean := self.spikes.observe(stats.loss)) is not None:
            record["loss_spike"] = True
            log.warning("step %d: loss spike %.3f vs mean %.3f", self.step, stats.loss, mean, extra=RANK_ZERO)

    def _step_log(self) -> StepLog:
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.json").write_text(json.dumps(self.recipe, indent=2, default=str))
        wandb_run = start_wandb(self.cfg.trainer.wandb, self.run_dir, self.recipe, self.wandb_run_id) \
            if self.is_main else None
        if wandb_run is not None:
            self.wandb_run_id = wandb_run.id  # a resumed run continues this one
        return StepLog(self.run_dir, self.cfg.trainer, self.is_main, dist.get_world_size(),
                       peak_tflops(self.device, self.cfg.trainer.peak_tflops), self.device, self.step, wandb_run)

    def _finish(self, history: list[dict[str, Any]], stop: StopSignals) -> dict[str, Any]:
        """The end-of-run save; the final export unless a signal stopped the run."""
        saved = self.checkpointing.final(trained=bool(history))
        eval_loss = next((r["eval_loss"] for r in reversed(history) if "eval_loss" in r), None)
        if stop.received:
            log.info("stopped by %s at step %d; checkpoint %s", stop.name(), self.step, saved)
            return {"history": history, "eval_loss": eval_loss, "checkpoint": str(saved), "preempted": True,
                    "signal": stop.received}
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
            model = self.reference_model(state)

            def write(folder: Path) -> None:
                model.save_pretrained(folder)
                self.data.tokenizer.save_pretrained(folder)

            # Written beside it and renamed into place: final/ holds a whole model or does not exist.
            publish_directory(target, write)
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


__all__ = ["LOST_NODE_EXIT_CODE", "NonFiniteTrainingError", "Trainer"]
