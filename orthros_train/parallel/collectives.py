"""Every torch.distributed collective the package issues, with its tensors on the right device.

NCCL has no host backend: a collective on a CPU tensor raises ("No backend type associated with
device type cpu"), also at world size 1, while gloo accepts host and device tensors alike, so a
CPU test never sees the mistake. This module is the one place that decides where a collective's
tensors live (:func:`comm_device`, :func:`place`) and the only module that calls
``torch.distributed``'s collectives (tests/test_collectives.py checks both statically).

The small reductions a training step needs (a flag every rank must agree on, the step's loss and
token counts) are one tensor on the group's device, one collective and one host read:
:func:`any_flag`, :func:`reduce_floats`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def comm_device(group: Any = None) -> torch.device:
    """The device ``group``'s backend reduces on: the rank's current CUDA device under NCCL
    (``init_parallel`` sets it from LOCAL_RANK), the host otherwise (gloo, or no process group).

    A mixed backend (``"cpu:gloo,cuda:nccl"``) takes host tensors, so only a pure NCCL group asks
    for CUDA.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``tensor`` on the device ``group`` reduces on (itself when it is already there). Every
    tensor this module hands to torch.distributed comes from here."""
    return tensor.to(comm_device(group))


def _active() -> bool:
    # Without a process group (a unit test, a notebook) every reduction is the local value.
    # With one, collectives are issued even at world size 1: that is the path a multi-rank run
    # takes, and the one that fails when a tensor is on the wrong device.
    return dist.is_available() and dist.is_initialized()


def _op(op: str) -> Any:
    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {sorted(_OPS)}, got {op!r}")
    return _OPS[op]


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` and return it, wherever it lives: a tensor on
    another device than the group's is reduced through a copy on the group's device (then copied
    back), so a host tensor under NCCL works, at the cost of two small copies."""
    reduce_op = _op(op)
    if not _active():
        return tensor
    placed = place(tensor, group)
    dist.all_reduce(placed, op=reduce_op, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def reduce_floats(values: Sequence[float], op: str = "sum", group: Any = None) -> list[float]:
    """A few host numbers reduced over ``group`` in float64: one tensor on the group's device,
    one collective, one host read."""
    reduce_op = _op(op)
    stats = place(torch.tensor([float(v) for v in values], dtype=torch.float64), group)
    if _active():
        dist.all_reduce(stats, op=reduce_op, group=group)
    return stats.tolist()


def any_flag(flag: bool | torch.Tensor, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on any rank of ``group`` (so that every rank takes
    the same path). A tensor flag (e.g. ``~torch.isfinite(loss)`` on the GPU) is reduced where it
    is computed, without a host read before the collective."""
    if isinstance(flag, torch.Tensor):
        value = place(flag.detach().reshape(-1)[:1].to(torch.float32, copy=True), group)
    else:
        value = place(torch.tensor([1.0 if flag else 0.0]), group)
    if _active():
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def all_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on each), on ``tensor``'s own device."""
    if not _active():
        return [tensor]
    local = place(tensor.contiguous(), group)
    parts = [place(torch.empty_like(local), group) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.to(tensor.device) for p in parts]


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group``. Under NCCL the barrier runs on the current CUDA device
    (set at init), which is also the one torch picks without ``device_ids``."""
    if _active():
        dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank. Under NCCL the pickle travels in a tensor
    on the current CUDA device, passed explicitly so that a wrong current device cannot hang it."""
    if not _active():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group, device=comm_device(group))
    return holder[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (the current CUDA device carries them under
    NCCL: torch has no device argument here, ``init_parallel`` sets it)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
