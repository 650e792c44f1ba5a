"""SFT batches: conversations (with their answer spans) packed into rows -> ``sft_layout``.

Conversations come from ``orthros-data sft`` shards (see ``indexed.py``: one document per
conversation, segments with modes). Packing is deterministic: the conversations of the split
are shuffled once with the seed, then greedily packed, in that order, into rows of at most
``seq_len`` tokens; each conversation stays a separate document of its row (attention and
labels never cross it). The rows are the samples a ``ResumableSampler`` deals out.

A conversation longer than ``seq_len`` is never split inside an answer. ``overlong="truncate"``
(default) keeps its longest prefix of whole segments that fits and still holds an answer;
``"drop"`` leaves it out. Both are counted (``stats``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from orthros_train.data.indexed import (
    MODE_ANSWER,
    MODE_REFERENCE,
    DataError,
    check_token_ids,
    open_indexed,
    read_index_header,
)
from orthros_train.data.sampler import ResumableSampler
from orthros_train.data.validation import rank_micro_batches
from orthros_train.options import LossAverage, Overlong
from orthros_train.phase.builders import sft_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout

log = logging.getLogger(__name__)


class ConversationStore:
    """All conversations of a list of multimodal indexed shards, addressable 0..N-1."""

    def __init__(self, prefixes: list[str]) -> None:
        self.prefixes = list(prefixes)
        self.datasets, shard_of, doc_of = [], [], []
        for k, p in enumerate(self.prefixes):
            header = read_index_header(p)
            if not header.multimodal:
                raise DataError(f"{p}: holds plain documents, not conversations; build it with `orthros-data sft`")
            self.datasets.append(open_indexed(p))
            shard_of.append(np.full(header.num_documents, k, dtype=np.int32))
            doc_of.append(np.arange(header.num_documents, dtype=np.int64))
        self.shard_of = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.doc_of = np.concatenate(doc_of) if doc_of else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self.shard_of.size)

    def segment_info(self, i: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(segment lengths, modes, first sequence index, shard) of conversation ``i``."""
        ds = self.datasets[self.shard_of[i]]
        d = int(self.doc_of[i])
        lo, hi = int(ds.document_indices[d]), int(ds.document_indices[d + 1])
        # copies: megatron closes its mmaps when the dataset is collected, leaving views dangling
        return np.array(ds.sequence_lengths[lo:hi]), np.array(ds.index.sequence_modes[lo:hi]), lo, int(self.shard_of[i])

    def segments(self, i: int, count: int | None = None) -> tuple[list[np.ndarray], np.ndarray]:
        """The first ``count`` segments (all by default) and their modes."""
        lengths, modes, lo, shard = self.segment_info(i)
        count = len(lengths) if count is None else count
        if count == 0:
            return [], modes[:0]
        parts, _ = self.datasets[shard][lo : lo + count]
        return [np.array(p) for p in parts], modes[:count]


def fit_segments(lengths: np.ndarray, modes: np.ndarray, seq_len: int, overlong: Overlong) -> int:
    """How many leading segments of a conversation to keep (0: leave it out).

    Reference answers (RL) are not model input and end the kept part.
    """
    stop = len(lengths)
    ref = np.nonzero(modes == MODE_REFERENCE)[0]
    if ref.size:
        stop = int(ref[0])
    total = np.cumsum(lengths[:stop])
    if stop and total[-1] <= seq_len:
        keep = stop
    elif overlong == Overlong.drop:
        return 0
    else:
        keep = int(np.searchsorted(total, seq_len, side="right"))
    while keep and modes[keep - 1] != MODE_ANSWER:  # end on an answer: a trailing prompt trains nothing
        keep -= 1
    return keep


@dataclass
class PackStats:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    rows: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    dropped_examples: list = field(default_factory=list)


class PackedConversations:
    """Rows of whole conversations, a fixed function of (conversations, seq_len, seed, overlong)."""

    def __init__(self, store: ConversationStore, indices: np.ndarray, seq_len: int, seed: int,
                 overlong: Overlong | str):
        overlong = Overlong.parse(overlong, "overlong")
        self.store, self.seq_len = store, seq_len
        order = np.asarray(indices, dtype=np.int64)[np.random.default_rng([seed, 7]).permutation(len(indices))]
        self.stats = PackStats(conversations=len(order))
        convs, keeps, row_starts = [], [], [0]
        row_len = 0
        for i in order.tolist():
            lengths, modes, _, _ = store.segment_info(i)
            keep = fit_segments(lengths, modes, seq_len, overlong)
            if keep == 0:
                self.stats.dropped += 1
                if len(self.stats.dropped_examples) < 3:
                    self.stats.dropped_examples.append(int(i))
                continue
            ref = np.nonzero(modes == MODE_REFERENCE)[0]
            if keep < (int(ref[0]) if ref.size else len(lengths)):
                self.stats.truncated += 1
            n = int(lengths[:keep].sum())
            if row_len and row_len + n > seq_len:
                row_starts.append(len(convs))
                row_len = 0
            convs.append(i)
            keeps.append(keep)
            row_len += n
            self.stats.tokens += n
            self.stats.answer_tokens += int(lengths[:keep][modes[:keep] == MODE_ANSWER].sum())
        if convs:
            row_starts.append(len(convs))
        self.convs = np.asarray(convs, dtype=np.int64)
        self.keeps = np.asarray(keeps, dtype=np.int64)
        self.row_starts = np.asarray(row_starts if convs else [0], dtype=np.int64)
        self.stats.rows = len(self)
        if self.stats.dropped or self.stats.truncated:
            log.info("sft packing: %d conversations truncated, %d dropped (longer than seq_len=%d)",
                     self.stats.truncated, self.stats.dropped, seq_len)

    def __len__(self) -> int:
        return int(self.row_starts.size - 1)

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """(tokens, document ids, answer spans [start, end)) of row ``r``."""
        tokens, docs, spans, pos = [], [], [], 0
        for d, c in enumerate(range(int(self.row_starts[r]), int(self.row_starts[r + 1]))):
            parts, modes = self.store.segments(int(self.convs[c]), int(self.keeps[c]))
            for part, mode in zip(parts, modes):
                if mode == MODE_ANSWER:
                    spans.append((pos, pos + len(part)))
                tokens.append(part)
                docs.append(np.full(len(part), d, dtype=np.int64))
                pos += len(part)
        return np.concatenate(tokens).astype(np.int64), np.concatenate(docs), spans


def rows_to_layout(
    rows: list[tuple[np.ndarray, np.ndarray, list]], loss_average: LossAverage = LossAverage.token
) -> OrthrosLayout:
    layout = sft_layout(
        [torch.from_numpy(t) for t, _, _ in rows],
        [spans for _, _, spans in rows],
        document_ids=[torch.from_numpy(d) for _, d, _ in rows],
    )
    return average_per_sequence(layout) if loss_average == LossAverage.sequence else layout


def average_per_sequence(layout: OrthrosLayout) -> OrthrosLayout:
    """Loss weights ``1 / n_d`` for a token of conversation (document) ``d`` with ``n_d``
    labelled tokens (existing weights are multiplied in): a short answer weighs as much as a long
    one. Divided by the number of conversations, ``sum(w * CE)`` is the mean over conversations
    of their mean answer loss; the trainer divides by the count of the whole step's batch
    (``orthros_train.train.global_loss``), which with ``loss_average=sequence`` is conversations.
    """
    valid = layout.labels != IGNORE_INDEX
    if not bool(valid.any()):
        return layout
    doc = layout.document_ids()[layout.output_index]
    counts = torch.bincount(doc[valid], minlength=layout.cu_seqlens.numel() - 1).to(layout.loss_weights.dtype)
    scale = torch.where(valid, 1.0 / counts[doc].clamp(min=1), torch.zeros_like(counts[doc]))
    out = copy.copy(layout)
    out.loss_weights = layout.loss_weights * scale
    return out


def split_conversations(n: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Train/valid conversation indices: megatron's contiguous book-ends of ``split``."""
    from orthros_train.data.blend import split_documents

    return split_documents(n, split)


class SFTData:
    """The ``build_data`` interface for SFT: packed conversations -> ``sft_layout`` batches."""

    def __init__(
        self,
        store: ConversationStore,
        tokenizer,
        eod_token_id: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        split: str = "98,2,0",
        overlong: Overlong | str = Overlong.truncate,
        loss_average: LossAverage | str = LossAverage.token,
    ) -> None:
        self.loss_average = LossAverage.parse(loss_average, "loss_average")
        train_idx, valid_idx = split_conversations(len(store), split)
        self.train = PackedConversations(store, train_idx, seq_len, seed, overlong)
        self.valid = PackedConversations(store, valid_idx, seq_len, seed, overlong) if valid_idx.size else None
        if len(self.train) == 0:
            raise DataError(f"{', '.join(store.prefixes)}: no conversation fits seq_len={seq_len} with an answer")
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        for prefix in store.prefixes:  # ids past the vocabulary: caught here, not in the embedding
            check_token_ids(prefix, len(tokenizer))
        self.eod_token_id = int(eod_token_id)
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.sampler = ResumableSampler(len(self.train), micro_batch_size, seed, dp_rank, dp_size)
        if self.valid is None or len(self.valid) == 0:
            log.warning("no SFT validation conversations under split %s; valid_batches() returns nothing", split)

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def next_batch(self) -> OrthrosLayout:
        return rows_to_layout([self.train.row(i) for i in self.sampler.next_indices()], self.loss_average)

    def valid_batches(self, n: int) -> list[OrthrosLayout]:
        if self.valid is None or len(self.valid) == 0:
            return []
        batches = rank_micro_batches(len(self.valid), n, self.micro_batch_size, self.dp_rank, self.dp_size)
        return [rows_to_layout([self.valid.row(i) for i in idx]) for idx in batches]

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if "num_samples" in state and int(state["num_samples"]) != self.sampler.num_samples:
            log.warning("resuming SFT with %s rows saved but %d now: the order differs",
                        state["num_samples"], self.sampler.num_samples)
        self.sampler.load_state_dict(state)
