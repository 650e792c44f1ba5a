"""Reading raw corpora record by record, with an explicit policy for bad input.

Inputs are files, directories (read recursively, sorted), glob patterns, or a hub dataset name.

* ``.txt``, ``.parquet``, ``.csv``, ``.arrow`` and hub datasets are read with ``datasets`` in
  streaming mode (nothing is materialised, so inputs may be larger than memory). A ``.txt`` file
  is one document by default (``sample_by="document"``; ``line``/``paragraph`` also work). Text
  files are checked to be UTF-8 first, so an error names the file (``datasets`` raises a bare
  ``UnicodeDecodeError`` that does not).
* ``.jsonl``/``.json`` (optionally ``.gz``) are read line by line here rather than with the
  ``datasets`` JSON builder: pyarrow's reader aborts the whole file at the first malformed line
  and cannot say which line it was or skip it, and the skip policy below needs exactly that.

Every raw record gets a stable ordinal (its place in the input stream), bad ones included, so
shards (fixed ranges of ordinals) are the same whether bad records are skipped or not.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orthros_train.data.indexed import DataError
from orthros_train.errors import UserError

log = logging.getLogger("orthros_data")

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
DATASETS_SUFFIXES = {".txt": "text", ".text": "text", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
ON_ERROR = ("raise", "skip")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass
class Record:
    where: str  # "file:line" (or "file row i", "hub:name row i") for messages
    value: dict | None = None
    error: str | None = None  # why the raw record is unusable (malformed JSON, not UTF-8)
    kind: str = "malformed"  # counter name of the error


@dataclass
class BadInputPolicy:
    """``raise``: the first bad record stops the run with a message naming it. ``skip``: bad
    records are counted by kind (reported in the summary) and the run goes on."""

    on_error: str = "raise"
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise UserError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")

    def bad(self, kind: str, where: str, message: str) -> None:
        if self.on_error == "raise":
            raise DataError(f"{where}: {message} (pass --on-error skip to count and skip such records)")
        self.counts[kind] += 1
        self.examples.setdefault(kind, f"{where}: {message}")
        if self.counts[kind] <= 3:
            log.warning("skipping %s: %s", where, message)

    def summary(self) -> dict:
        return {"on_error": self.on_error, "skipped": dict(self.counts), "skipped_examples": self.examples}


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files in order: directories recursively (sorted), globs expanded; other names kept as hub ids."""
    out: list[str] = []
    for item in inputs:
        path = os.path.expanduser(item)
        if _saved_dataset(path):  # `Dataset.save_to_disk` / `DatasetDict.save_to_disk` output
            out.append("disk:" + path)
        elif os.path.isdir(path):
            files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and _kind_of(str(p)))
            if not files:
                raise DataError(f"{path}: no readable files (json/jsonl/txt/parquet/csv/arrow) in the directory")
            out.extend(files)
        elif os.path.isfile(path):
            if not _kind_of(path):
                raise DataError(f"{path}: unsupported file type (use json/jsonl/txt/parquet/csv/arrow)")
            out.append(path)
        elif any(ch in path for ch in "*?["):
            files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f) and _kind_of(f))
            if not files:
                raise DataError(f"{path}: the pattern matches no readable file")
            out.extend(files)
        elif _HUB_NAME.fullmatch(item) and not _kind_of(item):
            out.append("hub:" + item)  # e.g. "HuggingFaceFW/fineweb-edu"
        else:
            raise DataError(f"{item}: no such file or directory")
    return out


def _saved_dataset(path: str) -> bool:
    """A folder written by ``datasets``' ``save_to_disk``: its JSON files are metadata, not records."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))
    )


def _kind_of(path: str) -> str | None:
    low = path.lower()
    if low.endswith(JSON_SUFFIXES):
        return "json"
    for suffix, builder in DATASETS_SUFFIXES.items():
        if low.endswith(suffix):
            return builder
    return None


def source_fingerprint(files: list[str]) -> str:
    """A cheap identity of the inputs: names, sizes and the first/last MiB of each file.

    Hashing every byte of a 400 GB corpus would double the run's I/O; this catches the usual
    accidents (another file, a re-download with other content, a truncated copy).
    """
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        if f.startswith("hub:"):
            continue
        if f.startswith("disk:"):  # names and sizes of the saved dataset's files
            for p in sorted(Path(f[5:]).rglob("*")):
                if p.is_file():
                    h.update(f"{p.relative_to(f[5:])}:{p.stat().st_size}".encode())
            continue
        size = os.path.getsize(f)
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()


def _utf8_error(path: str) -> str | None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        while chunk := f.read(1 << 22):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                return f"not valid UTF-8 (byte {offset + e.start}: {e.reason}); re-encode it as UTF-8"
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            return f"not valid UTF-8 (ends inside a character: {e.reason})"
    return None


def _json_records(path: str) -> Iterator[Record]:
    """The records of a JSON/JSON-lines file; a truncated or corrupt .gz is named, not a traceback."""
    try:
        yield from _json_file_records(path)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # zlib.error: a damaged deflate stream
        raise DataError(
            f"{path}: the compressed file is truncated or corrupt ({e}); re-download or re-compress it "
            "(finished shards are kept: run the same command again once it is fixed)"
        ) from e


def _json_file_records(path: str) -> Iterator[Record]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):  # one JSON array, not JSON lines
        err = _utf8_error(path)
        if err:
            yield Record(path, error=err, kind="not_utf8")
            return
        with opener(path, "rt", encoding="utf-8") as f:
            try:
                items = json.load(f)
            except json.JSONDecodeError as e:
                yield Record(f"{path}:{e.lineno}", error=f"malformed JSON ({e.msg})")
                return
        for i, item in enumerate(items):
            where = f"{path}[{i}]"
            surrogate = _lone_surrogate(None, item)
            if surrogate:
                yield Record(where, error=surrogate, kind="not_utf8")
            elif isinstance(item, dict):
                yield Record(where, value=item)
            else:
                yield Record(where, error=f"expected a JSON object, got {type(item).__name__}")
        return
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(where, error=f"not valid UTF-8 (column {e.start}: {e.reason})", kind="not_utf8")
                continue
            if not line.strip():
                continue  # blank lines are no records
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                yield Record(where, error=f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(value, dict):
                yield Record(where, error=f"expected a JSON object, got {type(value).__name__}")
                continue
            surrogate = _lone_surrogate(line, value)
            if surrogate:
                yield Record(where, error=surrogate, kind="not_utf8")
                continue
            yield Record(where, value=value)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(line: str | None, value: object) -> str | None:
    """Why a decoded JSON record is not Unicode text, or None. JSON may escape half of a UTF-16
    pair (``"\\ud800"``): Python's json decodes it to a lone surrogate, which no tokenizer can
    encode (the tokenizers library raises a TypeError naming neither file nor line)."""
    if line is not None and not _SURROGATE_ESCAPE.search(line):
        return None  # the cheap test: no escape of a surrogate anywhere on the line
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end]
        return (f"holds an escaped lone surrogate ({ascii(bad)[1:-1]}, half of a UTF-16 pair), which is not Unicode "
                "text; fix the record where it was written")
    return None


def _datasets_records(builder: str, files: list[str], txt_sample_by: str) -> Iterator[Record]:
    import datasets

    kwargs = {"sample_by": txt_sample_by} if builder == "text" else {}
    good = []
    for f in files:
        err = _utf8_error(f) if builder in ("text", "csv") else None
        if err:
            yield Record(f, error=err, kind="not_utf8")
        else:
            good.append(f)
    if not good:
        return
    ds = datasets.load_dataset(builder, data_files=good, split="train", streaming=True, **kwargs)
    one_per_file = builder == "text" and txt_sample_by == "document"
    for i, row in enumerate(ds):
        where = good[i] if one_per_file else f"{good[0] if len(good) == 1 else builder + ' inputs'} row {i}"
        yield Record(where, value=dict(row))


def _hub_records(name: str, split: str, config: str | None) -> Iterator[Record]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # offline, unknown name, no such split: say which input it was
        raise DataError(f"{name}: cannot open as a hub dataset ({type(e).__name__}: {e})") from e
    for i, row in enumerate(ds):
        yield Record(f"hub:{name} row {i}", value=dict(row))


def count_records(files: list[str], txt_sample_by: str = "document", split: str = "train") -> int | None:
    """How many records the inputs hold, when that is cheap to know (the progress bar's total):
    newlines of JSON-lines and line-sampled text (read at disk speed), one per text document,
    parquet row counts from its footer, a saved dataset's length. None when any input is of a
    kind that would need a full parse (hub streams, compressed or single-array JSON, csv)."""
    total = 0
    for f in files:
        low = f.lower()
        if f.startswith("disk:"):
            import datasets

            ds = datasets.load_from_disk(f[5:])
            total += (ds[split] if isinstance(ds, datasets.DatasetDict) and split in ds else ds).num_rows
        elif low.endswith((".jsonl", ".ndjson")) or (low.endswith(".txt") and txt_sample_by == "line"):
            with open(f, "rb") as fh:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 24), b""))
        elif low.endswith((".txt", ".md")):
            total += 1
        elif low.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(f).metadata.num_rows
        else:
            return None
    return total


def _disk_records(path: str, split: str) -> Iterator[Record]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # a partial or foreign folder: say which input it was
        raise DataError(f"{path}: cannot open as a saved dataset ({type(e).__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: saved DatasetDict has splits {sorted(ds)}, not {split!r} (--hub-split)")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield Record(f"{path} row {i}", value=dict(row))


def iter_records(
    files: list[str], txt_sample_by: str = "document", hub_split: str = "train", hub_config: str | None = None
) -> Iterator[Record]:
    """All raw records of the expanded inputs, in order (consecutive files of one type are read
    by one ``datasets`` stream)."""
    i = 0
    while i < len(files):
        f = files[i]
        if f.startswith("hub:"):
            yield from _hub_records(f[4:], hub_split, hub_config)
            i += 1
            continue
        if f.startswith("disk:"):
            yield from _disk_records(f[5:], hub_split)
            i += 1
            continue
        kind = _kind_of(f)
        if kind == "json":
            yield from _json_records(f)
            i += 1
            continue
        j = i
        while j < len(files) and not files[j].startswith(("hub:", "disk:")) and _kind_of(files[j]) == kind:
            j += 1
        yield from _datasets_records(kind, files[i:j], txt_sample_by)
        i = j


def record_text(record: Record, text_field: str, policy: BadInputPolicy) -> str | None:
    """The document text of a record, or None after reporting it to the policy."""
    if record.error is not None:
        policy.bad(record.kind, record.where, record.error)
        return None
    value = record.value or {}
    if text_field not in value or value[text_field] is None:
        keys = ", ".join(sorted(value)) or "none"
        message = f"no {text_field!r} field (fields: {keys}); choose one with --text-field"
        policy.bad("missing_field", record.where, message)
        return None
    text = value[text_field]
    if not isinstance(text, str):
        policy.bad("missing_field", record.where, f"field {text_field!r} is a {type(text).__name__}, not text")
        return None
    if not text.strip():
        policy.bad("empty", record.where, "empty document")
        return None
    return text
