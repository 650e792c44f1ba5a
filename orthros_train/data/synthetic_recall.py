"""Synthetic multi-query associative recall (MQAR) documents, blended into pretraining data.

At the 10M-parameter / few-hundred-thousand-token scale a CPU can train, recall over long
distances is never learned from prose alone: the text has too few exact repeats. Blending in
documents where recall is the only way to predict some tokens makes the ability learnable, so a
study can compare architectures on it (``orthros-study``, docs/study.md).

A document of ``length`` token ids holds ``num_pairs`` key-value pairs ``[k, v]`` and, for each,
a query ``[k, v]`` placed ``d`` tokens later, ``d`` log-uniform in ``[min_distance, length)``:
about as many queries at every scale of distance, inside the sliding window and far beyond it.
All other positions are filler. Keys and values come from two disjoint id ranges at the top of
the vocabulary (the rarest BPE merges, so prose rarely uses them); filler is any other id but
the end-of-document token. Keys are distinct within a document, so the value after a query key
is determined by the pair and by nothing else: predicting it needs attention reaching back ``d``.

A ``RecallDocument`` has the fields of ``orthros_train.eval.recall.RecallSample``, so the study
scores held-out documents with that module's ``score_sample``/``summarize`` like its own MQAR
probes (data/ sits below eval/ and does not import it).

Recipes enable it with ``data.recall_mix`` (embedded source), e.g.
``{fraction: 0.5, documents: 4000, pairs: 48, keys: 128}``; the documents are written once as
a megatron indexed dataset under ``cache_dir`` and blended by weight with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class RecallMix:
    """``data.recall_mix``: how much synthetic recall to blend in and what it looks like."""

    fraction: float = 0.5  # share of training samples drawn from the synthetic documents
    documents: int = 4000  # documents written (megatron repeats them if the run needs more)
    pairs: int = 48  # key-value pairs (and queries) per document
    keys: int = 128  # size of the key id range (the value range has the same size)
    min_distance: int = 2  # shortest pair-to-query distance
    length: int | None = None  # document length in tokens incl. EOD (None: seq_len, one per sample)
    seed: int = 0  # the generator's seed (the trainer's seed shuffles, this one generates)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"data.recall_mix.fraction must be in (0, 1), got {self.fraction}")
        if self.pairs < 1 or self.keys < self.pairs:
            raise ValueError(f"data.recall_mix needs 1 <= pairs <= keys, got pairs={self.pairs} keys={self.keys}")
        if self.documents < 1 or self.min_distance < 2:
            raise ValueError("data.recall_mix needs documents >= 1 and min_distance >= 2")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RecallMix":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in data.recall_mix; valid keys: {sorted(known)}")
        return cls(**values)


@dataclass
class RecallDocument:
    input_ids: list[int]
    output_positions: list[int] = field(default_factory=list)  # query key positions: each predicts a value
    targets: list[int] = field(default_factory=list)  # the value each of them must predict
    query_of_output: list[int] = field(default_factory=list)  # one output per query here
    distances: list[int] = field(default_factory=list)  # per query: tokens from the pair's value to the query's


@dataclass
class TokenRanges:
    """Which ids play keys, values and filler."""

    keys: range
    values: range
    filler: list[int]


def token_ranges(vocab_size: int, num_keys: int, reserved: tuple[int, ...] = ()) -> TokenRanges:
    """Keys and values: the top ``2 * num_keys`` ids; filler: every other id not ``reserved``."""
    if vocab_size < 2 * num_keys + 2:
        raise ValueError(f"vocab {vocab_size} too small for {num_keys} keys and {num_keys} values plus filler")
    keys = range(vocab_size - 2 * num_keys, vocab_size - num_keys)
    values = range(vocab_size - num_keys, vocab_size)
    filler = [i for i in range(vocab_size - 2 * num_keys) if i not in reserved]
    return TokenRanges(keys, values, filler)


def make_recall_document(
    rng: random.Random, length: int, num_pairs: int, ranges: TokenRanges, min_distance: int = 2
) -> RecallDocument:
    """One document of ``length`` ids: pairs and their queries at log-uniform distances, filler between.

    A pair that finds no free slots after a few tries is dropped (only when ``num_pairs`` nearly
    fills the document), so the result may hold fewer queries than asked.
    """
    if length < 4 * num_pairs:
        raise ValueError(f"length {length} is too short for {num_pairs} pairs and their queries")
    ids: list[int | None] = [None] * length
    keys = rng.sample(ranges.keys, num_pairs)
    placed: list[tuple[int, int, int]] = []  # (query key position, value, distance)
    for k in keys:
        v = rng.choice(ranges.values)
        for _ in range(50):
            d = int(round(math.exp(rng.uniform(math.log(min_distance), math.log(length - 2)))))
            s = rng.randrange(0, length - d - 1)
            slots = (s, s + 1, s + d, s + d + 1)
            if all(ids[i] is None for i in slots):
                ids[s], ids[s + 1], ids[s + d], ids[s + d + 1] = k, v, k, v
                placed.append((s + d, v, d))
                break
    out = [t if t is not None else rng.choice(ranges.filler) for t in ids]
    placed.sort()
    return RecallDocument(
        input_ids=out,
        output_positions=[p for p, _, _ in placed],
        targets=[v for _, v, _ in placed],
        query_of_output=list(range(len(placed))),
        distances=[d for _, _, d in placed],
    )


def write_recall_dataset(
    prefix: str, mix: RecallMix, vocab_size: int, eod_token_id: int, doc_length: int
) -> str:
    """Write ``mix.documents`` documents of ``doc_length`` tokens (the last one EOD) as ``prefix``."""
    from orthros_train.data.indexed import ShardWriter

    ranges = token_ranges(vocab_size, mix.keys, reserved=(eod_token_id,))
    rng = random.Random(mix.seed)
    writer = ShardWriter(prefix, vocab_size)
    try:
        for _ in range(mix.documents):
            doc = make_recall_document(rng, doc_length - 1, mix.pairs, ranges, mix.min_distance)
            writer.add_document(np.asarray(doc.input_ids + [eod_token_id], dtype=np.int64))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return prefix


def prepare_recall_dataset(
    mix: RecallMix, vocab_size: int, eod_token_id: int, seq_len: int, cache_dir: str
) -> str:
    """The indexed dataset for ``mix`` under ``cache_dir`` (written once, keyed by its settings).

    Documents are ``seq_len`` tokens including the EOD, so each training sample (``seq_len + 1``
    tokens cut from the concatenation) is exactly one document plus the next one's first token:
    no query is ever cut off from its pair.
    """
    from orthros_train.data.indexed import file_lock

    doc_length = mix.length or seq_len
    key = json.dumps({**asdict(mix), "length": doc_length, "vocab": vocab_size, "eod": eod_token_id, "v": 1})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    prefix = os.path.join(os.path.expanduser(cache_dir), f"recall-{digest}")
    with file_lock(prefix + ".lock"):
        if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
            write_recall_dataset(prefix, mix, vocab_size, eod_token_id, doc_length)
    return prefix


def blend_with_recall(
    recall_mix: dict[str, Any],
    prefixes: list[str],
    vocab_size: int,
    eod_token_id: int,
    seq_len: int,
    cache_dir: str,
) -> tuple[list[str], list[float]]:
    """``prefixes`` (the corpus shards) plus the synthetic dataset, with blend weights."""
    from orthros_train.data.indexed import read_index_header

    mix = RecallMix.from_dict(recall_mix)
    synthetic = prepare_recall_dataset(mix, vocab_size, eod_token_id, seq_len, cache_dir)
    tokens = [read_index_header(p).num_tokens for p in prefixes]
    weights = [(1.0 - mix.fraction) * t / sum(tokens) for t in tokens]  # shards share the corpus' weight
    return [*prefixes, synthetic], [*weights, mix.fraction]


__all__ = [
    "RecallDocument",
    "RecallMix",
    "TokenRanges",
    "blend_with_recall",
    "make_recall_document",
    "prepare_recall_dataset",
    "token_ranges",
    "write_recall_dataset",
]
