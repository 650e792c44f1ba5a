"""What each rank saves beside the weights (``rank_NNNNN.pt``), read back without running code.

The file holds the rank's random streams (python, numpy, torch, CUDA) and its data position.
``torch.load`` unpickles, and an unrestricted unpickler runs whatever a crafted file asks for (an
object whose ``__reduce__`` is ``os.system``): a checkpoint copied from a colleague, a shared run
directory or a download could take over the machine on ``trainer.resume``. So the file is read with
``weights_only=True``, which rebuilds tensors, numbers, strings, lists, tuples and dicts only, plus
the few plain data classes allow-listed in ``SAFE_TYPES``:

- ``OrthrosLayout``: an RL run saved in the middle of a rollout batch keeps the batch's layouts
  (tensors and numbers; unpickling one sets its fields and calls nothing);
- numpy's array rebuild (``_reconstruct``, ``ndarray``, ``dtype``): only for rank files written
  before the numpy stream was stored as a tensor (an array's bytes, no callable of the file's choice).

Everything else is refused with ``UnsafeCheckpointError``, naming the file; nothing in it has run.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orthros_train.errors import UserError
from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.checkpoint_store import CheckpointError

_multiarray = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
# (type, the name older pickles refer to it by): numpy < 2 wrote ``numpy.core.multiarray``.
SAFE_TYPES: list[Any] = [
    OrthrosLayout,
    _multiarray.multiarray._reconstruct,
    (_multiarray.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


class UnsafeCheckpointError(CheckpointError, UserError):
    """A checkpoint file holds something other than plain data: refused unread."""


class ProcessRNG:
    """The random streams of this process (python, numpy, torch, CUDA) as a ``Stateful``; the
    numpy stream is stored as a tensor and numbers, so it loads with ``weights_only=True``."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip
        state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        saved = state["numpy"]
        if isinstance(saved, dict):
            keys = saved["keys"].numpy().astype(np.uint32)
            np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
        else:  # a rank file written before: numpy's own tuple
            np.random.set_state(saved)
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def load_rank_state(path: Path) -> dict[str, Any]:
    """A rank file's ``{"rng": ..., "data": ...}``, unpickled with ``weights_only=True``; a file
    asking for anything else (code to run) is an ``UnsafeCheckpointError``."""
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        # torch's message is a page of advice to load the file unrestricted; keep the line naming the type
        lines = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "nsupported" in line]
        detail = f" ({lines[0].rstrip('.')})" if lines else ""
        raise UnsafeCheckpointError(
            f"{path}: refused: it asks the unpickler for more than plain checkpoint data{detail}; "
            "a checkpoint orthros-train writes never does, so the file was altered or written by something else. "
            "Nothing in it was run. Resume from a checkpoint you trust, or start the run again"
        ) from exc
    if not isinstance(state, dict) or "data" not in state:
        raise CheckpointError(f"{path} is not a rank state file (no 'data'); resume from another checkpoint")
    return state
