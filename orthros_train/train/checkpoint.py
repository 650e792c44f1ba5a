"""Checkpoints that survive preemption, crashes during save, and changes of parallel layout.

Layout of ``<run_dir>/checkpoints``::

    step_000001200/
        engine/       DeepSpeed engine state of every rank (model shards, ZeRO optimizer
                      partitions): exact resume when the parallel layout is unchanged
        model/        the weights in reference layout (``OrthrosForCausalLM.from_pretrained``
                      loads it; any TP/DP layout reshards from it) + tokenizer
        rank_00000.pt RNG states (python, numpy, torch, CUDA) and data-sampler state of each rank
        meta.json     step, parallel layout, wandb run id, resolved recipe
        manifest.json size and sha256 of every file above (written last)
    latest            name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and published by one atomic rename,
then ``latest`` is replaced atomically; a crash or a full disk at any point leaves the previous
checkpoint and pointer as they were. ``resume=auto`` verifies manifests and skips (with a
warning naming it) any checkpoint that is incomplete or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("orthros_train.checkpoint")

LATEST = "latest"
PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write a small file so readers see the old or the new content, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(root: Path, with_hashes: bool) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"):
        entry: dict[str, Any] = {"size": path.stat().st_size}
        if with_hashes:
            entry["sha256"] = sha256_file(path)
        files[str(path.relative_to(root))] = entry
    return files


def verify_checkpoint(path: Path) -> str | None:
    """None when ``path`` is a complete, intact checkpoint; else what is wrong with it."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest.json ({exc})"
    for name, entry in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"missing file {name}"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and sha256_file(file) != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointError(RuntimeError):
    """A save failed on some rank; the previous checkpoint and ``latest`` are untouched."""


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last_k: int = 3, verify_hashes: bool = True) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last_k = keep_last_k
        self.verify_hashes = verify_hashes

    # -- discovery ---------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob(f"{PREFIX}*") if p.is_dir()), reverse=True)

    def find_latest(self) -> Path | None:
        """Newest checkpoint that verifies; corrupt or partial ones are skipped with a warning."""
        candidates = self.complete_checkpoints()
        pointer = self.root / LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if named in candidates:  # prefer what `latest` names, then anything newer or older
                candidates.remove(named)
                candidates.insert(0, named)
        for path in sorted(candidates, reverse=True):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    # -- save --------------------------------------------------------------------------------
    def save(self, trainer: Any, step: int) -> Path:
        """Collective: every rank calls it. Raises CheckpointError (on every rank) on failure."""
        rank, world = dist.get_rank(), dist.get_world_size()
        name = f"{PREFIX}{step:09d}"
        final = self.root / name
        holder = [None]
        if rank == 0:
            holder[0] = str(self.root / f".{name}.tmp-{int(time.time() * 1e6)}")
        dist.broadcast_object_list(holder, src=0)
        tmp = Path(holder[0])
        error: str | None = None
        try:
            if rank == 0:
                tmp.mkdir(parents=True, exist_ok=False)
            dist.barrier()
            trainer.engine.save_checkpoint(str(tmp / "engine"), tag="state", save_latest=False)
            torch.save({"rng": rng_state(), "data": trainer.data.state_dict()}, tmp / f"rank_{rank:05d}.pt")
        except (OSError, RuntimeError) as exc:
            error = f"rank {rank}: {exc}"
        # Reference-layout weights (collective gather), written by rank 0.
        weights = trainer.reference_model()
        if rank == 0 and error is None:
            try:
                weights.save_pretrained(tmp / "model")
                trainer.data.tokenizer.save_pretrained(tmp / "model")
                meta = {
                    "step": step,
                    "time": time.time(),
                    "world_size": world,
                    "layout": trainer.layout_signature(),
                    "wandb_run_id": trainer.wandb_run_id,
                    "skipped_steps": trainer.skipped_steps,
                    "recipe": trainer.recipe,
                }
                (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
            except (OSError, RuntimeError) as exc:
                error = f"rank 0: {exc}"
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error)
        failures = [e for e in errors if e]
        if not failures and rank == 0:
            try:
                manifest = {"step": step, "files": build_manifest(tmp, self.verify_hashes)}
                write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1))
                if final.exists():  # a re-save of the same step: replace it whole
                    shutil.rmtree(final)
                os.rename(tmp, final)
                _fsync_dir(self.root)
                write_atomic(self.root / LATEST, name + "\n")
            except OSError as exc:
                failures = [f"rank 0 publishing: {exc}"]
        outcome: list[list[str]] = [failures]
        dist.broadcast_object_list(outcome, src=0)
        failures = outcome[0]
        if failures:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint at step {step} was not saved ({'; '.join(failures)}); the previous checkpoint "
                f"and {self.root / LATEST} are unchanged"
            )
        if rank == 0:
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last_k <= 0:
            return
        for old in self.complete_checkpoints()[self.keep_last_k :]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f".{PREFIX}*.tmp-*"):  # leftovers of crashed saves
            shutil.rmtree(stale, ignore_errors=True)

    # -- load --------------------------------------------------------------------------------
    def load(self, trainer: Any, path: Path) -> dict[str, Any]:
        """Restore ``trainer`` from ``path``; returns the checkpoint's meta."""
        meta = json.loads((path / "meta.json").read_text())
        rank = dist.get_rank()
        same_layout = meta["layout"] == trainer.layout_signature()
        if same_layout:
            load_path, _ = trainer.engine.load_checkpoint(
                str(path / "engine"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
            )
            if load_path is None:
                raise CheckpointError(f"DeepSpeed could not load {path / 'engine'}")
            extra = torch.load(path / f"rank_{rank:05d}.pt", weights_only=False)
            set_rng_state(extra["rng"])
            trainer.data.load_state_dict(extra["data"])
        else:
            # Another TP/DP layout: weights reshard from the reference copy; optimizer moments
            # are partitioned by the old layout and start again (said loudly).
            if rank == 0:
                log.warning(
                    "checkpoint %s was written with layout %s, this run uses %s: loading the weights "
                    "(resharded) and the data position; optimizer states start fresh",
                    path,
                    meta["layout"],
                    trainer.layout_signature(),
                )
            trainer.load_reference_weights(path / "model")
            extra = torch.load(path / "rank_00000.pt", weights_only=False)
            data_state = dict(extra["data"])
            trainer.data.load_state_dict(data_state)
        return meta
