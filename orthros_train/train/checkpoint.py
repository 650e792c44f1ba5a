"""What a checkpoint holds and how a run saves and resumes it.

Layout of ``<run_dir>/checkpoints``::

    step_000001200/
        model/        fp32 master weights in reference layout + config.json + tokenizer
                      (``OrthrosForCausalLM.from_pretrained`` loads it)
        optimizer/    Adam moments in reference layout: ``<param>.exp_avg`` / ``<param>.exp_avg_sq``
                      fp32 safetensors files + index.json (optimizer step)
        rank_00000.pt RNG states (python, numpy, torch, CUDA) and data state of each rank: plain
                      data, read back with ``weights_only`` (``rank_state.py``): nothing in it can run
        meta.json     step, parallel layout, counters, wandb run id, resolved recipe
        manifest.json size and sha256 of every file above (written last)
    latest            name of the newest complete checkpoint

The optimizer state is stored once, in reference layout, and every resume restores from it: with
the same parallel layout the values land bit for bit where they were (and each rank gets its RNG
and data state back), so the run continues bitwise; with another TP/EP/DP layout or ZeRO stage
they are resharded (routed experts by their global names: every rank reads the experts it
holds). DeepSpeed's own checkpoint files are not written: they would be a second
copy of the same state (12-16 bytes per parameter) usable by one layout only.

Why our own reference-layout files rather than torch DCP or megatron ``dist_checkpointing``: the
optimizer state lives inside DeepSpeed's ZeRO flat partitions, which neither knows how to address;
DeepSpeed's fragment API does (``deepspeed_state.py``), and the TP (un)sharding is the map the
weights already use (``parallel/state_dict.py``). The result is readable with plain safetensors.

Saving streams: tensor by tensor, every rank gathers the full reference tensor (collective), the
rank that owns the tensor's file copies it into host memory under a byte budget and a writer
thread writes each file once it is complete and frees its bytes. Host memory per rank is bounded
by ``host_buffer_bytes`` (``max(host_buffer_bytes, 2 x the largest tensor)``); files are spread
over the ranks. ``trainer.async_save``: the step waits only for the gathers (and for the writer
whenever the budget is spent); the rest of the writing, the vote, the manifest and ``latest`` run
in the background. One save is in flight at most. See docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from orthros_train.common.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsFileError, SafetensorsReader
from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.model.config import OrthrosConfig
from orthros_train.parallel import collectives
from orthros_train.parallel.state_dict import gather_reference_tensor, reference_shapes, shard_tensor
from orthros_train.train.checkpoint_store import (
    CheckpointError,
    CheckpointStore,
    FileSink,
    HostBudget,
    ShardedTensorWriter,
    verify_checkpoint,
)
from orthros_train.train.deepspeed_state import ADAM_KEYS, MASTER_KEY, DeepSpeedState, check_deepspeed_version
from orthros_train.train.rank_state import ProcessRNG, load_rank_state

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointState",
    "IncompatibleCheckpointError",
    "TrainingCounters",
    "layout_signature",
    "load_reference_optimizer",
    "load_reference_weights",
    "verify_checkpoint",
]

log = logging.getLogger("orthros_train.checkpoint")

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
OPTIMIZER_FORMAT = 2  # 1: fp32 masters of bf16 runs as ``<param>.master`` here; 2: masters in model/
HOST_BUFFER_BYTES = 4 << 30  # per rank; files of half of it (~2 GiB: an 8B model's moments are ~30 files)


class IncompatibleCheckpointError(CheckpointError, UserError):
    """The checkpoint was written for another model config."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingCounters:
    step: int = 0
    skipped_steps: int = 0
    wandb_run_id: str | None = None


@dataclass
class CheckpointState:
    """Everything a checkpoint saves and restores, handed over by the trainer.

    ``data`` is the position of the run's inputs (sampler, rollout source): saved per rank, and
    restored per rank with the same layout, from rank 0 otherwise (it is global). ``rng``, the
    random streams, is saved per rank and restored only with the same layout (the streams belong
    to the ranks). ``layout`` decides whether a resume is the same layout (``layout_signature``).
    """

    engine: Any  # the DeepSpeed engine: weights and optimizer
    model_config: OrthrosConfig
    data: Stateful
    tokenizer: Any  # saved beside the weights (``save_pretrained``)
    layout: dict[str, Any]
    counters: TrainingCounters
    recipe: dict[str, Any]
    rng: Stateful = field(default_factory=ProcessRNG)
    # A distillation run's teacher (train/distill.py: teacher_identity): never saved, only its
    # path and content hash, which a resume checks.
    teacher: dict[str, Any] | None = None


@dataclass
class Restored:
    counters: TrainingCounters
    meta: dict[str, Any]
    resharded: bool


def layout_signature(parallel: Any, precision: str) -> dict[str, Any]:
    """What must match for a resume to restore RNG streams and per-rank data state."""
    return {
        "tp": parallel.tensor_parallel,
        "sp": parallel.sequence_parallel,
        "cp": parallel.context_parallel,
        "ep": parallel.expert_parallel,
        "dp": parallel.data_parallel,
        "zero": parallel.zero_stage,
        "precision": precision,
    }


# -- save: stream reference-layout tensors ------------------------------------------------------------


def reference_parameters(
    module: torch.nn.Module, cfg: OrthrosConfig, trainable: bool = False
) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter a checkpoint stores, each once and in module order
    (the same on every rank): a tied LM head is the embedding and is stored under its name."""
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if id(p) not in seen and (p.requires_grad or not trainable):
            seen.add(id(p))
            out.append((name, p))
    return out


def host_bound(cfg: OrthrosConfig, host_buffer_bytes: int) -> int:
    """The host-memory budget of one rank's save: ``host_buffer_bytes``, raised to twice the largest
    fp32 reference tensor when that is bigger (a file must hold at least one whole tensor)."""
    largest = max(shape.numel() for shape in reference_shapes(cfg).values()) * 4
    return max(host_buffer_bytes, 2 * largest)


def stream_weights(ds: DeepSpeedState, cfg: OrthrosConfig, writer: ShardedTensorWriter) -> None:
    """Collective: every parameter's fp32 master, unsharded to reference layout, into ``writer``."""
    for name, p in reference_parameters(ds.engine.module, cfg):
        value = ds.get(p, MASTER_KEY) if p.requires_grad else ds.full_weight(p)
        for ref, tensor in gather_reference_tensor(name, value, cfg).items():
            writer.add(ref, tensor)


def stream_optimizer(ds: DeepSpeedState, cfg: OrthrosConfig, writer: ShardedTensorWriter) -> dict[str, Any]:
    """Collective: the Adam moments in reference layout into ``writer``; returns the index fields."""
    step = ds.optimizer_step()
    if step > 0:  # before the first step there are no moments
        ds.link_fragments()
        for name, p in reference_parameters(ds.engine.module, cfg, trainable=True):
            for key in ADAM_KEYS:
                for ref, tensor in gather_reference_tensor(name, ds.get(p, key), cfg).items():
                    writer.add(f"{ref}.{key}", tensor)
    return {"format": OPTIMIZER_FORMAT, "step": step, "keys": list(ADAM_KEYS)}


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- load: reshard reference-layout tensors -----------------------------------------------------------


class _Suffixed(Mapping[str, torch.Tensor]):
    """``name -> tensor`` view of the ``<name>.<key>`` entries of a reference-layout file set."""

    def __init__(self, lazy: SafetensorsReader, key: str) -> None:
        self.lazy, self.suffix = lazy, "." + key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.lazy[name + self.suffix]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name + self.suffix) in self.lazy

    def __iter__(self) -> Iterator[str]:
        return (k[: -len(self.suffix)] for k in self.lazy if k.endswith(self.suffix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _local_part(
    name: str, source: Mapping[str, torch.Tensor], p: torch.Tensor, cfg: OrthrosConfig, where: Path, what: str
) -> torch.Tensor:
    """This TP rank's part of ``name``'s reference tensor(s) in ``source``, checked against ``p``."""
    tp, tp_rank = _tp()
    try:
        value = shard_tensor(name, source, cfg, tp, tp_rank)
    except KeyError as exc:
        raise IncompatibleCheckpointError(
            f"{where}: {exc} (wanted for {what}): the checkpoint was written for another model config; resume "
            "with the config it was written with"
        ) from exc
    shape = DeepSpeedState.full_shape(p)
    if value is None or tuple(value.shape) != shape:
        raise IncompatibleCheckpointError(
            f"{where}: {what} resharded to {None if value is None else tuple(value.shape)} but this model's is "
            f"{shape}: the checkpoint was written for another model config; resume with that config"
        )
    return value


def load_reference_weights(engine: Any, cfg: OrthrosConfig, directory: Path) -> None:
    """Collective: the reference-layout weights of ``directory`` become this run's weights and fp32
    masters, in its TP/DP/ZeRO layout; one full tensor and this rank's part in memory at a time."""
    ds = DeepSpeedState(engine)
    lazy = SafetensorsReader(directory)
    for name, p in reference_parameters(engine.module, cfg):
        ds.set_master(p, _local_part(name, lazy, p, cfg, directory, name))


def load_reference_optimizer(engine: Any, cfg: OrthrosConfig, directory: Path) -> int:
    """Collective: the reference-layout optimizer state of ``directory`` into this run's TP/DP/ZeRO
    layout. Returns the optimizer step. Read tensor by tensor: memory per rank is one full
    reference tensor and this rank's slice of it at a time."""
    index_path = directory / "index.json"
    if not index_path.is_file():
        raise CheckpointError(
            f"{index_path} is missing: the optimizer state of this checkpoint is incomplete. Restart the "
            "optimizer with model.init_from=<checkpoint>/model"
        )
    index = json.loads(index_path.read_text())
    step = int(index["step"])
    if step == 0:
        return 0
    try:  # before any state changes: a shard index.json names but the folder lacks is named here
        lazy = SafetensorsReader(directory, index_name="index.json")
    except SafetensorsFileError as exc:
        raise CheckpointError(f"the optimizer state of this checkpoint is incomplete: {exc}") from exc
    ds = DeepSpeedState(engine)
    ds.prepare_moments(step)
    for name, p in reference_parameters(engine.module, cfg, trainable=True):
        for key in index["keys"]:
            value = _local_part(name, _Suffixed(lazy, key), p, cfg, directory, f"{name}.{key}")
            if key == MASTER_KEY:  # format 1 (bf16 runs): the masters were kept here
                ds.set_master(p, value)
            else:
                ds.set_moment(p, key, value)
    return step


# -- the manager ----------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves and resumes checkpoints in ``<run_dir>/checkpoints`` (``CheckpointStore``).

    ``host_buffer_bytes``: the host memory one rank's save may hold (see ``host_bound``); files
    of half of it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        keep_last_k: int = 3,
        verify_hashes: bool = True,
        async_save: bool = False,
        host_buffer_bytes: int | None = None,
    ) -> None:
        check_deepspeed_version()  # at the start of a run, not at its first checkpoint hours later
        self.store = CheckpointStore(run_dir, keep_last_k, verify_hashes)
        self.root = self.store.root
        self.async_save = async_save
        self.host_buffer_bytes = HOST_BUFFER_BYTES if host_buffer_bytes is None else host_buffer_bytes
        self.last_budget: HostBudget | None = None  # the latest save's, for its peak
        self._thread: threading.Thread | None = None
        self._async_error: str | None = None
        self._group: Any = None  # a gloo group of its own: the background thread's collectives

    def complete_checkpoints(self) -> list[Path]:
        return self.store.complete_checkpoints()

    def find_latest(self) -> Path | None:
        return self.store.find_latest()

    # -- save --------------------------------------------------------------------------------
    def save(self, state: CheckpointState, asynchronous: bool | None = None) -> Path:
        """Collective: every rank calls it. Raises CheckpointError (on every rank) on failure.

        ``asynchronous`` (default: the manager's ``async_save``): return once every tensor has
        been gathered and is on disk or in the host buffer; the path returned is where the
        checkpoint will appear once the background write publishes it (``wait`` blocks until then).
        """
        asynchronous = self.async_save if asynchronous is None else asynchronous
        self.wait()  # at most one save in flight; its failure was reported when it happened
        rank, world = dist.get_rank(), dist.get_world_size()
        step = state.counters.step
        proposed = str(self.store.temporary(step, str(int(time.time() * 1e6)))) if rank == 0 else None
        tmp = Path(collectives.broadcast_object(proposed, src=0))
        ds, cfg = DeepSpeedState(state.engine), state.model_config
        budget = HostBudget(host_bound(cfg, self.host_buffer_bytes))
        self.last_budget = budget
        sink = FileSink(budget, rank, hash_files=self.store.verify_hashes)
        error: str | None = None
        try:
            if rank == 0:
                tmp.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            error = f"rank {rank}: {exc}"
        collectives.barrier()
        # copies: the background write must see the state of this step, not a later one
        rank_state = {"rng": state.rng.state_dict(), "data": copy.deepcopy(state.data.state_dict())}
        rank_file = tmp / f"rank_{rank:05d}.pt"  # plain data only: read back with weights_only (rank_state.py)
        sink.put(lambda: torch.save(rank_state, rank_file), hash_path=rank_file)
        shard_bytes = budget.limit // 2
        try:
            weights = ShardedTensorWriter(
                tmp / MODEL_DIR, "model", shard_bytes, rank, world, budget, sink,
                index_name=INDEX_NAME, single_name=WEIGHTS_NAME,
                metadata={"format": "pt"},
            )  # fmt: skip
            stream_weights(ds, cfg, weights)
            weights.finish()
            optimizer = ShardedTensorWriter(
                tmp / OPTIMIZER_DIR, "optimizer", shard_bytes, rank, world, budget, sink,
                index_name="index.json", first_owner=weights.shards,
            )  # fmt: skip
            optimizer_index = stream_optimizer(ds, cfg, optimizer)
            optimizer.finish(optimizer_index)
        except BaseException:
            sink.close()
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if rank == 0:
            meta = {
                "step": step,
                "time": time.time(),
                "world_size": world,
                "layout": state.layout,
                "optimizer_step": optimizer_index["step"],
                "wandb_run_id": state.counters.wandb_run_id,
                "skipped_steps": state.counters.skipped_steps,
                "recipe": state.recipe,
                **({"teacher": state.teacher} if state.teacher else {}),
            }
            config, tokenizer = json.dumps(cfg.to_dict(), indent=2) + "\n", state.tokenizer
            sink.put(lambda: _write_text(tmp / MODEL_DIR / "config.json", config))
            sink.put(lambda: tokenizer.save_pretrained(tmp / MODEL_DIR))
            sink.put(lambda: _write_text(tmp / "meta.json", json.dumps(meta, indent=2, default=str)))
        if not asynchronous:
            error = error or sink.close()
            self._publish(tmp, step, error, sink.hashes, group=None)
            return self.root / self.store.name(step)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank is here
        self._async_error = None
        self._thread = threading.Thread(
            target=self._write_in_background, args=(sink, tmp, step, error), name=f"save-{step}"
        )
        self._thread.start()
        return self.root / self.store.name(step)

    def _write_in_background(self, sink: FileSink, tmp: Path, step: int, error: str | None) -> None:
        start = time.perf_counter()
        error = error or sink.close()
        try:
            self._publish(tmp, step, error, sink.hashes, group=self._group)
        except CheckpointError as exc:
            self._async_error = str(exc)
            log.error("ERROR: async save: %s", exc, extra=RANK_ZERO)
            return
        log.info(
            "async checkpoint of step %d published after %.2fs in the background", step, time.perf_counter() - start
        )

    def wait(self) -> str | None:
        """Block until the background save (if any) is published or has failed; returns its error
        message (already printed) or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._async_error

    def _publish(self, tmp: Path, step: int, error: str | None, hashes: dict[str, str], group: Any) -> None:
        """Collective over ``group``: agree that every rank's files are written, then rank 0
        writes the manifest (with the hashes each rank took of its files), renames, points
        ``latest`` at it and prunes."""
        rank = dist.get_rank()
        reports: list[tuple[str | None, dict[str, str]] | None] = collectives.all_gather_object((error, hashes), group)
        failures = [report[0] for report in reports if report is not None and report[0]]
        if not failures and rank == 0:
            known = {path: digest for report in reports if report is not None for path, digest in report[1].items()}
            try:
                self.store.publish(tmp, step, known)
            except OSError as exc:
                failures = [f"rank 0 publishing: {exc}"]
        failures = collectives.broadcast_object(failures, src=0, group=group)
        if failures:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint at step {step} was not saved ({'; '.join(failures)}); the previous checkpoint "
                f"and {self.root / 'latest'} are unchanged"
            )
        if rank == 0:
            self.store.prune()
        collectives.barrier(group=group)

    # -- load --------------------------------------------------------------------------------
    def load(self, state: CheckpointState, path: Path) -> Restored:
        """Collective: restore ``state`` (weights, optimizer, data, RNG) from ``path``."""
        meta = json.loads((path / "meta.json").read_text())
        rank = dist.get_rank()
        saved = {"precision": "fp32", "cp": 1, "ep": 1, **meta["layout"]}  # keys older checkpoints lack
        same_layout = saved == state.layout
        cfg = state.model_config
        # Each rank continues its own RNG streams and data shard with the same layout; otherwise the
        # data position is global (rank 0's) and the streams belong to the old ranks. Read first and
        # agreed on by every rank, so a refused file changes no state and leaves no rank waiting.
        extra = self._read_rank_state(path / f"rank_{rank if same_layout else 0:05d}.pt")
        load_reference_weights(state.engine, cfg, path / MODEL_DIR)
        optimizer_dir = path / OPTIMIZER_DIR
        if optimizer_dir.is_dir():
            load_reference_optimizer(state.engine, cfg, optimizer_dir)
        elif rank == 0:  # written before optimizer/ existed
            log.warning(
                "checkpoint %s has no %s/: loading the weights and the data position; optimizer states start fresh",
                path,
                OPTIMIZER_DIR,
            )
        if same_layout:  # bitwise
            state.rng.load_state_dict(extra["rng"])
        else:
            if rank == 0:
                log.warning(
                    "checkpoint %s was written with layout %s, this run uses %s: weights and optimizer state resharded",
                    path,
                    meta["layout"],
                    state.layout,
                )
        state.data.load_state_dict(dict(extra["data"]))
        counters = TrainingCounters(
            step=int(meta["step"]),
            skipped_steps=int(meta.get("skipped_steps", 0)),
            wandb_run_id=meta.get("wandb_run_id"),
        )
        return Restored(counters=counters, meta=meta, resharded=not same_layout)

    @staticmethod
    def _read_rank_state(path: Path) -> dict[str, Any]:
        """Collective: this rank's rank file (``load_rank_state``: plain data only, nothing in it
        runs); the first rank's refusal is raised on every rank."""
        try:
            extra, problem = load_rank_state(path), None
        except (CheckpointError, OSError) as exc:
            extra, problem = None, exc
        messages = [str(p) for p in collectives.all_gather_object(None if problem is None else str(problem)) if p]
        if problem is not None:
            raise problem
        if messages:
            raise CheckpointError(f"another rank refused its rank file: {messages[0]}")
        return extra
