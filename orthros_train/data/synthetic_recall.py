"""Synthetic associative-recall documents, blended into pretraining data.

At the few-million-parameter / sub-million-token scale a CPU can train, recall over long
distances is never learned from prose alone: the text has too few exact repeats. Blending in
documents where recall is the only way to predict many tokens makes the ability learnable, so a
study can compare architectures on it (``orthros-study``, docs/study.md).

A document is a stream of key-value bigrams ``k v k v ...`` (H3's associative recall, Zoology's
MQAR without the separate query block). Each document draws its own ``pairs`` distinct keys and
binds each to a random value; every bigram then picks one of those keys uniformly. A key's first
occurrence introduces its value; every later occurrence is a query whose value is fixed by the
earlier one. The distance from a query to the key's previous occurrence is geometric with mean
``2 * pairs`` tokens, so one setting yields queries inside a small sliding window and several
windows beyond it. Nearly every other token is a supervised recall target (there is no filler),
which is what lets a 2-layer model form the copy circuit in a few hundred steps.

Keys and values come from two disjoint id ranges at the top of the vocabulary (the rarest BPE
merges, so prose rarely uses them). A ``RecallDocument`` has the fields of
``orthros_train.eval.recall.RecallSample``, so the study scores held-out documents with that
module's ``score_sample``/``summarize`` (data/ sits below eval/ and does not import it).

Recipes enable it with ``data.recall_mix`` (embedded source), e.g.
``{fraction: 0.75, documents: 4000, pairs: 16, keys: 64}``; the documents are written once as
a megatron indexed dataset under ``cache_dir`` and blended by weight with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from orthros_train.data.passkey import hide_needle
from orthros_train.errors import UserError

log = logging.getLogger(__name__)

@dataclass
class RecallMix:
    """``data.recall_mix``: how much synthetic recall to blend in and what it looks like."""

    fraction: float = 0.5  # share of training samples drawn from the synthetic documents
    documents: int = 4000  # documents written (megatron repeats them if the run needs more)
    pairs: int = 16  # distinct keys per document (mean query-to-pair distance: 2 * pairs tokens)
    min_pairs: int | None = None  # if set, each document draws its key count uniformly in [min_pairs, pairs]
    keys: int = 64  # size of the key id range
    values_per_key: int | None = None  # None: one value range of ``keys`` ids shared by all keys;
    # m: each key has its own m candidate values (``keys * m`` value ids), see ``token_ranges``
    length: int | None = None  # document length in tokens incl. EOD (None: seq_len, one per sample)
    seed: int = 0  # the generator's seed (the trainer's seed shuffles, this one generates)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise UserError(f"data.recall_mix.fraction must be in (0, 1), got {self.fraction}")
        if self.pairs < 1 or self.keys < self.pairs:
            raise UserError(f"data.recall_mix needs 1 <= pairs <= keys, got pairs={self.pairs} keys={self.keys}")
        if self.values_per_key is not None and self.values_per_key < 2:
            raise UserError(f"data.recall_mix.values_per_key must be >= 2 (or null), got {self.values_per_key}")
        if self.min_pairs is not None and not 1 <= self.min_pairs <= self.pairs:
            raise UserError(f"data.recall_mix needs 1 <= min_pairs <= pairs, got min_pairs={self.min_pairs}")
        if self.documents < 1:
            raise UserError(f"data.recall_mix.documents must be >= 1, got {self.documents}")
        if self.length is not None and self.length < 4:
            raise UserError(f"data.recall_mix.length must be >= 4 tokens (or null: seq_len), got {self.length}")

    def pairs_of_document(self, rng: random.Random) -> int:
        """Distinct keys of the next document (few keys: short distances, an easy start for learning)."""
        return self.pairs if self.min_pairs is None else rng.randint(self.min_pairs, self.pairs)

    @property
    def chance(self) -> float:
        """Accuracy of a guess that knows the key but not the document: one value of its candidates."""
        return 1.0 / (self.values_per_key or self.keys)

    def ranges(self, vocab_size: int, reserved: tuple[int, ...] = ()) -> "TokenRanges":
        return token_ranges(vocab_size, self.keys, reserved, self.values_per_key)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RecallMix":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"unknown key(s) {unknown} in data.recall_mix; valid keys: {sorted(known)}")
        return cls(**values)


@dataclass
class RecallDocument:
    input_ids: list[int]
    output_positions: list[int] = field(default_factory=list)  # query key positions: each predicts a value
    targets: list[int] = field(default_factory=list)  # the value each of them must predict
    query_of_output: list[int] = field(default_factory=list)  # one output per query here
    distances: list[int] = field(default_factory=list)  # per query: tokens back to the key's previous value


@dataclass
class TokenRanges:
    """Which ids play keys, values and everything else."""

    keys: range
    values: range
    filler: list[int]
    values_per_key: int | None = None  # None: any value can bind to any key

    def candidates(self, key: int) -> range:
        """The values ``key`` can be bound to."""
        if self.values_per_key is None:
            return self.values
        start = self.values.start + (key - self.keys.start) * self.values_per_key
        return range(start, start + self.values_per_key)


def token_ranges(
    vocab_size: int, num_keys: int, reserved: tuple[int, ...] = (), values_per_key: int | None = None
) -> TokenRanges:
    """Keys, then values, at the top of the vocabulary; filler: every other id not ``reserved``.

    Without ``values_per_key`` there are ``num_keys`` values shared by all keys: answering a query
    needs the two-step copy (an induction circuit: mark each value with the key before it, then
    find the mark). With ``values_per_key = m`` key ``i`` owns values ``i*m .. i*m+m-1`` and a
    document binds it to one of them: the query can find its answer by content in one attention
    step, which small models learn within a few hundred steps, and which still fails whenever
    the binding lies outside the keys an attention layer can see.
    """
    num_values = num_keys * (values_per_key or 1)
    if vocab_size < num_keys + num_values + 2:
        raise UserError(f"vocab {vocab_size} too small for {num_keys} keys and {num_values} values plus filler")
    values = range(vocab_size - num_values, vocab_size)
    keys = range(values.start - num_keys, values.start)
    filler = [i for i in range(keys.start) if i not in reserved]
    return TokenRanges(keys, values, filler, values_per_key)


def make_recall_document(rng: random.Random, length: int, num_pairs: int, ranges: TokenRanges) -> RecallDocument:
    """``length`` ids of key-value bigrams over ``num_pairs`` keys; every repeated key is a query.

    An odd ``length`` ends on a lone key (no value follows it, so it is no query).
    """
    if length < 4:
        raise UserError(f"length {length} is too short for a pair and its query")
    keys = rng.sample(ranges.keys, num_pairs)
    value_of = {k: rng.choice(ranges.candidates(k)) for k in keys}
    ids: list[int] = []
    last: dict[int, int] = {}  # key -> position of its latest value
    doc = RecallDocument(input_ids=ids)
    while len(ids) < length:
        k = rng.choice(keys)
        ids.append(k)
        if len(ids) == length:
            break
        if k in last:
            doc.output_positions.append(len(ids) - 1)
            doc.targets.append(value_of[k])
            doc.query_of_output.append(len(doc.distances))
            doc.distances.append(len(ids) - last[k])
        last[k] = len(ids)
        ids.append(value_of[k])
    return doc


def make_passkey_document(
    rng: random.Random, haystack: list[int], distance: int, ranges: TokenRanges
) -> RecallDocument:
    """A needle ``[k v]`` hidden ``distance`` tokens before the end of ``haystack``, then the query ``k``.

    ``k`` is a key the haystack (e.g. held-out prose) does not contain; the one output
    position is the query key at the end, which must predict ``v``.
    """
    if not 2 <= distance <= len(haystack):
        raise UserError(f"needle distance {distance} must be in [2, {len(haystack)}] (the haystack's length)")
    absent = sorted(set(ranges.keys) - set(haystack))
    if not absent:
        raise UserError("the haystack contains every key id; use text outside the key range")
    k = rng.choice(absent)
    v = rng.choice(ranges.candidates(k))
    cut = len(haystack) - distance + 2  # the needle's value lands ``distance`` before the query's
    ids = hide_needle(haystack, [k, v], cut, [k])
    return RecallDocument(input_ids=ids, output_positions=[len(ids) - 1], targets=[v], query_of_output=[0],
                          distances=[distance])


def write_recall_dataset(
    prefix: str, mix: RecallMix, vocab_size: int, eod_token_id: int, doc_length: int
) -> str:
    """Write ``mix.documents`` documents of ``doc_length`` tokens (the last one EOD) as ``prefix``."""
    from orthros_train.data.indexed import ShardWriter

    ranges = mix.ranges(vocab_size, reserved=(eod_token_id,))
    rng = random.Random(mix.seed)
    writer = ShardWriter(prefix, vocab_size)
    try:
        for _ in range(mix.documents):
            doc = make_recall_document(rng, doc_length - 1, mix.pairs_of_document(rng), ranges)
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
    from orthros_train.data.cache import BuildLock
    from orthros_train.data.indexed import DataError, read_index_header

    doc_length = mix.length or seq_len
    key = json.dumps({**asdict(mix), "length": doc_length, "vocab": vocab_size, "eod": eod_token_id, "v": 2})
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    prefix = os.path.join(os.path.expanduser(cache_dir), f"recall-{digest}")
    with BuildLock(prefix + ".lock"):
        if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
            try:  # the shard is renamed into place whole; a damaged copy is rebuilt, with a log line
                read_index_header(prefix)
                return prefix
            except DataError as e:
                log.warning("rebuilding the synthetic recall cache %s: %s", prefix, e)
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
    "make_passkey_document",
    "make_recall_document",
    "prepare_recall_dataset",
    "token_ranges",
    "write_recall_dataset",
]
