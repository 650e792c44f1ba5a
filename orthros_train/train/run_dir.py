"""One directory per run: where a launch writes, and whether a checkpoint may resume into it.

A run directory holds one run. Resuming compares the recipe about to run with the one saved in
the checkpoint (``meta.json``): a different model or data is another run and is refused; a
different optimisation (learning rate, seed, sequence length, tokens per step) is refused unless
``trainer.resume_changes=allow`` says it is intended, and is then logged. Keys that do not change
what is trained (logging, checkpoint cadence, the parallel layout, which resumes reshard) are
ignored, and a longer ``trainer.max_steps`` or another precision are logged only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orthros_train.common.files import fsync_dir, write_atomic
from orthros_train.common.publish import publish_folder
from orthros_train.errors import UserError
from orthros_train.options import ResumeChanges

log = logging.getLogger(__name__)

# What a run *is*: a checkpoint of another model or data belongs to another run.
IDENTITY_SECTIONS = ("model.", "data.")
# Keys that do not change what is trained, or that resuming handles itself (resharding).
IGNORED = re.compile(
    r"^(hydra\.|git_commit$|parallel\.|trainer\.wandb\.|data\.cache_dir$|model\.attention_backend$|model\.fused_tokenwise$|"
    r"trainer\.(run_dir|resume|resume_changes|dry_run|progress|log_every|eval_every|eval_batches|save_every|"
    r"keep_last_k|checkpoint_hashes|async_save|fail_at_step|sample_prompt|sample_tokens|peak_tflops|gpu|"
    r"gpu_memory_gib|allow_memory_overflow|max_nonfinite_steps|loss_spike_factor|total_tokens|device|"
    r"micro_batch_size|grad_accum_steps|global_batch_size|overwrite|deterministic)$)"
)
# Changed freely, logged: extending a run, resuming in another precision (the layout reshards).
NOTED = ("trainer.max_steps", "trainer.precision")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}`` (lists stay values)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def _tokens_per_step(flat: dict[str, Any]) -> int | None:
    # A recipe saved by a launch records the geometry it derived (global batch, accumulation, DP).
    try:
        if flat.get("trainer.global_batch_size") is not None:
            return int(flat["trainer.seq_len"]) * int(flat["trainer.global_batch_size"])
        return (
            int(flat["trainer.seq_len"])
            * int(flat["trainer.micro_batch_size"])
            * int(flat.get("trainer.grad_accum_steps") or 1)
            * int(flat.get("parallel.data_parallel") or 1)
        )
    except (KeyError, TypeError, ValueError):
        return None


def recipe_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list[str]]:
    """Differences between the checkpoint's recipe and this one, by kind: ``identity`` (model,
    data, tokenizer: another run), ``training`` (needs ``resume_changes=allow``), ``noted``."""
    old, new = flatten(saved), flatten(current)
    kinds: dict[str, list[str]] = {"identity": [], "training": [], "noted": []}
    for key in sorted(set(old) | set(new)):
        if IGNORED.match(key) or old.get(key) == new.get(key):
            continue
        line = f"{key}: {old.get(key, '<unset>')!r} in the checkpoint, {new.get(key, '<unset>')!r} now"
        if key.startswith(IDENTITY_SECTIONS):
            kinds["identity"].append(line)
        elif key in NOTED:
            kinds["noted"].append(line)
        else:
            kinds["training"].append(line)
    before, after = _tokens_per_step(old), _tokens_per_step(new)
    if before != after and before is not None and after is not None:
        kinds["training"].append(f"tokens per step: {before} in the checkpoint, {after} now")
    return kinds


def saved_recipe(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved recipe a checkpoint was written with (None for checkpoints without one)."""
    try:
        return json.loads((Path(checkpoint) / "meta.json").read_text()).get("recipe") or None
    except (OSError, ValueError):
        return None


def check_resume(checkpoint: Path, current: dict[str, Any], resume_changes: ResumeChanges | str) -> list[str]:
    """Raise ValueError when ``checkpoint`` belongs to another run; returns the lines to log for
    the changes that are accepted."""
    saved = saved_recipe(checkpoint)
    if not saved or not current:
        return []
    kinds = recipe_changes(saved, current)
    if kinds["identity"]:
        raise UserError(
            f"checkpoint {checkpoint} was written for another model config or data ("
            + "; ".join(kinds["identity"])
            + "): that is another run. Give it its own trainer.run_dir (or trainer.resume=none), and "
            f"model.init_from={Path(checkpoint) / 'model'} to start from these weights"
        )
    old, new = (json.dumps(flatten(r).get("optim.trainable")) for r in (saved, current))  # null, "self_attn"
    if old != new:  # the optimizer state holds the trained weights only: other ones have none to resume
        raise UserError(
            f"resuming {checkpoint} with optim.trainable={new} (the checkpoint trained {old}): its optimizer "
            "state covers only the weights it trained, so no trainer.resume_changes can resume other ones. Set "
            f"optim.trainable={old} back, or start a new run from these weights (another trainer.run_dir, "
            f"model.init_from={Path(checkpoint) / 'model'})"
        )
    if kinds["training"] and resume_changes != ResumeChanges.allow:
        raise UserError(
            f"resuming {checkpoint} with a changed recipe ("
            + "; ".join(kinds["training"])
            + "): pass trainer.resume_changes=allow if the change is intended, or use another trainer.run_dir"
        )
    return [f"resume: {line}" for line in kinds["training"] + kinds["noted"]]


def tokenizer_difference(checkpoint: str | Path, tokenizer: Any) -> str | None:
    """How ``tokenizer`` (the data's, this launch) differs from the one ``checkpoint`` was trained
    with (saved beside its weights), or None when they agree or either is unknown. The same
    ``data.paths`` may have been tokenized again with another tokenizer: the recipe is unchanged,
    but the token ids now mean other words."""
    saved_file = Path(checkpoint) / "model" / "tokenizer.json"
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not saved_file.is_file() or get_vocab is None:
        return None
    try:
        saved = json.loads(saved_file.read_text())
        saved_vocab = dict(saved["model"]["vocab"])
        for added in saved.get("added_tokens") or []:
            saved_vocab[added["content"]] = added["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a BPE/word-level tokenizer.json this reads: no opinion
    now = get_vocab()
    if now == saved_vocab:
        return None
    name = getattr(tokenizer, "name_or_path", "") or "?"
    differing = sorted(k for k in set(now) ^ set(saved_vocab))[:3] or sorted(
        k for k in now if now[k] != saved_vocab.get(k)
    )[:3]
    return (
        f"the checkpoint was trained with the tokenizer saved in {saved_file.parent} ({len(saved_vocab)} tokens), "
        f"the data now comes with tokenizer {name} ({len(now)} tokens; they differ e.g. in {differing})"
    )


def completed_checkpoint(run_dir: str | Path, max_steps: int) -> Path | None:
    """The final export of a run whose latest checkpoint reached ``max_steps``, else None."""
    root = Path(run_dir) / "checkpoints"
    try:
        latest = root / (root / "latest").read_text().strip()
        step = int(json.loads((latest / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None
    return latest if step >= max_steps and complete_export(root / "final") else None


def complete_export(directory: str | Path) -> bool:
    """Whether ``directory`` holds a whole exported model (config.json and its weights), as
    ``publish_directory`` leaves it; an export cut short by an older writer does not count."""
    directory = Path(directory)
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _step_of(checkpoint: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)", checkpoint.name)
    return int(match.group(1)) if match else None


def set_aside_later_branch(run_dir: str | Path, resumed: str | Path) -> Path | None:
    """Rewinding a run (``trainer.resume=`` an earlier checkpoint of this run dir) keeps the branch
    it leaves: the later ``step_*`` checkpoints and ``final/`` move into ``checkpoints/branch-<UTC
    time>/`` (one rename each, nothing copied or deleted), so the rewound run's saves, pruning and
    final export never overwrite them and ``trainer.resume=auto`` continues the rewound run.
    Returns the branch folder, or None when nothing is later (a plain resume, another run's checkpoint)."""
    root = Path(run_dir) / "checkpoints"
    resumed = Path(resumed)
    step = _step_of(resumed)
    if step is None or not root.is_dir() or resumed.resolve().parent != root.resolve():
        return None
    later = sorted(p for p in root.glob("step_*") if p.is_dir() and (_step_of(p) or -1) > step)
    if not later:
        return None
    final = root / "final"
    moving = later + ([final] if final.exists() or final.is_symlink() else [])
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    branch, n = root / f"branch-{stamp}", 2
    while branch.exists():  # two rewinds within a second
        branch, n = root / f"branch-{stamp}-{n}", n + 1
    branch.mkdir()
    for path in moving:
        os.rename(path, branch / path.name)
    fsync_dir(branch)
    fsync_dir(root)
    write_atomic(root / "latest", resumed.name + "\n")
    log.warning(
        "rewound to %s: the later %s moved to %s (kept as they were; move them back into %s to return to that "
        "branch, or delete the folder to free the space)", resumed.name, ", ".join(p.name for p in moving), branch,
        root,
    )
    return branch


def publish_directory(target: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(folder)`` into a private folder beside ``target``, published whole as ``target``
    (``common.publish.publish_folder``: fsynced, swapped in, the previous one deleted only then);
    a crash at any moment leaves the previous complete folder or the new one, never a half-written
    one announced as the model. A symlinked ``target`` is refused. Returns ``target``."""
    publish_folder(target, write)
    return Path(target)


def multirun_job_dir(run_dir: str, overrides: list[str], job_num: int) -> str:
    """A multirun job's own directory under ``run_dir``, named by its overrides (or number):
    ``optim.lr=1e-3`` -> ``optim.lr_0.001``; nothing Hydra's override grammar would need quoted
    (``=``, ``,``) so the directory can be passed back as ``trainer.run_dir``."""
    parts = sorted(o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith("trainer.run_dir="))
    name = "__".join(re.sub(r"[^A-Za-z0-9._\-]", "_", o) for o in parts) or f"job{job_num}"
    if len(name) > 200:  # cut names could collide: the job number keeps them apart
        name = f"{name[:180]}__job{job_num}"
    return str(Path(run_dir) / name)


def existing_run(run_dir: str | Path) -> list[str]:
    """What in ``run_dir`` belongs to a run already there (its checkpoints, its metrics log);
    empty for a new or empty directory."""
    root = Path(run_dir)
    found = []
    checkpoints = root / "checkpoints"
    if checkpoints.is_dir() and any(p.name != "latest" and not p.name.startswith(".") for p in checkpoints.iterdir()):
        found.append(str(checkpoints))
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(str(metrics))
    return found


def check_fresh_start(run_dir: str | Path, resume: str, overwrite: bool) -> list[str]:
    """Whether a run that does not resume from this directory's own checkpoints may start in it.

    ``trainer.resume=none`` (or a checkpoint outside ``run_dir``) in a directory holding another
    run would overwrite ``final/``, repoint ``latest`` and prune that run's checkpoints: refused
    unless ``trainer.overwrite=true``, which returns the paths to delete first."""
    if resume == "auto":
        return []
    root = Path(run_dir).resolve()
    if resume != "none" and Path(resume).resolve().is_relative_to(root):
        return []  # resuming one of this run's own checkpoints
    found = existing_run(run_dir)
    if found and not overwrite:
        start = (
            "trainer.resume=none starts afresh"
            if resume == "none"
            else f"trainer.resume={resume} starts from another run's checkpoint"
        )
        raise UserError(
            f"trainer.run_dir={run_dir} already holds a run ({', '.join(found)}) and {start}, which would "
            "overwrite it: pick another trainer.run_dir, resume it (trainer.resume=auto), or pass "
            "trainer.overwrite=true to delete that run first"
        )
    return found
