"""Checkpoints that survive preemption, crashes during save, and changes of parallel layout.

Layout of ``<run_dir>/checkpoints``::

    step_000001200/
        engine/       DeepSpeed engine state of every rank (model shards, ZeRO optimizer
                      partitions): exact resume when the parallel layout is unchanged
        model/        the weights in reference layout (``OrthrosForCausalLM.from_pretrained``
                      loads it; any TP/DP layout reshards from it) + tokenizer
        optimizer/    Adam moments (and fp32 master weights under bf16) in reference layout:
                      ``<param>.exp_avg`` / ``<param>.exp_avg_sq`` [/ ``<param>.master``] fp32
                      safetensors shards + index.json (step): a resume with another TP/DP layout
                      or ZeRO stage reshards them, so the optimizer does not restart
        rank_00000.pt RNG states (python, numpy, torch, CUDA) and data-sampler state of each rank
        meta.json     step, parallel layout, wandb run id, resolved recipe
        manifest.json size and sha256 of every file above (written last)
    latest            name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and published by one atomic rename,
then ``latest`` is replaced atomically; a crash or a full disk at any point leaves the previous
checkpoint and pointer as they were. ``resume=auto`` verifies manifests and skips (with a
warning naming it) any checkpoint that is incomplete or corrupt.

Why our own reference-layout optimizer files rather than torch DCP or megatron
``dist_checkpointing``: the optimizer state lives inside DeepSpeed's ZeRO flat partitions, which
neither knows how to address; DeepSpeed's fragment API (``safe_get/set_full_optimizer_state``)
does, for stage 0 (bf16), 1, 2 and 3 alike, and the TP (un)sharding is the same map the weights
already use (``parallel/state_dict.py``). The result is readable with plain safetensors.

``trainer.async_save``: the state is copied to host memory on the step (collectives and device
copies happen there), then files are written, hashed, renamed and ``latest`` published by a
background thread while training goes on. One save is in flight at most: the next save, the end
of ``fit`` and a preemption wait for it. A failure in the background is printed and the
checkpoint is not published, exactly as for a synchronous save. See docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from orthros_train.parallel.state_dict import LazyCheckpoint, gather_reference_tensor, shard_tensor

log = logging.getLogger("orthros_train.checkpoint")

LATEST = "latest"
PREFIX = "step_"
OPTIMIZER_DIR = "optimizer"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MASTER_KEY = "master"  # fp32 master weights, saved when the model's weights are not fp32
OPTIMIZER_SHARD_BYTES = 2 << 30  # ~2 GiB safetensors files: an 8B model's moments are ~32 files


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


# -- optimizer state in reference layout -------------------------------------------------------------


def _trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer: ZeRO and bf16 wrappers hold it as ``.optimizer``; stage 0 fp32 is bare."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _fragmented(param: torch.Tensor) -> bool:
    """True when DeepSpeed keeps this parameter's fp32 copy and moments in flat partitions
    (ZeRO 1/2 and bf16: ``_hp_mapping``; ZeRO-3: ``ds_id``)."""
    return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")


def _link_fragments(engine: Any) -> None:
    """(Re)point every ZeRO-1/2 / bf16 parameter's fragment at the optimizer's current moments.

    DeepSpeed 0.19.8 links them once, right after stepping the *first* param group, so the
    fragments of later groups (our no-decay group) stay empty and ``safe_get_full_optimizer_state``
    raises for them; linking again after all groups have state is idempotent.
    """
    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _optimizer_step(engine: Any) -> int:
    steps = [float(st["step"]) for st in _base_optimizer(engine).state.values() if "step" in st]
    step = torch.tensor([max(steps) if steps else 0.0], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank whose partition is empty has no state
    return int(step.item())


def _unfused_master(engine: Any, param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor the torch optimizer updates for a non-fragmented ``param``: itself (stage 0
    fp32) or, under stage 0 bf16 (DeepSpeed's FP16_UnfusedOptimizer), its fp32 copy, which the
    fragment API does not reach."""
    optimizer = engine.optimizer
    lp_groups, hp_groups = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if lp_groups is not None and hp_groups is not None:
        for lp_group, hp_group in zip(lp_groups, hp_groups):
            for lp, hp in zip(lp_group, hp_group):
                if lp is param:
                    return hp
    return param


def _full_dp_value(engine: Any, param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """This TP rank's full (not DP-partitioned) fp32 ``key`` of ``param``; collective over DP
    for ZeRO/bf16 parameters."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _fragmented(param):
        if key == MASTER_KEY:
            return safe_get_full_fp32_param(param)
        return safe_get_full_optimizer_state(param, key)
    master = _unfused_master(engine, param)
    if key == MASTER_KEY:
        return master.detach().float()
    state = _base_optimizer(engine).state.get(master, {})
    return state[key].detach() if key in state else torch.zeros_like(master, dtype=torch.float32)


class _ShardWriter:
    """Rank 0's writer of ``optimizer/``: tensors arrive one at a time and are grouped into
    safetensors files of about ``shard_bytes``, each written as soon as it fills (``defer=False``)
    or kept in host memory for a background write (``defer=True``). A write error is kept, later
    tensors are dropped (the gathers go on: they are collective) and ``finish`` raises it."""

    def __init__(self, directory: Path, shard_bytes: int, defer: bool) -> None:
        self.directory, self.shard_bytes, self.defer = directory, shard_bytes, defer
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.pending: list[tuple[str, dict[str, torch.Tensor]]] = []
        self.weight_map: dict[str, str] = {}
        self.files = 0
        self.error: Exception | None = None

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        # copy=True: under stage 0 this is the live moment, which the next step changes in place.
        self.current[key] = tensor.detach().to("cpu", torch.float32, copy=True).contiguous()
        self.current_bytes += self.current[key].numel() * 4
        if self.current_bytes >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self) -> None:
        if not self.current:
            return
        self.files += 1
        name = f"optimizer-{self.files:05d}.safetensors"
        self.weight_map.update(dict.fromkeys(self.current, name))
        shard, self.current, self.current_bytes = self.current, {}, 0
        if self.defer:
            self.pending.append((name, shard))
        else:
            self._write(name, shard)

    def _write(self, name: str, shard: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            save_file(shard, str(self.directory / name))
        except (OSError, RuntimeError) as exc:
            self.error = exc

    def finish(self, index: dict[str, Any]) -> None:
        """Write what is left and ``index.json``; raises the first write error."""
        self._close_shard()
        while self.pending and self.error is None:
            self._write(*self.pending.pop(0))
        if self.error is not None:
            raise self.error
        self.directory.mkdir(parents=True, exist_ok=True)
        index = {**index, "weight_map": self.weight_map}
        (self.directory / "index.json").write_text(json.dumps(index, indent=1))


def gather_reference_optimizer(trainer: Any, writer: _ShardWriter | None) -> dict[str, Any]:
    """Collective (every rank): stream the optimizer state, parameter by parameter, into
    ``writer`` (rank 0; None elsewhere) in reference layout. Returns the index (step, keys).

    Memory per rank: one parameter's full fp32 moment at a time (plus its TP parts); rank 0's
    writer adds one shard (``OPTIMIZER_SHARD_BYTES``), or everything with ``defer`` (async).
    """
    engine, cfg = trainer.engine, trainer.cfg.model
    params = _trainable(engine.module)
    step = _optimizer_step(engine)
    keys = list(ADAM_KEYS)
    if any(p.dtype != torch.float32 for _, p in params):
        keys.append(MASTER_KEY)  # bf16 weights: the fp32 masters are not in model/
    if step > 0:  # before the first step there are no moments
        _link_fragments(engine)
        for name, p in params:
            for key in keys:
                for ref, value in gather_reference_tensor(name, _full_dp_value(engine, p, key), cfg).items():
                    if writer is not None:
                        writer.add(f"{ref}.{key}", value)
    return {"format": 1, "step": step, "keys": keys}


class _Suffixed(Mapping[str, torch.Tensor]):
    """``name -> tensor`` view of the ``<name>.<key>`` entries of a reference-layout file set."""

    def __init__(self, lazy: LazyCheckpoint, key: str) -> None:
        self.lazy, self.suffix = lazy, "." + key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.lazy[name + self.suffix]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name + self.suffix) in self.lazy

    def __iter__(self) -> Iterator[str]:
        return (k[: -len(self.suffix)] for k in self.lazy if k.endswith(self.suffix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _materialize_adam_state(engine: Any, step: int) -> None:
    """Give every parameter of a fresh torch Adam(W) the state its first step would create, so
    DeepSpeed's fragment setters have tensors to write into; ``step`` counts the steps taken."""
    optimizer = _base_optimizer(engine)
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flat is not None:  # ZeRO-3 puts its flat fp32 partitions into param_groups only while stepping
        owners = [(optimizer.param_groups[engine.optimizer.sub_group_to_group_id[i]], [t]) for i, t in enumerate(flat)]
    else:
        owners = [(group, group["params"]) for group in optimizer.param_groups]
    for group, tensors in owners:
        on_device = group.get("fused") or group.get("capturable")
        for p in tensors:
            state = optimizer.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu")


def load_reference_optimizer(trainer: Any, directory: Path) -> int:
    """Collective: reshard the reference-layout optimizer state of ``directory`` into this run's
    TP/DP/ZeRO layout. Returns the optimizer step. Read tensor by tensor: memory per rank is one
    full reference tensor and this rank's slice of it at a time."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from megatron.core import parallel_state

    index_path = directory / "index.json"
    if not index_path.is_file():
        raise CheckpointError(
            f"{index_path} is missing: the optimizer state of this checkpoint is incomplete. Resume with the "
            "parallel layout it was written with, or restart the optimizer with model.init_from=<checkpoint>/model"
        )
    index = json.loads(index_path.read_text())
    step = int(index["step"])
    if step == 0:
        return 0
    missing_files = sorted({f for f in index["weight_map"].values() if not (directory / f).is_file()})
    if missing_files:
        raise CheckpointError(f"{directory} lacks optimizer shard(s) {missing_files} named by index.json")
    engine, cfg = trainer.engine, trainer.cfg.model
    params = dict(_trainable(engine.module))
    base = _base_optimizer(engine)
    _materialize_adam_state(engine, step)
    _link_fragments(engine)
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    lazy = LazyCheckpoint(directory)
    with torch.no_grad():
        for name, p in params.items():
            for key in index["keys"]:
                try:
                    value = shard_tensor(name, _Suffixed(lazy, key), cfg, tp, tp_rank)
                except KeyError as exc:
                    raise CheckpointError(
                        f"{directory}: {exc} (wanted for {name}.{key}): the optimizer state does not belong to "
                        "this model config (resume with the config it was written with)"
                    ) from exc
                shape = tuple(getattr(p, "ds_shape", p.shape))
                if value is None or tuple(value.shape) != shape:
                    raise CheckpointError(
                        f"{directory}: {name}.{key} resharded to {None if value is None else tuple(value.shape)} but "
                        f"the parameter is {shape}: the optimizer state was written for another model config"
                    )
                value = value.to(device=p.device, dtype=torch.float32)
                if _fragmented(p):
                    if key == MASTER_KEY:
                        safe_set_full_fp32_param(p, value)
                    else:
                        safe_set_full_optimizer_state(p, value, key)
                else:
                    master = _unfused_master(engine, p)
                    if key != MASTER_KEY:
                        base.state[master][key].copy_(value)
                    elif master is not p:  # stage 0 bf16: the fp32 copy (stage 0 fp32 has none)
                        master.copy_(value)
    return step


# -- async save: host-memory snapshot -----------------------------------------------------------------


def _to_host(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors live in host memory and share nothing with the live state."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to_host(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj  # config objects, sizes, numbers: not changed by training


class _CapturingCheckpointEngine:
    """Stands in for DeepSpeed's checkpoint engine during ``save_checkpoint``: DeepSpeed builds its
    state dicts and runs its barriers as usual, but ``save`` keeps host copies, which the
    background thread then writes with the real engine (same serialisation as a sync save)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.captured: list[tuple[dict[str, Any], str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def save(self, state_dict: dict[str, Any], path: str) -> None:
        self.captured.append((_to_host(state_dict), path))

    def write(self) -> None:
        while self.captured:
            state, path = self.captured.pop(0)
            self.real.save(state, path)


def _run_writes(writes: list[Callable[[], None]], rank: int) -> str | None:
    try:
        for write in writes:
            write()
    except Exception as exc:  # noqa: BLE001 - any failure must reach the publish vote, not kill it
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return None


class CheckpointManager:
    def __init__(
        self, run_dir: str | Path, keep_last_k: int = 3, verify_hashes: bool = True, async_save: bool = False
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last_k = keep_last_k
        self.verify_hashes = verify_hashes
        self.async_save = async_save
        self.optimizer_shard_bytes = OPTIMIZER_SHARD_BYTES
        self._thread: threading.Thread | None = None
        self._async_error: str | None = None
        self._group: Any = None  # a gloo group of its own: the background thread's collectives

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
    def save(self, trainer: Any, step: int, asynchronous: bool | None = None) -> Path:
        """Collective: every rank calls it. Raises CheckpointError (on every rank) on failure.

        ``asynchronous`` (default: the manager's ``async_save``): return once the state is in host
        memory; the path returned is where the checkpoint will appear once the background write
        publishes it (``wait`` blocks until then).
        """
        asynchronous = self.async_save if asynchronous is None else asynchronous
        self.wait()  # at most one save in flight; its failure was reported when it happened
        rank = dist.get_rank()
        name = f"{PREFIX}{step:09d}"
        holder = [None]
        if rank == 0:
            holder[0] = str(self.root / f".{name}.tmp-{int(time.time() * 1e6)}")
        dist.broadcast_object_list(holder, src=0)
        tmp = Path(holder[0])
        writes: list[Callable[[], None]] = []  # run here (sync) or by the background thread
        error: str | None = None
        try:
            if rank == 0:
                tmp.mkdir(parents=True, exist_ok=False)
            dist.barrier()
            if asynchronous:
                capture = _CapturingCheckpointEngine(trainer.engine.checkpoint_engine)
                trainer.engine.checkpoint_engine = capture
                try:
                    trainer.engine.save_checkpoint(str(tmp / "engine"), tag="state", save_latest=False)
                finally:
                    trainer.engine.checkpoint_engine = capture.real
                writes.append(capture.write)
            else:
                trainer.engine.save_checkpoint(str(tmp / "engine"), tag="state", save_latest=False)
            rank_state = {"rng": rng_state(), "data": trainer.data.state_dict()}
            writes.append(lambda: torch.save(rank_state, tmp / f"rank_{rank:05d}.pt"))
            if not asynchronous:
                error = _run_writes(writes, rank)
                writes = []
        except (OSError, RuntimeError) as exc:
            error = f"rank {rank}: {exc}"
        # Reference-layout weights and optimizer state (collective gathers), written by rank 0.
        state = trainer.full_state_dict()  # collective; only rank 0 builds the model it writes
        writer = _ShardWriter(tmp / OPTIMIZER_DIR, self.optimizer_shard_bytes, asynchronous) if rank == 0 else None
        index = gather_reference_optimizer(trainer, writer)
        if writer is not None:
            weights = trainer.reference_model(state)
            meta = {
                "step": step,
                "time": time.time(),
                "world_size": dist.get_world_size(),
                "layout": trainer.layout_signature(),
                "optimizer_step": index["step"],
                "wandb_run_id": trainer.wandb_run_id,
                "skipped_steps": trainer.skipped_steps,
                "recipe": trainer.recipe,
            }
            tokenizer = trainer.data.tokenizer
            writes += [
                lambda: weights.save_pretrained(tmp / "model"),
                lambda: tokenizer.save_pretrained(tmp / "model"),
                lambda: writer.finish(index),
                lambda: (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str)),
            ]
        if not asynchronous:
            error = error or _run_writes(writes, rank)
            self._publish(tmp, name, step, error, group=None)
            return self.root / name
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank is here
        self._async_error = None
        self._thread = threading.Thread(
            target=self._write_in_background, args=(writes, tmp, name, step, error), name=f"save-{name}"
        )
        self._thread.start()
        return self.root / name

    def _write_in_background(
        self, writes: list[Callable[[], None]], tmp: Path, name: str, step: int, error: str | None
    ) -> None:
        start = time.perf_counter()
        error = error or _run_writes(writes, dist.get_rank())
        try:
            self._publish(tmp, name, step, error, group=self._group)
        except CheckpointError as exc:
            self._async_error = str(exc)
            log.error("async %s", exc)
            if dist.get_rank() == 0:
                print(f"ERROR: async save: {exc}", file=sys.stderr, flush=True)
            return
        log.info("async checkpoint %s published after %.2fs in the background", name, time.perf_counter() - start)

    def wait(self) -> str | None:
        """Block until the background save (if any) is published or has failed; returns its error
        message (already printed) or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._async_error

    def _publish(self, tmp: Path, name: str, step: int, error: str | None, group: Any) -> None:
        """Collective over ``group``: agree that every rank's files are written, then rank 0
        writes the manifest, renames, points ``latest`` at it and prunes."""
        rank, world = dist.get_rank(), dist.get_world_size()
        final = self.root / name
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error, group=group)
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
        dist.broadcast_object_list(outcome, src=0, group=group)
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
        dist.barrier(group=group)

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
        saved = {"precision": "fp32", "cp": 1, **meta["layout"]}  # keys older checkpoints lack
        same_layout = saved == trainer.layout_signature()
        if same_layout:  # bitwise exact: DeepSpeed's own files for this very layout
            load_path, _ = trainer.engine.load_checkpoint(
                str(path / "engine"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False
            )
            if load_path is None:
                raise CheckpointError(f"DeepSpeed could not load {path / 'engine'}")
            extra = torch.load(path / f"rank_{rank:05d}.pt", weights_only=False)
            set_rng_state(extra["rng"])
            trainer.data.load_state_dict(extra["data"])
            return meta
        # Another TP/DP layout or ZeRO stage: weights and optimizer state reshard from the
        # reference-layout copies; the data position is global. RNG streams belong to the old
        # ranks and are not restored.
        trainer.load_reference_weights(path / "model")
        with torch.no_grad():  # stage-0 bf16 keeps fp32 copies that safe_set_full_fp32_param misses
            for _, p in _trainable(trainer.engine.module):
                master = _unfused_master(trainer.engine, p)
                if master is not p and not _fragmented(p):
                    master.copy_(p.float())
        optimizer_dir = path / OPTIMIZER_DIR
        if optimizer_dir.is_dir():
            load_reference_optimizer(trainer, optimizer_dir)
            if rank == 0:
                log.warning(
                    "checkpoint %s was written with layout %s, this run uses %s: weights and optimizer state resharded",
                    path,
                    meta["layout"],
                    trainer.layout_signature(),
                )
        elif rank == 0:  # written before optimizer/ existed
            log.warning(
                "checkpoint %s was written with layout %s, this run uses %s and the checkpoint has no %s/: "
                "loading the weights (resharded) and the data position; optimizer states start fresh",
                path,
                meta["layout"],
                trainer.layout_signature(),
                OPTIMIZER_DIR,
            )
        extra = torch.load(path / "rank_00000.pt", weights_only=False)
        trainer.data.load_state_dict(dict(extra["data"]))
        return meta
