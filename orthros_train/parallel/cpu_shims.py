"""Let megatron-core's tensor-parallel code run on CPU (gloo) when no CUDA device exists.

megatron-core assumes a GPU in a few places: buffers allocated on
``torch.cuda.current_device()``, the CUDA RNG tracker around weight init and dropout, and
``torch.cuda.synchronize()`` in checkpointing, a CUDA stream for the MoE all-to-all dispatcher's
device-to-host copies of its split sizes. On a machine without CUDA those calls raise, so
this module points them at the CPU. It is the only place in the code base that knows about it,
and ``apply_cpu_shims`` does nothing when CUDA is available.
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False


class _NullRNGTracker:
    """Stands in for megatron's CUDA RNG tracker: forks are no-ops on CPU."""

    def fork(self, name: str | None = None):
        return contextlib.nullcontext()

    def add(self, name: str, seed: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: dict) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


_TRACKER = _NullRNGTracker()


def apply_cpu_shims() -> bool:
    """Patch the CUDA-only calls megatron-core makes; returns whether anything was patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    import os

    # Configuration DeepSpeed reads from the environment at import time: set before importing it.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import megatron.core.tensor_parallel.layers as mc_layers
    import megatron.core.tensor_parallel.random as mc_random

    torch.cuda.current_device = lambda: torch.device("cpu")  # buffers of the SP/TP mappings
    torch.cuda.synchronize = lambda *args, **kwargs: None  # dist_checkpointing save/load
    mc_random.get_cuda_rng_tracker = lambda *args, **kwargs: _TRACKER
    mc_layers.get_cuda_rng_tracker = lambda *args, **kwargs: _TRACKER
    _shim_moe_dispatcher()
    # import_module, not `import deepspeed.comm.torch as m`: deepspeed.comm has an attribute
    # named `torch` (the real torch), which that statement would bind instead.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    _APPLIED = True
    return True


def _shim_moe_dispatcher() -> None:
    """megatron's all-to-all token dispatcher creates a CUDA stream when first built and copies its
    split sizes to the host on it. On CPU the sizes are host tensors already: hand them over as the
    CUDA path does (numpy split sizes), without streams."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def to_host(self, point: str, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # non-None: its __init__ creates no stream
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = to_host
