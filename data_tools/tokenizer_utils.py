"""Loading an HF tokenizer from a local path and finding its end-of-document token."""

from __future__ import annotations

import os

from orthros_train.data.indexed import DataError

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
