"""``orthros-train``: the Hydra entry point. Recipes are primary configs (``--config-name``)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from orthros_train.errors import UserError, caused_by_ctrl_c, exit_on_ctrl_c, first_line, report_bug

# Seconds of imports (hydra, torch through the config): Ctrl-C there is one line and exit 130.
with exit_on_ctrl_c("orthros-train"):
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from orthros_train.locations import RECIPES_DIR as LOCATED_RECIPES
    from orthros_train.train.config import record_geometry, run_config_from_dict

if TYPE_CHECKING:
    from orthros_train.parallel.setup import DistributedEnv
    from orthros_train.train.config import RunConfig

RECIPES_DIR = str(LOCATED_RECIPES)  # Hydra takes a string


def hydra_output_dir(run_dir: str) -> str:
    """The recipes' ``hydra.run.dir`` (``${orthros_hydra_dir:${trainer.run_dir}}``): where Hydra
    writes this launch's record (``.hydra/`` and its log) before the job starts.

    The run directory itself only for a new run. A directory that already holds a run (its
    ``.hydra/`` from an earlier launch) or that another live process owns gets a temporary
    directory instead: this launch may still be refused (a live owner, a finished run, another
    model), and a refused launch must leave the run's record as it was. An accepted launch copies
    its record in (``publish_launch_record``). An unwritable ``trainer.run_dir`` also gets a
    temporary directory, so the trainer reports it itself, naming the key and the fix, instead of
    Hydra failing with a traceback. The answer is kept per run directory: Hydra may resolve the
    key more than once."""
    if run_dir not in _HYDRA_DIRS:
        _HYDRA_DIRS[run_dir] = _choose_hydra_dir(run_dir)
    return _HYDRA_DIRS[run_dir]


_HYDRA_DIRS: dict[str, str] = {}


def _choose_hydra_dir(run_dir: str) -> str:
    import tempfile

    from orthros_train.train.run_lock import held_by_another

    path = Path(run_dir)
    try:
        if held_by_another(path, os.environ.get("SLURM_JOB_ID")) is None:
            fresh = not (path / ".hydra").exists()
            path.mkdir(parents=True, exist_ok=True)
            if fresh and os.access(path, os.W_OK):
                return run_dir
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="orthros-hydra-")


def publish_launch_record(run_dir: str | Path, launch_dir: str | Path) -> bool:
    """Copy an accepted launch's ``.hydra/`` from the temporary directory Hydra wrote it to into
    the run directory, replacing the previous launch's (a resume with new overrides is recorded).
    Returns whether anything was copied."""
    import shutil

    from orthros_train.train.run_dir import publish_directory

    staged, run_dir = Path(launch_dir) / ".hydra", Path(run_dir)
    if not staged.is_dir() or Path(launch_dir).resolve() == run_dir.resolve():
        return False
    publish_directory(run_dir / ".hydra", lambda tmp: shutil.copytree(staged, tmp, dirs_exist_ok=True))
    _move_launch_logs(Path(launch_dir), run_dir)
    shutil.rmtree(launch_dir, ignore_errors=True)
    return True


def _move_launch_logs(launch_dir: Path, run_dir: Path) -> None:
    """Hydra's job log (``cli.log``) of an accepted launch continues in the run directory's,
    after what the launch logged so far (appended, as Hydra appends across launches)."""
    import logging

    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            continue
        source = Path(handler.baseFilename)
        if source.parent.resolve() != launch_dir.resolve():
            continue
        handler.acquire()
        try:
            handler.close()
            target = run_dir / source.name
            with open(target, "a") as out:
                out.write(source.read_text() if source.exists() else "")
            handler.baseFilename = str(target.resolve())
            handler.mode = "a"  # reopened on the next record
        finally:
            handler.release()


OmegaConf.register_new_resolver("orthros_hydra_dir", hydra_output_dir, replace=True)


def launcher_env() -> "DistributedEnv":
    """What torchrun / srun set for this process (the only place that reads them)."""
    from orthros_train.parallel.setup import DEFAULT_MASTER_PORT, DistributedEnv

    # A world of one needs no rendezvous: it takes the private in-memory store. Launcher variables
    # inherited by a single process (e.g. from a parent that ran a trainer in-process) would
    # otherwise make concurrent runs race for the same MASTER_PORT.
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return DistributedEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            launched=True,
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    return DistributedEnv()


def git_commit() -> str | None:
    """The commit of the code that runs (logged with the recipe), when it is a git checkout."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def warn_memory_fit(memory: dict) -> None:
    """A dry run's verdict on the recipe's stated GPU: red when the estimate exceeds it."""
    from orthros_train.train.memory import HEADROOM_FRACTION, memory_fit_problem

    device = memory.get("device")
    if device is None:
        return
    problem = memory_fit_problem(memory["peak_gib"], device["memory_gib"], device["gpu"])
    if problem:
        print(f"\033[31mWARNING: {problem}\033[0m", file=sys.stderr)
    elif not device["fits_with_headroom"]:
        print(
            f"note: the estimated peak of {memory['peak_gib']:.1f} GiB leaves less than "
            f"{1 - HEADROOM_FRACTION:.0%} of {device['memory_gib']} GiB free for what the model leaves out",
            file=sys.stderr,
        )


def _own_multirun_dir(cfg: DictConfig) -> None:
    """Under ``-m`` every job gets its own run directory under ``trainer.run_dir`` (the recipe's or
    the command line's), named by its swept overrides: jobs sharing one would resume, refuse or
    overwrite each other. Only a sweep over ``trainer.run_dir`` itself names each job's directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from orthros_train.train.run_dir import multirun_job_dir

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    job = HydraConfig.get()
    overrides = list(job.overrides.task)
    swept = _swept_keys(sys.argv[1:])
    if "trainer.run_dir" in swept:
        return
    named = [o for o in overrides if o.lstrip("+~").split("=")[0] in swept] if swept else overrides
    cfg.trainer.run_dir = multirun_job_dir(cfg.trainer.run_dir, named, job.job.num)


def _swept_keys(argv: list[str]) -> set[str]:
    """Keys the command line sweeps (``optim.lr=1e-3,3e-3``): what tells a multirun's jobs apart."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        return {o.key_or_group for o in OverridesParser.create().parse_overrides(args) if o.is_sweep_override()}
    except HydraException:
        return set()


def _completed(run_cfg: "RunConfig", resolved: dict) -> dict | None:
    """A re-launched run that already reached ``trainer.max_steps``: say so instead of training."""
    from orthros_train.train.run_dir import check_resume, completed_checkpoint

    t = run_cfg.trainer
    latest = completed_checkpoint(t.run_dir, t.max_steps) if t.resume == "auto" else None
    if latest is None:
        return None
    check_resume(latest, resolved, t.resume_changes)  # another model/data is still refused
    final = Path(t.run_dir) / "checkpoints" / "final"
    if launcher_env().rank == 0:
        print(
            f"run {t.run_dir} is complete: its checkpoint {latest.name} reached trainer.max_steps={t.max_steps}; "
            f"final model {final}. To train further raise trainer.max_steps; for a new run pick another "
            "trainer.run_dir",
            flush=True,
        )
    return {"complete": True, "checkpoint": str(final), "eval_loss": None, "history": []}


# launch/*.sh set it to the process count they are about to start: the recipe, the layout and the
# run directory are checked once, in one process, and nothing trains.
PRECHECK_ENV = "ORTHROS_PRECHECK_WORLD_SIZE"


def _precheck(resolved: dict, world_size: int) -> dict:
    """What every rank would refuse at start-up, said once before the launcher starts the ranks
    (a refusal in N ranks ends in the launcher's ChildFailedError traceback around N messages)."""
    from orthros_train.train.run_lock import RunLockedError, held_by_another

    run_cfg = run_config_from_dict(resolved, world_size=world_size)
    holder = held_by_another(run_cfg.trainer.run_dir, os.environ.get("SLURM_JOB_ID"))
    if holder is not None:
        raise RunLockedError(
            f"trainer.run_dir={run_cfg.trainer.run_dir} is in use by another run ({holder.describe()}); wait for it, "
            "stop it, or pick another trainer.run_dir"
        )
    return {"checked": True, "world_size": world_size}


def run(cfg: DictConfig) -> dict:
    """Resolve the recipe into typed config, then dry-run or train."""
    from orthros_train.parallel.setup import destroy_parallel
    from orthros_train.train.plan import plan_summary

    _own_multirun_dir(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    env = launcher_env()
    precheck = os.environ.get(PRECHECK_ENV)
    if precheck:
        return _precheck(resolved, int(precheck))
    # A dry run plans for the recipe's parallel.world_size; a launch follows its own process count.
    dry = bool((resolved.get("trainer") or {}).get("dry_run"))
    run_cfg = run_config_from_dict(resolved, world_size=None if dry else env.world_size)
    record_geometry(resolved, run_cfg)
    if run_cfg.trainer.dry_run:
        summary = plan_summary(run_cfg)
        print(json.dumps(summary, indent=2))
        warn_memory_fit(summary["memory_per_gpu"])
        return summary
    resolved["git_commit"] = git_commit()
    complete = _completed(run_cfg, resolved)
    if complete is not None:
        return complete
    from orthros_train.train.stop_signals import INTERRUPTED_EXIT_CODE
    from orthros_train.train.trainer import Trainer  # megatron-core and DeepSpeed: only a run that trains

    # SLURM_JOB_ID: a requeued job takes its own run-directory lock over (read here, at the entry point).
    trainer = None
    result: dict | None = None
    try:
        try:
            trainer = Trainer(run_cfg, resolved, env, job_id=os.environ.get("SLURM_JOB_ID"))
            if trainer.is_main:  # accepted: this launch's Hydra record joins the run directory
                _publish_hydra_record(run_cfg.trainer.run_dir)
            result = trainer.fit()
            if result.get("signal") == signal.SIGINT:
                # The loop's handlers are gone and the process is on its way out (exit 130): a
                # second Ctrl-C during the teardown exits at once, whatever handler came before
                # (a parent may have left SIGINT ignored, which would swallow it).
                signal.signal(signal.SIGINT, functools.partial(_exit_on_second_ctrl_c, trainer.close))
            if result.get("preempted"):
                return result
            prompt = run_cfg.trainer.sample_prompt
            text = trainer.sample(prompt, run_cfg.trainer.sample_tokens) if prompt and run_cfg.trainer.sample_tokens \
                else None
            if trainer.is_main:
                loss = result["eval_loss"]
                print(f"final eval loss {'n/a' if loss is None else f'{loss:.4f}'}; checkpoint {result['checkpoint']}")
                if text is not None:
                    print(f"sample (greedy, prefill + decode):\n  prompt: {prompt!r}\n  continuation: {text!r}")
        finally:
            if trainer is not None:
                trainer.close()
            destroy_parallel()
    except KeyboardInterrupt:
        if result is None:
            raise  # before training (the loop's own handler saves a run it interrupts)
        # After a finished loop (sampling, teardown): its checkpoint is saved.
        print(f"orthros-train: interrupted (Ctrl-C) after training; checkpoint {result['checkpoint']} is saved",
              file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    return result


def _publish_hydra_record(run_dir: str) -> None:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        publish_launch_record(run_dir, HydraConfig.get().runtime.output_dir)


def _exit_on_second_ctrl_c(release: Callable[[], None], signum: int, frame: object) -> None:
    """Leave at once, releasing the run directory first (as the loop's own second Ctrl-C does)."""
    from orthros_train.train.stop_signals import INTERRUPTED_EXIT_CODE

    # os-level write and exit: a signal handler may interrupt a thread holding a lock.
    os.write(2, b"orthros-train: second Ctrl-C: exiting at once without saving\n")
    release()
    os._exit(INTERRUPTED_EXIT_CODE)


# Recipe folders that hold groups (pieces of a recipe) rather than runs.
GROUP_DIRS = ("model", "data", "optim", "trainer", "parallel", "rl", "distill")


def recipe_list() -> list[tuple[str, str]]:
    """(name, first comment line) of every recipe ``--config-name`` takes."""
    root = Path(RECIPES_DIR)
    out = []
    for path in sorted(root.rglob("*.yaml")):
        name = path.relative_to(root).with_suffix("").as_posix()
        if name.split("/")[0] in GROUP_DIRS or name.endswith("/common"):
            continue
        lines = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#") and "@package" not in ln]
        out.append((name, lines[0] if lines else ""))
    return out


def usage() -> str:
    width = max(len(n) for n, _ in recipe_list())
    rows = "\n".join(f"  {n:<{width}}  {d[:100]}" for n, d in recipe_list())
    return (
        "usage: orthros-train --config-name RECIPE [key=value ...]   (orthros-train -m ... sweeps)\n\n"
        f"recipes (recipes/):\n{rows}\n\n"
        "examples:\n  orthros-train --config-name tiny_cpu\n"
        "  orthros-train --config-name pretrain_1p3b trainer.dry_run=true\n\n"
        "`orthros-train --config-name RECIPE --cfg job` prints a recipe resolved; --hydra-help: Hydra's own options"
    )


def report_error(message: str, rank: int, marker_dir: str | None = None) -> None:
    """Print a run-stopping error once: rank 0 prints it; another rank prints its own only when
    rank 0 did not report the same (every rank usually fails alike, on the same config)."""
    import hashlib
    import tempfile
    import time

    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
    folder = Path(marker_dir or tempfile.gettempdir()) / f"orthros-errors-{run_id}"
    marker = folder / hashlib.sha256(message.encode()).hexdigest()[:16]
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return
    time.sleep(2.0)  # rank 0 fails on the same line at about the same time
    if not marker.exists():
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)


@hydra.main(config_path=RECIPES_DIR, config_name=None, version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    if not cfg or (HydraConfig.initialized() and HydraConfig.get().job.config_name is None):
        raise SystemExit(f"orthros-train: pick a recipe with --config-name\n\n{usage()}")
    from orthros_train.logging_setup import configure_logging
    from orthros_train.train.checkpoint_store import CheckpointError  # no megatron import: a config error is quick
    from orthros_train.train.health import NonFiniteTrainingError
    from orthros_train.train.stop_signals import INTERRUPTED_EXIT_CODE

    rank = launcher_env().rank
    configure_logging(rank)  # rank 0 speaks; warnings and errors still come from every rank
    try:
        result = run(cfg)  # a preempted run (SIGTERM/SIGUSR1) saved and returns normally: exit 0, requeue
    except (UserError, CheckpointError, NonFiniteTrainingError) as exc:
        # what the user asked for is wrong, or a run-stopping fault: one clear line, not a traceback
        report_error(f"orthros-train: {first_line(exc)}", rank)
        raise SystemExit(1) from exc
    # Ctrl-C before training started (the loop itself saves and returns) propagates to main's
    # exit_on_ctrl_c: its os._exit(130) is right also when the Ctrl-C landed inside a C extension's
    # import, where a SystemExit here made the interpreter re-raise SIGINT on itself (status -2).
    except Exception as exc:
        if caused_by_ctrl_c(exc):  # a Ctrl-C a library turned into another exception: main's one line
            raise KeyboardInterrupt from exc
        # Anything else (a ValueError from inside torch included) is a bug: keep its traceback,
        # which a one-line message would hide, and say where to report it.
        report_bug("orthros-train", exc)
        raise SystemExit(1) from exc
    if isinstance(result, dict) and result.get("signal") == signal.SIGINT:
        raise SystemExit(INTERRUPTED_EXIT_CODE)  # Ctrl-C: saved, but the run did not finish


def main() -> None:
    """``orthros-train``: ``--help`` without a recipe lists the recipes; the rest is Hydra's."""
    args = sys.argv[1:]
    named = any(a.startswith(("--config-name", "-cn")) for a in args)
    if any(a in ("-h", "--help") for a in args) and not named:
        print(usage())
        return
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    if overrides and not named:
        # Without a recipe Hydra answers "Key 'trainer' is not in struct", and its `+key` advice
        # then trains the dataclass defaults (a 32000-token model on a 2048-token tokenizer).
        raise SystemExit(
            f"orthros-train: the overrides {overrides[:3]} need a recipe to apply to: add --config-name RECIPE "
            f"(e.g. --config-name tiny_cpu)\n\n{usage()}"
        )
    from orthros_train.common.lifetime import PARENT_ENV, die_with_parent

    die_with_parent(os.environ.get(PARENT_ENV))  # a study's trainer ends with its study (common/lifetime.py)
    with exit_on_ctrl_c("orthros-train", "before training started; nothing was saved"):
        problem = override_typo(_config_name(args), overrides)
        if problem:
            raise SystemExit(f"orthros-train: {problem}")
        hydra_main()


def _config_name(args: list[str]) -> str | None:
    """The recipe named by ``--config-name X``, ``--config-name=X``, ``-cn X`` or ``-cn=X``."""
    for i, arg in enumerate(args):
        for flag in ("--config-name", "-cn"):
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def _keys(tree: object, prefix: str = "") -> list[str]:
    """Every dotted key of a recipe (``trainer.max_steps``, ``trainer.wandb.mode``)."""
    if not isinstance(tree, dict):
        return []
    out = []
    for key, value in tree.items():
        full = f"{prefix}{key}"
        out += [full, *_keys(value, full + ".")]
    return out


def _group_not_in_recipe(config_name: str, parsed: list, exc: Exception) -> str | None:
    """``distill=dense_twin`` on a recipe whose defaults list has no ``distill`` entry (only the
    convert_* recipes have one): Hydra's "No match in the defaults list" names neither the recipe
    nor the preset, so say which and give the ``+`` form that adds it."""
    text = str(exc)
    for o in parsed:
        group = o.key_or_group
        if o.is_add() or o.is_force_add() or "." in group or f"Could not override '{group}'" not in text:
            continue
        return (
            f"{group}={o.value()}: recipe {config_name} has no {group} entry in its defaults list to replace; "
            f"add the preset with +{group}={o.value()}"
        )
    return None


def override_typo(config_name: str | None, overrides: list[str]) -> str | None:
    """A plain ``key=value`` override whose key the recipe does not have (``trainer.max_step``):
    the problem with the nearest keys, instead of Hydra's advice to append it with ``+key``, which
    would set a key nothing reads (and then fails on the typed config anyway)."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not config_name or not overrides:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None  # Hydra reports a malformed override itself
    plain = [o for o in parsed if not (o.is_add() or o.is_force_add() or o.is_delete() or o.is_sweep_override())]
    try:
        with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
            # the recipe with its group choices (data=indexed_blend) but none of the value overrides
            groups = [o.input_line for o in parsed if "." not in o.key_or_group and not o.is_sweep_override()]
            recipe = OmegaConf.to_container(compose(config_name, overrides=groups), resolve=False)
    except Exception as exc:  # noqa: BLE001 - a bad recipe name or group: Hydra's own message says it
        return _group_not_in_recipe(config_name, parsed, exc)
    known = set(_keys(recipe))
    for o in plain:
        key = o.key_or_group
        if "." not in key or key in known or key.startswith("hydra."):
            continue
        section = key.rsplit(".", 1)[0]
        unstated = _unstated_field(key)
        if unstated is not _NO_FIELD:  # read by the typed config, only not written in this recipe
            default = getattr(unstated, "value", unstated)  # an option enum as the recipe spells it
            return (f"{key}={o.value()}: recipe {config_name} does not state {key} (a {section} setting, default "
                    f"{default!r}); set it with +{key}={o.value()}")
        near = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        siblings = sorted(k.rsplit(".", 1)[1] for k in known if k.rsplit(".", 1)[0] == section and "." in k)
        where = f"keys of {section}: {siblings}" if siblings else f"the recipe has no section {section}"
        return (
            f"{key}={o.value()} is not a key of recipe {config_name}: {hint}({where}). "
            f"A key nothing reads is refused; to add a new one on purpose use +{key}=..."
        )
    return None


_NO_FIELD = object()


def _unstated_field(key: str) -> object:
    """The default of ``section.field`` where it is a field of that section's dataclass (a setting
    the typed config reads though the recipe does not write it, e.g. ``model.base_global_tail``),
    else ``_NO_FIELD``. Hydra needs the ``+`` form to add it; "a key nothing reads" would be wrong advice."""
    import dataclasses
    import typing

    from orthros_train.train.config import RunConfig

    section, _, name = key.partition(".")
    hint = typing.get_type_hints(RunConfig).get(section)
    cls = next((c for c in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(c)), None)
    if cls is None or "." in name:
        return _NO_FIELD
    found = next((f for f in dataclasses.fields(cls) if f.name == name and f.init), None)
    if found is None:
        return _NO_FIELD
    if found.default is not dataclasses.MISSING:
        return found.default
    return found.default_factory() if found.default_factory is not dataclasses.MISSING else None


if __name__ == "__main__":
    main()
