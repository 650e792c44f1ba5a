"""Megatron-core indexed datasets (``.bin``/``.idx``): writing shards and opening them safely.

The on-disk format is megatron-core's own (``IndexedDatasetBuilder`` writes it, ``IndexedDataset``
reads it), so shards made here load in Megatron-LM and shards made by Megatron's
``preprocess_data.py`` load here. Two uses of the format:

* pretraining corpora: one sequence per document, each ending with the EOD token;
* SFT/RL conversations (``multimodal=True``): one *document* per conversation made of several
  *sequences* (segments), each with a mode byte: ``MODE_PROMPT`` (context, no loss),
  ``MODE_ANSWER`` (trained), ``MODE_REFERENCE`` (an RL reference answer, not part of the prompt).
  Answer spans are therefore stored exactly, at segment boundaries, never re-derived from text.

``IndexedDataset`` itself only asserts a few counts, so a truncated ``.bin`` (a copy that stopped
half way) would surface as garbage or a numpy error deep inside training. ``open_indexed`` checks
both files against the header first and names the file at fault.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orthros_train.common.files import replace_durably, temp_name
from orthros_train.errors import UserError

MODE_PROMPT = 0
MODE_ANSWER = 1
MODE_REFERENCE = 2

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}

# megatron-core logs every index open at INFO; keep our logs readable.
logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)


class DataError(UserError):
    """Bad input data or files, with a message that names the file (and line) at fault."""


def token_dtype(vocab_size: int) -> type:
    """Smallest dtype megatron-core uses for token ids (uint16 below 65536, else int32)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


@dataclass(frozen=True)
class IndexHeader:
    dtype: type
    sequence_count: int
    document_count: int  # entries in document_indices (number of documents + 1)
    multimodal: bool
    sequence_lengths: np.ndarray
    document_indices: np.ndarray

    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def read_index_header(prefix: str) -> IndexHeader:
    """Parse and check ``prefix.idx`` and the size of ``prefix.bin`` (DataError naming the file)."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"{path}: missing (an indexed dataset needs both {prefix}.bin and {prefix}.idx)")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _HEADER:
        raise DataError(f"{idx_path}: not a megatron indexed-dataset index (bad or truncated header)")
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in _DTYPES:
        raise DataError(f"{idx_path}: unsupported index version {version} or dtype code {code}")
    body = _HEADER_BYTES + 4 * seq_count + 8 * seq_count + 8 * doc_count
    if idx_size == body:
        multimodal = False
    elif idx_size == body + seq_count:
        multimodal = True
    else:
        raise DataError(
            f"{idx_path}: truncated or corrupt index ({idx_size} bytes, header promises {body} for "
            f"{seq_count} sequences and {doc_count - 1} documents)"
        )
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=seq_count, offset=_HEADER_BYTES)
    doc_idx = np.frombuffer(mm, dtype=np.int64, count=doc_count, offset=_HEADER_BYTES + 12 * seq_count)
    if doc_count < 1 or doc_idx[0] != 0 or doc_idx[-1] != seq_count or bool((np.diff(doc_idx) < 0).any()):
        raise DataError(f"{idx_path}: corrupt document index (must run from 0 to {seq_count}, ascending)")
    dtype = _DTYPES[code]
    expected = int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    found = os.path.getsize(bin_path)
    if found != expected:
        what = "truncated" if found < expected else "longer than its index"
        raise DataError(
            f"{bin_path}: {what} ({found} bytes, {idx_path} describes {expected}); the .bin and .idx "
            "do not belong together or a copy did not finish"
        )
    return IndexHeader(dtype, seq_count, doc_count, multimodal, lengths, doc_idx)


TOKEN_SCAN_CHUNK = 1 << 26  # token ids per scanned block (128 MiB of uint16)


def _shard_entry(prefix: str) -> dict | None:
    """The summary's entry for shard ``prefix`` (None: no orthros-data summary or no entry)."""
    try:
        summary = load_summary(prefix) or {}
    except (OSError, ValueError):
        return None
    name = os.path.basename(prefix)
    return next((e for e in summary.get("shards", []) if e.get("prefix") == name), None)


def recorded_max_token(prefix: str) -> int | None:
    """The largest token id orthros-data recorded for shard ``prefix``, when its ``.bin`` is still
    the file it recorded (same size and mtime); None otherwise (the ids must be scanned)."""
    entry = _shard_entry(prefix)
    if not entry or entry.get("max_token_id") is None:
        return None
    try:
        st = os.stat(prefix + ".bin")
    except OSError:
        return None
    if entry.get("bin_size") != st.st_size or entry.get("bin_mtime_ns") != st.st_mtime_ns:
        return None
    return int(entry["max_token_id"])


def check_token_ids(prefix: str, vocab_size: int, header: IndexHeader | None = None) -> None:
    """DataError naming the file, the token position and the document when ``prefix.bin`` holds
    a token id outside ``[0, vocab_size)``: one would index past the embedding (an IndexError on
    CPU, a device-side assert on a GPU, both mid-run).

    A shard is trusted without reading its tokens only when orthros-data recorded its largest id
    *and* the ``.bin`` is still the file it recorded (size and mtime): the vocabulary size a
    summary claims says nothing about a ``.bin`` copied or rewritten since. Others are scanned,
    block by block, on every open."""
    header = header or read_index_header(prefix)
    recorded = recorded_max_token(prefix)
    if recorded is not None and recorded < vocab_size:
        return
    dtype = np.dtype(header.dtype)
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return  # the dtype cannot hold an id that large
    tokens = np.memmap(prefix + ".bin", mode="r", dtype=dtype) if os.path.getsize(prefix + ".bin") else ()
    for start in range(0, len(tokens), TOKEN_SCAN_CHUNK):
        block = tokens[start : start + TOKEN_SCAN_CHUNK]
        outside = block >= vocab_size
        if dtype.kind != "u":
            outside |= block < 0
        bad = np.flatnonzero(outside)
        if len(bad):
            position = start + int(bad[0])
            sequence = int(np.searchsorted(np.cumsum(header.sequence_lengths, dtype=np.int64), position, "right"))
            document = int(np.searchsorted(header.document_indices, sequence, "right")) - 1
            claim = load_summary(prefix) or {}
            claimed = claim.get("tokenizer", {}).get("vocab_size")
            note = (f"; its summary claims a vocabulary of {claimed}, so the .bin was changed or copied from other "
                    "data after orthros-data wrote it" if claimed is not None and claimed <= vocab_size else "")
            raise DataError(
                f"{prefix}.bin: token id {int(block[bad[0]])} at token position {position} (byte offset "
                f"{position * dtype.itemsize}, document {document}) is outside the vocabulary of {vocab_size} "
                f"tokens ({len(bad)} such ids in that block){note}: the data was tokenized with another "
                "tokenizer; set data.tokenizer to the one that made it, or tokenize again with this one "
                "(orthros-data tokenize --tokenizer ...)"
            )


def megatron_indexed():
    """megatron-core's indexed_dataset module (imported on first use: megatron is heavy)."""
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def open_indexed(prefix: str):
    """``megatron.core.datasets.indexed_dataset.IndexedDataset`` after ``read_index_header`` checks."""
    IndexedDataset = megatron_indexed().IndexedDataset
    header = read_index_header(prefix)
    return IndexedDataset(prefix, multimodal=header.multimodal, mmap=True)


class ShardWriter:
    """Writes one indexed-dataset shard under a temporary name, renamed only when complete.

    A crash leaves ``*.tmp.bin``/``*.tmp.idx`` behind, never a final-looking shard, so a resumed
    run can trust every shard whose final files exist (and pass ``read_index_header``).
    """

    def __init__(self, prefix: str, vocab_size: int, multimodal: bool = False) -> None:
        IndexedDatasetBuilder = megatron_indexed().IndexedDatasetBuilder
        # ``{prefix}.{host}.{pid}.{random}.tmp.bin``: two writers of one prefix on a shared file system
        # never write into one temporary file
        unique = f"{temp_name(prefix, hidden=False)}{uuid.uuid4().hex[:8]}.tmp"
        self.prefix, self.tmp = prefix, os.path.join(os.path.dirname(prefix), unique)
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self.multimodal = multimodal
        self.builder = IndexedDatasetBuilder(self.tmp + ".bin", dtype=self.dtype, multimodal=multimodal)
        self.documents = 0
        self.tokens = 0
        self.max_token_id = -1  # recorded in the summary: readers need not scan the ids again

    def record(self) -> dict:
        """What a summary records of the finished shard: counts, largest id, the .bin's size/mtime."""
        st = os.stat(self.prefix + ".bin")
        return {"documents": self.documents, "tokens": self.tokens, "max_token_id": int(self.max_token_id),
                "bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns}

    def add_document(self, tokens: np.ndarray) -> None:
        """A pretraining document: one sequence."""
        tokens = np.asarray(tokens)
        self.builder.add_document(tokens, [tokens.size])
        self.documents += 1
        self.tokens += tokens.size
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def add_segments(self, segments: Sequence[np.ndarray], modes: Sequence[int]) -> None:
        """A conversation: one document of several segments, each with its mode."""
        if len(segments) != len(modes) or not segments:
            raise UserError("add_segments needs one mode per segment and at least one segment")
        if not self.multimodal:
            raise UserError("segments with modes need a ShardWriter(multimodal=True)")
        flat = np.concatenate([np.asarray(s) for s in segments])
        self.builder.add_document(flat, [len(s) for s in segments], modes=[int(m) for m in modes])
        self.documents += 1
        self.tokens += flat.size
        if flat.size:
            self.max_token_id = max(self.max_token_id, int(flat.max()))

    def finish(self) -> None:
        self.builder.finalize(self.tmp + ".idx")
        replace_durably(self.tmp + ".bin", self.prefix + ".bin", durable=False)
        replace_durably(self.tmp + ".idx", self.prefix + ".idx")

    def abort(self) -> None:
        self.builder.data_file.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(self.tmp + ext):
                os.remove(self.tmp + ext)


# ---------------------------------------------------------------------------------------------
# Finding shards: a prefix, a directory, or the summary JSON that `orthros-data` writes.


def summary_path(output: str) -> str:
    return output + ".json"


def shard_prefix(output: str, index: int) -> str:
    return f"{output}_{index:05d}"


def find_summary(path: str) -> str | None:
    """The summary JSON of an ``orthros-data`` output (PATH itself or ``PATH.json``), if any."""
    for cand in (path, summary_path(path)):
        if cand.endswith(".json") and os.path.isfile(cand):
            return cand
    return None


def load_summary(path: str) -> dict | None:
    """The summary of an output, also when ``path`` names one of its shards (``PREFIX_00003``)."""
    found = find_summary(path)
    if found is None and re.search(r"_\d{5}(\.bin|\.idx)?$", path):
        found = find_summary(re.sub(r"_\d{5}(\.bin|\.idx)?$", "", path))
    if found is None:
        return None
    return _read_summary(found)


def _read_summary(found: str) -> dict:
    """A summary JSON, refused naming the file when it is not one (malformed, or another JSON)."""
    try:
        with open(found, encoding="utf-8") as f:
            summary = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{found}: not valid JSON ({e}); run the orthros-data command that writes it again") from e
    if not isinstance(summary, dict) or "shards" not in summary:
        raise DataError(
            f"{found}: not a summary written by orthros-data (no 'shards'); pass an orthros-data output "
            "prefix, its PREFIX.json, a directory of .bin/.idx shards or a shard prefix"
        )
    return summary


def resolve_prefixes(path: str) -> list[str]:
    """Shard prefixes of a dataset given as a summary JSON / output prefix, a directory or a prefix."""
    path = os.path.expanduser(str(path))
    found = find_summary(path)
    if found is not None:
        summary = _read_summary(found)
        if not summary.get("complete", False):
            raise DataError(f"{found}: the orthros-data run that writes it did not finish; run it again to resume")
        base = os.path.dirname(found)
        return [os.path.join(base, s["prefix"]) for s in summary["shards"] if s.get("prefix")]
    if path.endswith((".bin", ".idx")):
        path = path[:-4]
    if os.path.isfile(path + ".idx") or os.path.isfile(path + ".bin"):
        return [path]
    if os.path.isdir(path):
        found = sorted(p[:-4] for p in glob.glob(os.path.join(path, "*.idx")) if not p.endswith(".tmp.idx"))
    else:
        found = sorted(p[:-4] for p in glob.glob(glob.escape(path) + "_[0-9]*.idx") if not p.endswith(".tmp.idx"))
    if not found:
        raise DataError(
            f"{path}: no indexed dataset (.bin/.idx, a directory of them, or an orthros-data output); "
            f"write it with `orthros-data tokenize|sft|rl INPUTS --tokenizer TOK --output {path}`"
        )
    return found
