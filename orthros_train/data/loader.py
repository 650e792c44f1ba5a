"""Packed pretraining batches with a resumable, data-parallel-sharded sampler.

Documents are concatenated with an EOD token after each; a sample is ``seq_len + 1``
consecutive tokens (inputs and shifted labels), and document boundaries inside a sample become
separate documents in the phase layout so attention never crosses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orthros_train.phase.builders import pretrain_layout
from orthros_train.phase.layout import OrthrosLayout


@dataclass
class SampleOrder:
    """Epoch-wise shuffled sample order, a pure function of (seed, consumed samples)."""

    num_samples: int
    seed: int

    def index(self, global_sample: int) -> int:
        epoch, offset = divmod(global_sample, self.num_samples)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return int(perm[offset])


class PackedTokenData:
    def __init__(
        self,
        train_tokens: np.ndarray,
        valid_tokens: np.ndarray,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        eod_token_id: int,
        tokenizer,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if len(train_tokens) < seq_len + 1:
            raise ValueError(
                f"the training corpus has {len(train_tokens)} tokens, fewer than one sample of "
                f"seq_len + 1 = {seq_len + 1}; lower trainer.seq_len or add data"
            )
        self.train_tokens, self.valid_tokens = train_tokens, valid_tokens
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.eod_token_id, self.tokenizer = eod_token_id, tokenizer
        self.vocab_size = len(tokenizer)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.order = SampleOrder((len(train_tokens) - 1) // seq_len, seed)
        self.consumed_samples = 0  # global, over all data-parallel ranks

    def _sample(self, tokens: np.ndarray, i: int) -> np.ndarray:
        return tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1]

    def _layout(self, samples: list[np.ndarray]) -> OrthrosLayout:
        batch = torch.from_numpy(np.stack(samples).astype(np.int64))
        return pretrain_layout(batch[:, :-1], labels=batch[:, 1:], eod_token_id=self.eod_token_id)

    def next_batch(self) -> OrthrosLayout:
        """This rank's next micro batch; ranks take interleaved slices of the global order."""
        base = self.consumed_samples
        picks = [self.order.index(base + j * self.dp_size + self.dp_rank) for j in range(self.micro_batch_size)]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return self._layout([self._sample(self.train_tokens, i) for i in picks])

    def valid_batches(self, n: int) -> list[OrthrosLayout]:
        count = (len(self.valid_tokens) - 1) // self.seq_len
        samples = [self._sample(self.valid_tokens, i) for i in range(count)]
        b = self.micro_batch_size
        return [self._layout(samples[i : i + b]) for i in range(0, min(len(samples), n * b), b)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.order.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.order.seed:
            raise ValueError(f"data state was saved with seed {state.get('seed')}, this run uses {self.order.seed}")
        self.consumed_samples = int(state["consumed_samples"])
