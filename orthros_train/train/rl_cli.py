"""GRPO fine-tuning from a Hydra recipe (``recipes/rl_tiny_cpu.yaml``).

``orthros-train`` runs a recipe that has an ``rl`` section through ``run_rl`` (same command, same
recipe folder); ``python -m orthros_train.train.rl_cli`` is the same thing::

    orthros-train --config-name rl_tiny_cpu                        # toy task, reward rises in ~a minute
    orthros-train --config-name rl_tiny_cpu trainer.dry_run=true   # the plan only
    orthros-train --config-name rl_tiny_cpu task.name=rollouts task.rollouts=rollouts.jsonl \\
        model.init_from=runs/x/checkpoints/final                   # train on an external engine's rollouts

An RL recipe has the sections of a training recipe (``model`` with ``init_from``, ``optim``,
``trainer``, ``parallel``, ``data``: validated by the same typed config) plus

* ``rl``: the GRPO settings (``orthros_train.train.rl.RLConfig``),
* ``task``: where rollouts come from (``TaskConfig``): ``pattern`` (the CPU toy task, our own
  generation), ``prompts`` (an ``orthros-data rl`` prompt set in ``data.paths`` scored by a
  reward function ``module:function``) or ``rollouts`` (a JSONL file of ``Rollout`` records
  written by an external engine).

It runs the single-process loop (``GRPOTrainer``: reference model, plain AdamW, prefill/decode
sampling), logs ``metrics.jsonl`` in ``trainer.run_dir`` and saves ``checkpoints/final``.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from orthros_train.train.cli import RECIPES_DIR

TASKS = ("pattern", "prompts", "rollouts")


@dataclass
class TaskConfig:
    """The ``task`` section of an RL recipe."""

    name: str = "pattern"  # pattern | prompts | rollouts
    # pattern (toy): prompts of random tokens in [low, model.vocab_size); count up from the last one
    low: int = 2
    prompt_len: int = 8
    response_len: int = 8
    token_rewards: bool = False  # per-token (process) rewards instead of one reward per response
    eval_prompts: int = 64  # greedy accuracy on this many fresh prompts at the start and the end
    # prompts: an `orthros-data rl` set (data.paths) + reward_fn(prompt_ids, response_ids, reference_ids)
    reward: str | None = None  # "package.module:function"
    stop_token_ids: list[int] | None = None  # None: the tokenizer's EOS when there is one
    # rollouts: an external engine's rollouts (JSONL of Rollout records), prompts_per_step x
    # group_size rows per update, in file order
    rollouts: str | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task.name must be one of {TASKS}, got {self.name!r}")
        if self.name == "prompts" and not self.reward:
            raise ValueError("task.name=prompts needs task.reward (a reward function 'module:function')")
        if self.name == "rollouts" and not self.rollouts:
            raise ValueError("task.name=rollouts needs task.rollouts (a JSONL file of rollouts)")


def _section(cls: type, values: dict[str, Any] | None, name: str) -> Any:
    values = dict(values or {})
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in recipe section '{name}'; valid keys: "
                         f"{sorted(f.name for f in fields(cls))}")
    return cls(**values)


def load_reward(spec: str):
    """``module:function`` -> the function."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task.reward must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"task.reward {spec!r}: {module} has no function {attr!r}")
    return fn


def run_rl(resolved: dict[str, Any]) -> dict[str, Any]:
    """Run an RL recipe given as a resolved dict (what Hydra composed)."""
    from orthros_train.model import OrthrosForCausalLM
    from orthros_train.train.config import run_config_from_dict
    from orthros_train.train.metrics import MetricsLog
    from orthros_train.train.rl import (
        GRPOTrainer,
        PatternTask,
        RLConfig,
        RolloutGenerator,
        load_rollouts,
        rollout_reward,
    )
    from orthros_train.train.trainer import seed_everything

    resolved = dict(resolved)
    resolved.pop("hydra", None)
    rl_cfg = _section(RLConfig, resolved.pop("rl", None), "rl")
    task = _section(TaskConfig, resolved.pop("task", None), "task")
    run = run_config_from_dict(resolved)
    t = run.trainer
    if run.parallel.world_size > 1:
        raise ValueError("the RL loop runs on one process (parallel: single)")
    if t.dry_run:
        return _dry_run(run, rl_cfg, task)
    seed_everything(t.seed)
    device = torch.device("cuda" if t.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    tokenizer = None
    if run.init.init_from:
        from orthros_train.infer.loading import load_tokenizer

        policy = OrthrosForCausalLM.from_pretrained(run.init.init_from)
        tokenizer = load_tokenizer(run.init.init_from, required=False)
    else:
        policy = OrthrosForCausalLM(run.model)
    policy.to(device)
    trainer = GRPOTrainer(policy, rl_cfg, run.optim, max_steps=t.max_steps)

    run_dir = Path(t.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps({**resolved, "rl": asdict(rl_cfg), "task": asdict(task)},
                                                    indent=2, default=str))
    log = MetricsLog(run_dir)
    summary: dict[str, Any] = {"task": task.name}
    start = time.perf_counter()

    def record(r: dict[str, Any]) -> None:
        r = {**r, "elapsed_s": time.perf_counter() - start}
        log.log(r)
        if t.log_every > 0 and (r["step"] % t.log_every == 0 or r["step"] == 1):
            print(f"step {r['step']:>5} | reward {r['reward_mean']:.3f} | loss {r['loss']:+.4f} | "
                  f"clip {r.get('clip_fraction', 0.0):.3f}" + (f" | kl {r['kl']:.4f}" if "kl" in r else "")
                  + f" | {r['elapsed_s']:.1f}s", flush=True)

    if task.name == "pattern":
        pattern = PatternTask(run.model.vocab_size, task.low, task.prompt_len, task.response_len,
                              task.token_rewards, seed=t.seed)
        rl_cfg.max_new_tokens = task.response_len
        summary["greedy_accuracy_start"] = pattern.score(policy, task.eval_prompts)
        generator = RolloutGenerator(pattern.reward, rl_cfg)
        history = trainer.train(lambda step: pattern.prompts(rl_cfg.prompts_per_step), generator, log=record)
        summary["greedy_accuracy_end"] = pattern.score(policy, task.eval_prompts)
    elif task.name == "prompts":
        from orthros_train.data.indexed import resolve_prefixes
        from orthros_train.data.rl import PromptSet

        if run.data.source != "indexed":
            raise ValueError("task.name=prompts reads an `orthros-data rl` set: data.source=indexed, data.paths")
        prefixes = [p for path in run.data.paths for p in resolve_prefixes(path)]
        prompt_set = PromptSet(prefixes, rl_cfg.prompts_per_step, t.seed)
        stops = task.stop_token_ids
        if stops is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stops = [eos] if eos is not None else []
        generator = RolloutGenerator(load_reward(task.reward), rl_cfg, stops)

        def prompts(step: int):
            batch = prompt_set.next_prompts()
            return [p.input_ids.tolist() for p in batch], [p.reference_ids for p in batch]

        history = trainer.train(prompts, generator, log=record)
    else:
        rollouts = load_rollouts(task.rollouts)
        per_update = rl_cfg.prompts_per_step * rl_cfg.group_size
        history = []
        for k in range(min(t.max_steps, math.ceil(len(rollouts) / per_update))):
            batch = rollouts[k * per_update : (k + 1) * per_update]
            stats = trainer.update(batch)
            r = {"step": trainer.step, **stats}
            history.append(r)
            record(r)
        summary["rollouts"] = len(rollouts)
        summary["mean_reward_in_file"] = sum(rollout_reward(r) for r in rollouts) / len(rollouts)
    log.close()
    final = run_dir / "checkpoints" / "final"
    policy.save_pretrained(final)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(final))
    rewards = [h["reward_mean"] for h in history]
    k = max(1, min(5, len(rewards) // 4))
    summary.update(
        steps=len(history),
        reward_first=sum(rewards[:k]) / k if rewards else None,
        reward_last=sum(rewards[-k:]) / k if rewards else None,
        wall_s=time.perf_counter() - start,
        checkpoint=str(final),
    )
    print(json.dumps(summary, indent=2))
    return summary


def _dry_run(run, rl_cfg, task: TaskConfig) -> dict[str, Any]:
    """The training plan of the policy plus what one RL step reads and generates."""
    from orthros_train.train.trainer import plan_summary

    summary = plan_summary(run)
    rows = rl_cfg.prompts_per_step * rl_cfg.group_size
    response = task.response_len if task.name == "pattern" else rl_cfg.max_new_tokens
    summary["rl"] = {**asdict(rl_cfg), "task": task.name, "rows_per_step": rows,
                     "max_response_tokens_per_step": rows * response}
    print(json.dumps(summary, indent=2))
    return summary


@hydra.main(config_path=RECIPES_DIR, config_name=None, version_base="1.3")
def main(cfg: DictConfig) -> None:
    if not cfg:
        raise SystemExit("pick an RL recipe, e.g. `python -m orthros_train.train.rl_cli --config-name rl_tiny_cpu`")
    try:
        run_rl(OmegaConf.to_container(cfg, resolve=True))
    except ValueError as exc:
        raise SystemExit(f"orthros-rl: {exc}") from exc


if __name__ == "__main__":
    main()
