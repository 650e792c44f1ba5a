"""Running lm-eval tasks on an in-memory Orthros model (used by ``orthros-eval lm-eval``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.eval.common import environment


def _require_lm_eval() -> None:
    """lm-eval is an optional extra: say how to get it instead of a bare ModuleNotFoundError."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ImportError("orthros-eval lm-eval needs lm-evaluation-harness: pip install 'orthros-train[eval]'")


def task_manager(tasks: Sequence[str], include_paths: Sequence[str | Path] = (), tasks_dir: str | Path | None = None):
    """A TaskManager that knows the example tasks (written on demand) and the user's folders.

    lm-eval's built-in task index (thousands of YAMLs) is only loaded when a requested task is
    not found in the local folders.
    """
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    from orthros_train.eval.tasks import EXAMPLE_TASKS, TAG, default_tasks_dir, write_example_tasks

    paths = [str(Path(p).expanduser().resolve()) for p in include_paths]
    if any(t in EXAMPLE_TASKS or t == TAG for t in tasks):
        paths.append(str(write_example_tasks(tasks_dir or default_tasks_dir())))
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False, verbosity="ERROR")
        if all(t in local.all_tasks for t in tasks):
            return local
    return TaskManager(include_path=paths or None, include_defaults=True, verbosity="ERROR")


def run_lm_eval(
    model: torch.nn.Module,
    tokenizer,
    tasks: Sequence[str],
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    include_paths: Sequence[str | Path] = (),
    tasks_dir: str | Path | None = None,
    seed: int = 1234,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` through ``OrthrosLM``; returns the JSON-ready results."""
    _require_lm_eval()
    from orthros_train.eval.lm_eval_adapter import OrthrosLM

    lm = OrthrosLM(model=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    summary = evaluate_summary(lm, tasks, limit, num_fewshot, include_paths, tasks_dir, seed)
    return {
        **summary,
        "environment": environment(next(model.parameters()).device),
        "config": model.config.to_dict(),
    }


def evaluate_summary(
    model: Any,
    tasks: Sequence[str],
    limit: float | None,
    num_fewshot: int | None,
    include_paths: Sequence[str | Path],
    tasks_dir: str | Path | None,
    seed: int,
    **evaluate_args: Any,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``model`` (an lm-eval model object or a registered model's
    name, with ``evaluate_args`` such as ``model_args``) on known tasks, every seed set; the
    JSON-ready summary both routes return (in-process adapter and lm-eval's vllm model)."""
    import lm_eval

    manager = task_manager(tasks, include_paths, tasks_dir)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise UserError(f"unknown lm-eval task(s) {missing}; offline, a task needs a YAML that reads local files")
    if limit is not None and float(limit) >= 1:
        limit = int(limit)
    out = lm_eval.simple_evaluate(
        model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager, log_samples=False,
        bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        **evaluate_args,
    )  # fmt: skip
    results = {
        task: {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) and k != "alias"}
        for task, metrics in out["results"].items()
    }
    return {
        "tasks": list(tasks),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "results": results,
        "versions": {k: str(v) for k, v in out.get("versions", {}).items()},
        "n_shot": out.get("n-shot", {}),
    }
