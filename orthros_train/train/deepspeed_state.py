"""Every reach into DeepSpeed's internals the checkpoints need, in one place.

DeepSpeed's public fragment API (``safe_get/set_full_fp32_param``,
``safe_get/set_full_optimizer_state``) reads and writes one parameter's full fp32 master and Adam
moments for ZeRO 1, 2 and 3 and the bf16 optimizer. What it does not cover is reached here through
private attributes, which DeepSpeed may rename in any release:

- ``optimizer._hp_optimizer_states_linked`` / ``_lazy_init_hp_params_optimizer_state()``: the
  fragments of later param groups are linked to their moments only after the first group steps;
- ``optimizer.fp16_groups`` / ``fp32_groups``: stage 0 bf16 (``FP16_UnfusedOptimizer``) keeps fp32
  copies the fragment API does not reach;
- ``optimizer.fp32_partitioned_groups_flat`` / ``sub_group_to_group_id``: ZeRO-3's flat fp32
  partitions, which sit in the torch optimizer's param groups only while it steps;
- ``param.ds_id`` / ``param._hp_mapping`` / ``param.ds_shape``: which parameters are partitioned.

``DeepSpeedState`` checks the installed version against ``SUPPORTED`` when it is built, and the
attributes it needs when it first uses them, so another DeepSpeed fails with a message naming the
versions this code was verified with, never with a wrong checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from orthros_train.parallel import collectives

SUPPORTED = ("0.19.8", "0.20")  # [verified, first untested minor): DeepSpeed internals used below
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MASTER_KEY = "master"  # the fp32 master weight (the weight itself for an fp32 stage-0 engine)


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed lacks an internal the checkpoint code relies on."""


def _version_tuple(text: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(text).release


def check_deepspeed_version(version: str | None = None) -> None:
    """Raise UnsupportedDeepSpeedError unless ``version`` (default: the installed one) lies in
    ``SUPPORTED``."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    low, high = SUPPORTED
    if not _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        raise UnsupportedDeepSpeedError(
            f"deepspeed {version} is installed, but orthros_train's checkpoints reach DeepSpeed internals "
            f"verified with deepspeed>={low},<{high} only (orthros_train/train/deepspeed_state.py); install "
            f"'deepspeed>={low},<{high}'"
        )


class DeepSpeedState:
    """Read and write one parameter's full (not data-parallel-partitioned) fp32 master and Adam
    moments in a DeepSpeed engine, for ZeRO stages 0-3 in fp32 and bf16. Reads are collective over
    the data-parallel group for partitioned parameters: every rank calls them in the same order."""

    def __init__(self, engine: Any) -> None:
        check_deepspeed_version()
        self.engine = engine
        self.optimizer = engine.optimizer
        # The torch optimizer: ZeRO and bf16 wrappers hold it as ``.optimizer``; stage 0 fp32 is bare.
        self.base = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(self.base, torch.optim.Optimizer):
            raise UnsupportedDeepSpeedError(
                f"the DeepSpeed optimizer {type(self.optimizer).__name__} holds no torch optimizer as .optimizer; "
                f"checkpoints support DeepSpeed {SUPPORTED[0]} up to {SUPPORTED[1]} (exclusive)"
            )

    def _require(self, obj: Any, name: str) -> Any:
        if not hasattr(obj, name):
            raise UnsupportedDeepSpeedError(
                f"{type(obj).__name__} has no {name}, which checkpoints rely on: this DeepSpeed is not the one "
                f"orthros_train was verified with (deepspeed>={SUPPORTED[0]},<{SUPPORTED[1]})"
            )
        return getattr(obj, name)

    @staticmethod
    def partitioned(param: torch.Tensor) -> bool:
        """True when DeepSpeed keeps this parameter's fp32 copy and moments in flat partitions
        (ZeRO 1/2 and bf16: ``_hp_mapping``; ZeRO-3: ``ds_id``)."""
        return hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")

    @staticmethod
    def full_shape(param: torch.Tensor) -> tuple[int, ...]:
        """The parameter's shape on this TP rank (ZeRO-3 keeps an empty placeholder)."""
        return tuple(getattr(param, "ds_shape", param.shape))

    def link_fragments(self) -> None:
        """(Re)point every ZeRO-1/2 / bf16 parameter's fragment at the optimizer's current moments.

        DeepSpeed 0.19.8 links them once, right after stepping the *first* param group, so the
        fragments of later groups (our no-decay group) stay empty and ``safe_get_full_optimizer_state``
        raises for them; linking again after all groups have state is idempotent.
        """
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):
            self._require(self.optimizer, "_hp_optimizer_states_linked")
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def optimizer_step(self) -> int:
        """Adam's step count (collective: a rank whose partition is empty has no state)."""
        steps = [float(st["step"]) for st in self.base.state.values() if "step" in st]
        return int(collectives.reduce_floats([max(steps) if steps else 0.0], op="max")[0])

    def _unfused_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor the torch optimizer updates for a non-partitioned ``param``: itself (stage 0
        fp32) or, under stage 0 bf16 (DeepSpeed's FP16_UnfusedOptimizer), its fp32 copy."""
        lp_groups, hp_groups = (
            getattr(self.optimizer, "fp16_groups", None),
            getattr(self.optimizer, "fp32_groups", None),
        )
        if lp_groups is not None and hp_groups is not None:
            for lp_group, hp_group in zip(lp_groups, hp_groups):
                for lp, hp in zip(lp_group, hp_group):
                    if lp is param:
                        return hp
        return param

    def get(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """This TP rank's full fp32 ``key`` (``MASTER_KEY`` or an Adam key) of ``param``;
        collective over DP for partitioned parameters. Before the first step moments are zeros."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.partitioned(param):
            if key == MASTER_KEY:
                return safe_get_full_fp32_param(param)
            return safe_get_full_optimizer_state(param, key)
        master = self._unfused_master(param)
        if key == MASTER_KEY:
            return master.detach().float()
        state = self.base.state.get(master, {})
        return state[key].detach() if key in state else torch.zeros_like(master, dtype=torch.float32)

    @staticmethod
    def full_weight(param: torch.nn.Parameter) -> torch.Tensor:
        """A frozen parameter's weight in fp32 (ZeRO-3: gathered); it has no master or moments."""
        import deepspeed

        if hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param]):
                return param.detach().float().clone()
        return param.detach().float()

    def set_master(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (fp32, this TP rank's full tensor) the parameter's master and weight:
        the model's copy (bf16 rounds it as an optimizer step would) and DeepSpeed's fp32 copy."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        value = value.to(device=param.device, dtype=torch.float32)
        with torch.no_grad():
            if hasattr(param, "ds_id"):  # ZeRO-3: write the full tensor, DeepSpeed re-partitions it
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    param.copy_(value)
            else:
                param.copy_(value)
            if self.partitioned(param):
                safe_set_full_fp32_param(param, value)
            else:
                master = self._unfused_master(param)
                if master is not param:  # stage 0 bf16: its own fp32 copy (stage 0 fp32 has none)
                    master.copy_(value)

    def set_moment(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        """Write Adam moment ``key`` of ``param`` (after ``prepare_moments``)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        value = value.to(device=param.device, dtype=torch.float32)
        with torch.no_grad():
            if self.partitioned(param):
                safe_set_full_optimizer_state(param, value, key)
            else:
                self.base.state[self._unfused_master(param)][key].copy_(value)

    def prepare_moments(self, step: int) -> None:
        """Give every parameter of a fresh torch Adam(W) the state its first step would create, so
        the fragment setters have tensors to write into; ``step`` counts the steps taken."""
        optimizer = self.base
        flat = getattr(self.optimizer, "fp32_partitioned_groups_flat", None)
        if flat is not None:  # ZeRO-3 puts its flat fp32 partitions into param_groups only while stepping
            group_of = self._require(self.optimizer, "sub_group_to_group_id")
            owners = [(optimizer.param_groups[group_of[i]], [t]) for i, t in enumerate(flat)]
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
        self.link_fragments()
