"""Tokenizers and tokenized documents: the part of data preparation the library itself needs.

``load_tokenizer`` / ``eod_token_id`` / ``tokenizer_info`` find and describe a tokenizer;
``encode_texts`` turns texts into token ids; ``write_documents`` writes a list of documents as a
one-shard indexed dataset with the summary JSON that ``orthros-data`` writes, so the readers of
``orthros_train.data`` treat both alike. The embedded corpus (``data.source=embedded``) is
prepared through it. ``orthros-data`` (``data_tools/``: input formats, chat templates, worker
processes, resumable sharding) builds on these functions; this package never imports it.
"""

from __future__ import annotations

import json
import os
from itertools import chain

import numpy as np

from orthros_train.data.indexed import DataError, ShardWriter, file_lock, shard_prefix, summary_path

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def load_tokenizer(path: str):
    """A ``transformers`` tokenizer from a directory (``from_pretrained``) or a ``tokenizer.json``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.path.expanduser(str(path))
    if os.path.isfile(path) and path.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such tokenizer (give a local directory or a tokenizer.json file)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad folder; name it
        raise DataError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from e


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

    Holds ``output.lock`` while writing; an output whose summary says complete is reused as is.
    ``source`` describes where the documents came from (recorded in the summary).
    """
    with file_lock(output + ".lock"):
        path = summary_path(output)
        if os.path.isfile(path):
            with open(path) as f:
                summary = json.load(f)
            if summary.get("complete"):
                return summary
        eod = eod_token_id(tokenizer, eod_token)
        info = tokenizer_info(tokenizer, tokenizer_path, eod)
        flat, lengths = encode_texts(tokenizer, documents, add_special_tokens=False, eod=eod[0])
        writer = ShardWriter(shard_prefix(output, 0), info["vocab_size"])
        try:
            for doc in np.split(flat, np.cumsum(lengths)[:-1]):
                writer.add_document(doc)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        entry = {"index": 0, "prefix": os.path.basename(writer.prefix), "documents": writer.documents,
                 "tokens": writer.tokens, "records": len(documents), "skipped": {}}
        summary = {"kind": "pretrain", "tokenizer": info, "source": source, "complete": True,
                   "documents": writer.documents, "tokens": writer.tokens, "records": len(documents),
                   "skipped": {}, "shards": [entry]}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, path)
        return summary
