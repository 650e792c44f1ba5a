"""Pretraining batches from blended indexed datasets -> ``pretrain_layout``.

Each micro batch is ``micro_batch_size`` samples of ``seq_len + 1`` tokens (inputs and shifted
labels) packed into one ``OrthrosLayout``; the per-token document ids from ``OrthrosGPTDataset``
become the layout's documents, so attention never crosses a document boundary and no label
points into the next document.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from orthros_train.data.blend import BlendedSplits
from orthros_train.data.sampler import ResumableSampler
from orthros_train.data.validation import rank_micro_batches
from orthros_train.phase.builders import pretrain_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout

log = logging.getLogger(__name__)


def samples_to_layout(items: list[dict], eod_token_id: int | None) -> OrthrosLayout:
    """``{"tokens": [T+1], "doc": [T+1]}`` samples -> one packed pretrain layout."""
    tokens = np.stack([it["tokens"] for it in items]).astype(np.int64)
    doc = np.stack([it["doc"] for it in items])
    labels = tokens[:, 1:].copy()
    labels[doc[:, 1:] != doc[:, :-1]] = IGNORE_INDEX  # never predict across a document boundary
    pad = tokens < 0  # megatron pads a partial (validation) sample with -1
    if pad.any():
        labels[pad[:, 1:]] = IGNORE_INDEX
        tokens[pad] = eod_token_id if eod_token_id is not None else 0
    return pretrain_layout(
        torch.from_numpy(tokens[:, :-1]),
        labels=torch.from_numpy(labels),
        document_ids=torch.from_numpy(doc[:, :-1]),
        eod_token_id=eod_token_id,
    )


class IndexedPretrainData:
    """The ``build_data`` interface over megatron-core indexed datasets (see ``orthros_train.data``)."""

    def __init__(
        self,
        splits: BlendedSplits,
        tokenizer,
        eod_token_id: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.splits = splits
        self.train, self.valid = splits.train, splits.valid
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eod_token_id = int(eod_token_id)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = ResumableSampler(len(self.train), micro_batch_size, seed, dp_rank, dp_size)
        self.last_dataset_ids: list[int] = []
        if self.valid is None:
            log.warning("no validation data: no dataset of %s has a document in the valid share of its split; "
                        "valid_batches() returns nothing", ", ".join(splits.prefixes))

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def next_batch(self) -> OrthrosLayout:
        epoch = self.sampler.epoch
        items = [self.train[i] for i in self.sampler.next_indices()]
        if epoch == 0 and self.sampler.epoch > 0:
            log.warning(
                "the data (%d samples) is exhausted; starting epoch %d (set data.train_samples to the "
                "run's samples for a longer megatron-shuffled stream)", self.sampler.num_samples, self.sampler.epoch
            )
        self.last_dataset_ids = [int(it["dataset_id"]) for it in items]
        return samples_to_layout(items, self.eod_token_id)

    def valid_batches(self, n: int) -> list[OrthrosLayout]:
        """The first ``n`` validation micro batches of this rank (the same ones every call)."""
        if self.valid is None:
            return []
        batches = rank_micro_batches(len(self.valid), n, self.micro_batch_size, self.dp_rank, self.dp_size)
        return [samples_to_layout([self.valid[i] for i in idx], self.eod_token_id) for idx in batches]

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if "num_samples" in state and int(state["num_samples"]) != self.sampler.num_samples:
            log.warning(
                "resuming with a different data set size (%s samples saved, %d now): the sample order differs",
                state["num_samples"], self.sampler.num_samples,
            )
        self.sampler.load_state_dict(state)
