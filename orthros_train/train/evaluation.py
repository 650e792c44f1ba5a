"""Held-out evaluation during training: the validation loss every ``eval_every`` steps and at the end."""

from __future__ import annotations

from typing import Any

import torch

from orthros_train.train.config import TrainerConfig


class Evaluator:
    def __init__(self, engine: Any, data: Any, device: torch.device, cfg: TrainerConfig) -> None:
        self.engine = engine
        self.data = data
        self.device = device
        self.every = cfg.eval_every
        self.batches = cfg.eval_batches
        self.max_steps = cfg.max_steps

    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step == self.max_steps

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Validation loss per labelled token; None when the data has no validation split."""
        self.engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        weight = 0
        for layout in self.data.valid_batches(self.batches):
            out = self.engine(layout.to(self.device), loss_normalizer=1.0)  # sum(w * CE)
            if out.loss is not None:
                total += out.loss.detach().double()
                weight += layout.num_loss_tokens
        return float(total) / weight if weight else None


__all__ = ["Evaluator"]
