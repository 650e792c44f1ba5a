"""The on-disk side of checkpoints: atomic writes, manifests, the ``latest`` pointer, pruning, and
safetensors shards written tensor by tensor within a bounded host-memory budget.

Nothing here knows about models, optimizers or DeepSpeed: a checkpoint is a directory of files,
written into a hidden temporary directory and published by ``common.publish.swap_into_place``
(fsynced, then one atomic rename; a re-save of a step swaps the old folder out only once the new one
is in place), after which ``latest`` is replaced atomically. A crash or a full disk at any point leaves the previous
checkpoint and pointer as they were; ``find_latest`` skips (with a warning naming it) anything
whose manifest does not verify.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from orthros_train.common.files import sha256_file, write_atomic
from orthros_train.common.publish import recover, swap_into_place
from orthros_train.common.safetensors_io import ShardedSafetensorsWriter, tensor_bytes

log = logging.getLogger("orthros_train.checkpoint")

LATEST = "latest"
PREFIX = "step_"
MANIFEST = "manifest.json"
LEFTOVER = re.compile(rf"\.({PREFIX}\d+)\.")  # hidden siblings of a step folder (saves, swaps)


class CheckpointError(RuntimeError):
    """A save failed on some rank (the previous checkpoint and ``latest`` are untouched), or a
    checkpoint cannot be loaded."""


def build_manifest(root: Path, with_hashes: bool, known: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``relative path -> {size[, sha256]}`` of every file under ``root`` but the manifest;
    ``known`` (absolute path -> sha256) are hashes taken by the ranks that wrote the files."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        entry: dict[str, Any] = {"size": path.stat().st_size}
        if with_hashes:
            entry["sha256"] = (known or {}).get(str(path)) or sha256_file(path)
        files[str(path.relative_to(root))] = entry
    return files


def verify_checkpoint(path: Path) -> str | None:
    """None when ``path`` is a complete, intact checkpoint; else what is wrong with it."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable {MANIFEST} ({exc})"
    for name, entry in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"missing file {name}"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['size']}"
        if "sha256" in entry and sha256_file(file) != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


class CheckpointStore:
    """``<run_dir>/checkpoints``: published ``step_*`` directories, ``latest``, temporary saves."""

    def __init__(self, run_dir: str | Path, keep_last_k: int = 3, verify_hashes: bool = True) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last_k = keep_last_k
        self.verify_hashes = verify_hashes

    @staticmethod
    def name(step: int) -> str:
        return f"{PREFIX}{step:09d}"

    def temporary(self, step: int, unique: str) -> Path:
        """Where a save of ``step`` is written before it is published (ignored by resume)."""
        return self.root / f".{self.name(step)}.tmp-{unique}"

    def complete_checkpoints(self) -> list[Path]:
        """Published checkpoint directories, newest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob(f"{PREFIX}*") if p.is_dir()), reverse=True)

    def find_latest(self) -> Path | None:
        """Newest checkpoint that verifies; corrupt or partial ones are skipped with a warning.

        ``latest`` is not consulted: a save killed between its rename and the pointer update
        leaves a published, verified checkpoint newer than ``latest``, and that one is resumed."""
        for path in self.complete_checkpoints():
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def publish(self, tmp: Path, step: int, known_hashes: Mapping[str, str] | None = None) -> Path:
        """Write the manifest into ``tmp``, rename it to ``step_N`` and point ``latest`` at it.
        Raises OSError with nothing published when any part fails. ``known_hashes``: see
        ``build_manifest``."""
        final = self.root / self.name(step)
        manifest = {"step": step, "files": build_manifest(tmp, self.verify_hashes, known_hashes)}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
        # fsynced and swapped in whole; a re-save of the same step replaces the old one only then
        swap_into_place(tmp, final)
        write_atomic(self.root / LATEST, final.name + "\n")
        return final

    def prune(self) -> None:
        """Keep the newest ``keep_last_k`` checkpoints (0: all); remove leftovers of crashed saves."""
        if self.keep_last_k > 0:
            for old in self.complete_checkpoints()[self.keep_last_k :]:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f".{PREFIX}*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for step_name in {m.group(1) for p in self.root.glob(f".{PREFIX}*") if (m := LEFTOVER.match(p.name))}:
            recover(self.root / step_name)  # a re-save of a step killed mid-swap (common/publish.py)


# -- tensors to safetensors shards, within a host-memory budget ----------------------------------------


class HostBudget:
    """Bytes of host memory a save may hold at once. ``acquire`` blocks until the bytes are free
    (the writer releases them once their shard is on disk); ``peak`` is the most ever held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.total = 0  # bytes that went through the budget (every host copy a save makes)
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        if nbytes > self.limit:
            raise ValueError(f"a {nbytes}-byte tensor does not fit a host budget of {self.limit} bytes")
        with self._cond:
            self._cond.wait_for(lambda: self.held + nbytes <= self.limit)
            self.held += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()


class ShardedTensorWriter(ShardedSafetensorsWriter):
    """Tensors arriving one at a time, grouped into safetensors files of about ``shard_bytes``
    (``ShardedSafetensorsWriter``), written by every rank of a save together.

    Every rank sees the same sequence of tensors (they come out of collective gathers), so every
    rank computes the same files; file ``i`` is written by rank ``(i - 1 + first_owner) % world``
    only, which spreads the writing over all ranks and lets the others drop the tensor at once. A
    tensor this rank keeps is copied to host memory under ``budget`` (``add`` blocks while the
    budget is spent) and handed to ``sink``, which writes closed files in order; the bytes are
    released when their file is written. File boundaries depend on tensor sizes only, so a sync and an async save write
    identical files.

    Files are ``<stem>-00001.safetensors`` ...; ``finish`` adds ``index_name`` with the weight map
    (rank 0). ``first_owner`` shifts which rank writes file 1, so that two writers in a row
    (weights, then optimizer state) start on different ranks. With ``single_name`` (the Hugging
    Face layout), a save that fits one file names it so instead and writes no index.
    """

    def __init__(
        self,
        directory: Path,
        stem: str,
        shard_bytes: int,
        rank: int,
        world: int,
        budget: HostBudget,
        sink: FileSink,
        index_name: str,
        single_name: str | None = None,
        metadata: dict[str, str] | None = None,
        first_owner: int = 0,
    ) -> None:
        super().__init__(
            directory, shard_bytes, stem=stem, of_total=False, single_name=single_name, index_name=index_name,
            metadata=metadata,
        )  # fmt: skip
        self.rank, self.world, self.budget, self.sink = rank, world, budget, sink
        self.first_owner = first_owner

    def writes_shard(self, shard: int) -> bool:
        return (shard - 1 + self.first_owner) % self.world == self.rank

    def keep(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.budget.acquire(tensor_bytes(tensor))
        # copy=True: the source may be live state (stage 0's moments) the next step changes.
        return tensor.detach().to("cpu", copy=True).contiguous()

    def submit(self, write: Callable[[], None], release: int = 0, path: Path | None = None) -> None:
        self.sink.put(write, release=release, hash_path=path)

    def rename(self, source: Path, target: Path) -> None:
        self.sink.rename(source, target)

    def writes_index(self) -> bool:
        return self.rank == 0


class FileSink:
    """Runs file writes in order in a thread of its own, so that writing overlaps the gathers.
    The first failure is kept, later writes are skipped (their bytes still released) and
    ``close`` returns it as a message: the producer never sees an exception mid-gather, since the
    gathers around it are collective and must go on on every rank.

    With ``hash_files`` the sha256 of each large file is taken right after it is written, by the
    rank that wrote it (``hashes``), so the manifest does not have rank 0 read every file back.
    """

    def __init__(self, budget: HostBudget, rank: int, hash_files: bool = False) -> None:
        self.budget, self.rank, self.hash_files = budget, rank, hash_files
        self.error: str | None = None
        self.hashes: dict[str, str] = {}  # absolute path -> sha256
        self._queue: queue.Queue[tuple[Callable[[], None], int, Path | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._drain, name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def put(self, write: Callable[[], None], release: int = 0, hash_path: Path | None = None) -> None:
        """Queue ``write``; ``release`` bytes go back to the budget once it has run; ``hash_path``
        is the file it writes, to hash."""
        self._queue.put((write, release, hash_path))

    def rename(self, source: Path, target: Path) -> None:
        """Rename a file this sink wrote (its hash follows it)."""
        os.replace(source, target)
        if str(source) in self.hashes:
            self.hashes[str(target)] = self.hashes.pop(str(source))

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            write, release, hash_path = item
            try:
                if self.error is None:
                    write()
                    if hash_path is not None and self.hash_files:
                        self.hashes[str(hash_path)] = sha256_file(hash_path)
            except Exception as exc:  # noqa: BLE001 - any failure must reach the publish vote, not kill it
                self.error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            finally:
                if release:
                    self.budget.release(release)

    def close(self) -> str | None:
        """Wait for every queued write; the first error, or None."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        return self.error
