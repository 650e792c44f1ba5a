"""The policy as RL reads it: one object handed to the rollout sampler and to the objective."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from orthros_train.phase.layout import OrthrosLayout
from orthros_train.train.rl.batch import response_logprobs


class Policy:
    """A model to sample rollouts with and to read log-probs from: the trainer's own sharded model
    (``attach`` its DeepSpeed engine once built), or a frozen one given as ``module`` (the KL
    reference). Both calls are collective on sharded models: every rank of a model-parallel group
    makes them with the same layout.
    """

    def __init__(self, device: torch.device | str, module: torch.nn.Module | None = None, zero_stage: int = 0) -> None:
        self.device = torch.device(device)
        self.zero_stage = zero_stage
        self._module = module
        self._engine: Any = None

    def attach(self, engine: Any) -> None:
        """The trainer's engine, once built: the policy is its module, as it trains."""
        self._engine = engine
        self._module = engine.module

    @property
    def module(self) -> torch.nn.Module:
        if self._module is None:
            raise RuntimeError("the policy was used before the trainer attached its engine")
        return self._module

    @torch.no_grad()
    def logprobs(self, layout: OrthrosLayout) -> torch.Tensor:
        """Log-probs ``[N]`` of the layout's labels, in eval mode, without grad."""
        model = self.module
        was = model.training
        model.eval()
        try:
            return response_logprobs(model, layout.to(self.device)).detach()
        finally:
            model.train(was)

    @contextmanager
    def sampling(self) -> Iterator[torch.nn.Module]:
        """The model to decode with: this rank's own shards, no second model. Every rank of a TP
        group decodes the same rows (the logits are gathered over TP) with the same seeds, so they
        pick the same tokens; under SP or CP a cached forward runs as under TP alone. Under ZeRO-3
        the rank's shards are gathered over DP once for the sampling and the per-module gather
        hooks lifted meanwhile (DeepSpeed's own ``unwrap_model_for_generation``), so DP ranks
        decode their prompts without waiting on each other's forwards (collective on entry and exit)."""
        if self.zero_stage == 3 and self._engine is not None:
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

            with unwrap_model_for_generation(self._engine):
                yield self._engine.module
        else:
            yield self.module


__all__ = ["Policy"]
