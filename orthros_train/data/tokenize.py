"""Tokenizers and tokenized documents: the part of data preparation the library itself needs.

``eod_token_id`` / ``tokenizer_info`` describe a tokenizer (``common.tokenizer`` loads it);
``encode_texts`` turns texts into token ids; ``write_documents`` / ``write_conversations`` write a
list of documents / chat conversations as a one-shard indexed dataset with the summary JSON that
``orthros-data`` writes, so the readers of ``orthros_train.data`` treat both alike. The embedded
corpora (``data.source=embedded``) are prepared through them. ``orthros-data`` (``data_tools/``:
input formats, worker processes, resumable sharding) builds on these functions and on the chat
rendering of ``chat.py``; this package never imports it.
"""

from __future__ import annotations

import json
import logging
import os
from itertools import chain

import numpy as np

from orthros_train.common.files import write_json_atomic
from orthros_train.data.cache import BuildLock, build_once, describe_change, tokenizer_digest
from orthros_train.data.indexed import (
    DataError,
    ShardWriter,
    read_index_header,
    resolve_prefixes,
    shard_prefix,
    summary_path,
)

log = logging.getLogger(__name__)

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def eod_token_id(tokenizer, override: str | None = None) -> tuple[int, str]:
    """(id, token) of the end-of-document token: ``override``, else EOS, else a common name."""
    vocab = tokenizer.get_vocab()
    if override is not None:
        if override not in vocab:
            raise DataError(f"--eod-token {override!r} is not in the tokenizer's vocabulary")
        return vocab[override], override
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id), tokenizer.eos_token
    for cand in EOD_CANDIDATES:
        if cand in vocab:
            return vocab[cand], cand
    raise DataError("the tokenizer has no EOS token and none of " + ", ".join(EOD_CANDIDATES) + "; pass --eod-token")


def tokenizer_info(tokenizer, path: str, eod: tuple[int, str]) -> dict:
    return {
        "path": os.path.abspath(os.path.expanduser(str(path))),
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "eod_token_id": eod[0],
        "eod_token": eod[1],
    }


def encode_texts(tok, texts: list[str], add_special_tokens: bool, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(flat token ids, per-document lengths), EOD appended to each document when ``eod`` is set."""
    if getattr(tok, "is_fast", False):
        backend = tok.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        ids = [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
    else:
        ids = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    if eod is not None:
        flat = np.insert(flat, np.cumsum(lengths), eod)
        lengths = lengths + 1
    return flat, lengths


def write_documents(
    documents: list[str], tokenizer, tokenizer_path: str, output: str, eod_token: str, source: dict
) -> dict:
    """Tokenize ``documents`` (EOD appended to each) into the pretraining dataset ``output``
    (one shard ``output_00000`` and the summary ``output.json``); returns the summary.

    Holds ``output.lock`` while writing; an output whose summary says complete and records the
    same ``source`` is reused as is (another ``source`` is rebuilt, with a log line). ``source``
    describes where the documents came from and what they were (recorded in the summary).
    """

    def write(writer: ShardWriter, info: dict) -> None:
        flat, lengths = encode_texts(tokenizer, documents, add_special_tokens=False, eod=info["eod_token_id"])
        for doc in np.split(flat, np.cumsum(lengths)[:-1]):
            writer.add_document(doc)

    return _write_one_shard(output, "pretrain", tokenizer, tokenizer_path, eod_token, source, len(documents), write)


def write_conversations(
    conversations: list[list[dict]], tokenizer, tokenizer_path: str, output: str, source: dict,
    train_turns: str = "all",
) -> dict:
    """Render chat ``conversations`` (lists of role/content messages) with the tokenizer's chat
    template into the SFT dataset ``output`` (assistant spans marked, as ``orthros-data sft``
    writes them: ``orthros_train/data/chat.py``); returns the summary. Reused when complete."""
    from orthros_train.data.chat import BadRecord, check_chat_template, render_conversation

    check_chat_template(tokenizer, None)

    def write(writer: ShardWriter, info: dict) -> None:
        for i, messages in enumerate(conversations):
            try:
                writer.add_segments(*render_conversation(tokenizer, messages, train_turns))
            except BadRecord as e:
                raise DataError(f"{source}: conversation {i}: {e}") from e

    return _write_one_shard(output, "sft", tokenizer, tokenizer_path, None, source, len(conversations), write)


def _write_one_shard(output, kind, tokenizer, tokenizer_path, eod_token, source, records, write) -> dict:
    """The one-shard dataset ``output`` (``output_00000`` + ``output.json``), written under
    ``output.lock`` by ``write(writer, tokenizer_info)``; the summary is written last, so an
    interrupted build leaves no summary and is redone. The summary records ``source`` and the
    tokenizer's hash; a complete output recorded with other ones is rebuilt."""
    source = json.loads(json.dumps({**source, "tokenizer_sha256": tokenizer_digest(tokenizer)}, default=str))
    with BuildLock(output + ".lock"):
        path = summary_path(output)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    summary = json.load(f)
            except (OSError, ValueError) as e:
                where = os.path.dirname(path)
                raise DataError(f"{path}: unreadable summary ({e}); delete {where} to rebuild it") from e
            if summary.get("complete") and summary.get("source") == source:
                return summary
            if summary.get("complete"):
                changes = describe_change(summary.get("source"), source) or ["other inputs"]
                log.warning("rebuilding the cached dataset %s: it was built from other inputs (%s)",
                            output, "; ".join(changes[:6]))
        eod = eod_token_id(tokenizer, eod_token)
        info = tokenizer_info(tokenizer, tokenizer_path, eod)
        writer = ShardWriter(shard_prefix(output, 0), info["vocab_size"], multimodal=kind == "sft")
        try:
            write(writer, info)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        entry = {"index": 0, "prefix": os.path.basename(writer.prefix), **writer.record(), "records": records,
                 "skipped": {}}
        summary = {"kind": kind, "tokenizer": info, "source": source, "complete": True,
                   "documents": writer.documents, "tokens": writer.tokens, "records": records,
                   "skipped": {}, "shards": [entry]}
        write_json_atomic(path, summary, indent=2)
        return summary


def save_tokenizer_once(tokenizer, folder: str) -> str:
    """``folder/tokenizer``, saved there unless a complete copy of this very tokenizer exists
    (its ``fingerprint.json`` records the tokenizer's hash); returns its path. The save goes to a
    private folder renamed into place under a lock (``cache.build_once``), so concurrent first
    runs take turns and never see half a tokenizer; a copy of another tokenizer (or an
    unfinished one) is replaced, with a log line."""
    tok_dir = os.path.join(folder, "tokenizer")
    build_once(tok_dir, {"tokenizer_sha256": tokenizer_digest(tokenizer)}, tokenizer.save_pretrained,
               lambda path: None, "tokenizer")
    return tok_dir


def check_cached(output: str, summary: dict, folder: str) -> None:
    """DataError naming ``folder`` when the cached dataset's shards do not match its summary."""
    try:
        headers = [read_index_header(p) for p in resolve_prefixes(output)]
        found = (sum(h.num_documents for h in headers), sum(h.num_tokens for h in headers))
        if found != (summary["documents"], summary["tokens"]):
            raise DataError(f"{output}: holds {found[0]} documents / {found[1]} tokens, its summary "
                            f"{summary['documents']} / {summary['tokens']}")
    except (DataError, KeyError) as e:
        raise DataError(f"the cached dataset in {folder} is corrupt ({e}); delete {folder} to rebuild it") from e
