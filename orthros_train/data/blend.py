"""Packed pretraining samples from blended indexed datasets, via megatron-core.

megatron-core does the heavy lifting: ``GPTDataset`` shuffles documents and cuts their
concatenation into ``seq_len + 1`` token samples (its C++ ``build_sample_idx``), repeating and
reshuffling a dataset for as many epochs as the requested sample count needs, and
``BlendedDataset`` blends datasets by weight (its C++ ``build_blending_indices`` picks, for
sample ``i``, the dataset whose share lags its weight most, so every prefix of the blend matches
the weights to within about one sample per dataset). Indices are cached as ``.npy`` files under
``cache_dir`` (built by rank 0 first when ``torch.distributed`` is up).

megatron names its cache files by paths and parameters only, so data rewritten in place (the
same prefix tokenized again) would be served the old data's indices. Each build therefore gets
its own folder under ``cache_dir``, named by a fingerprint of the inputs (``.bin``/``.idx`` sizes
and mtimes, a hash of the ``.idx``) and the build parameters (``orthros_train/data/cache.py``).

What we add: ``OrthrosGPTDataset`` returns, next to the tokens, the document id of every token,
derived from megatron's own sample index (which knows where each document starts), so document
boundaries survive even in data tokenized without EOD tokens.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from orthros_train.data.cache import build_once, digest, indexed_fingerprint, note_inputs, read_fingerprint
from orthros_train.data.indexed import DataError, IndexHeader, check_token_ids, read_index_header


class TokenizerInfo:
    """The two facts megatron-core's GPT dataset reads from a tokenizer (it never tokenizes)."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        # megatron hashes the config (tokenizer included) into its cache file names
        self.unique_identifiers = {"class": "TokenizerInfo", "vocab_size": self.vocab_size, "eod": self.eod}


class OrthrosGPTDataset(GPTDataset):
    """``GPTDataset`` whose items are ``{"tokens": int64[T+1], "doc": int32[T+1]}``.

    ``doc`` numbers the documents inside the sample 0, 1, 2, ... (padding, which only a partial
    validation sample can have, gets the id after the last document).
    """

    def __getitem__(self, idx: int) -> dict:
        text, _ = self._query_document_sample_shuffle_indices(idx)
        i = self.shuffle_index[idx]
        (b, b_off), (e, e_off) = self.sample_index[i], self.sample_index[i + 1]
        extra = int(self.config.add_extra_token_to_sequence)
        if b == e:
            lengths = [int(e_off - b_off) + extra]
        else:
            full = self.dataset.sequence_lengths[self.document_index[b : e + 1]].astype(np.int64)
            lengths = [int(full[0] - b_off), *full[1:-1].tolist(), int(e_off) + extra]
        pad = len(text) - sum(lengths)
        if pad:
            lengths.append(pad)
        doc = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        return {"tokens": text, "doc": doc, "pad": pad}


@contextlib.contextmanager
def _rank_zero_if_not_distributed(force: bool = False):
    """megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls ``torch.distributed.get_rank()``
    unguarded on a cache miss, which raises in a plain single-process run. Answer 0 there (what a
    single process is) for the duration of the build; a distributed run is left untouched unless
    ``force`` (a rank that must build its own node-local copy: megatron builds on rank 0 only)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and not force:
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        dist.get_rank = original


@dataclass
class BlendedSplits:
    train: object  # BlendedDataset or _Single (both give {"dataset_id", "tokens", "doc", "pad"})
    valid: object | None
    prefixes: list[str]
    weights: list[float] | None


class _Single:
    """One dataset, no blending (megatron warns that blending one dataset is wasted work)."""

    def __init__(self, dataset: OrthrosGPTDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {"dataset_id": 0, **self.dataset[idx]}


def split_documents(num_docs: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Train and valid document indices of one dataset: megatron's contiguous book-ends."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out = []
    for bounds in matrix[:2]:
        if bounds is None:
            out.append(np.zeros(0, dtype=np.int32))
        else:
            beg, end = int(round(bounds[0] * num_docs)), int(round(bounds[1] * num_docs))
            out.append(np.arange(beg, end, dtype=np.int32))
    return out[0], out[1]


def _build_one_split(low_level, prefixes, indices, weights, size, which, config, seq_len, surplus=0.005):
    """megatron's builder logic for one split, with empty contributions left out."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.utils import Split

    keep = [k for k, idx in enumerate(indices) if idx.size]
    if not keep:
        return None
    split = Split.train if which == "train" else Split.valid
    if weights is not None and len(keep) > 1:
        w = np.asarray([weights[k] for k in keep], dtype=np.float64)
        w = w / w.sum()
        if size is None:
            tokens = sum(int(low_level[k].sequence_lengths[indices[k]].sum(dtype=np.int64)) for k in keep)
            size = max(1, tokens // seq_len)
        parts = [
            OrthrosGPTDataset(low_level[k], prefixes[k], indices[k], int(np.ceil(np.ceil(size * wk) * (1 + surplus))),
                              split, config)
            for k, wk in zip(keep, w)
        ]
        return BlendedDataset(parts, w.tolist(), size, config)
    per = None if len(keep) > 1 else size
    parts = [OrthrosGPTDataset(low_level[k], prefixes[k], indices[k], per, split, config) for k in keep]
    if len(parts) == 1:
        return _Single(parts[0])
    lengths = [len(p) for p in parts]
    if min(lengths) == 0:
        parts = [p for p in parts if len(p)]
        lengths = [n for n in lengths if n]
        if len(parts) == 1:
            return _Single(parts[0])
    return BlendedDataset(parts, lengths, None if size is None else min(size, sum(lengths)), config)


def _build_on_rank_zero_first(fn, folder: str, fingerprint: dict):
    """``fn(path)`` builds (or loads) the indices with megatron caching them in ``path``; the
    folder is built once (``build_once``: private folder renamed into place, a lock around it)."""
    dist = torch.distributed

    def once(force: bool = False):
        with _rank_zero_if_not_distributed(force):
            return build_once(folder, fingerprint, fn, fn, "sample-index")

    if not (dist.is_available() and dist.is_initialized()):
        return once()
    if dist.get_rank() == 0:
        out = once()
        dist.barrier()
        return out
    dist.barrier()  # rank 0 has written the index caches; the others load them
    if read_fingerprint(folder) == fingerprint:
        return fn(folder)
    # cache_dir is node-local here (rank 0's copy is on another node): build this node's own
    return once(force=True)


def _checked_headers(prefixes: list[str], weights: list[float] | None, vocab_size: int) -> list[IndexHeader]:
    """The index headers of ``prefixes``, after every check that can fail before megatron runs
    (a clear error here rather than a crash inside the index build or the embedding)."""
    if not prefixes:
        raise DataError("no datasets to blend")
    if weights is not None and len(weights) != len(prefixes):
        raise DataError(f"{len(weights)} blend weights for {len(prefixes)} datasets")
    if weights is not None and any(w <= 0 for w in weights):
        raise DataError(f"blend weights must be positive, got {weights}")
    headers = [read_index_header(p) for p in prefixes]  # clear errors for missing/truncated files
    for prefix, header in zip(prefixes, headers):  # ids past the vocabulary: caught here, not in the embedding
        check_token_ids(prefix, vocab_size, header)
    for p, h in zip(prefixes, headers):
        if h.multimodal:
            raise DataError(f"{p}: holds SFT/RL conversations; use the sft data kind for it")
        if h.num_documents == 0:
            raise DataError(f"{p}: has no documents")
    return headers


def build_blend(
    prefixes: list[str],
    weights: list[float] | None,
    seq_len: int,
    seed: int,
    vocab_size: int,
    eod_token_id: int,
    cache_dir: str,
    split: str = "98,2,0",
    train_samples: int | None = None,
    valid_samples: int | None = None,
) -> BlendedSplits:
    """Train (and valid) datasets of ``seq_len + 1`` token samples blended over ``prefixes``.

    ``weights`` (one per prefix, any scale) set the blend; None blends by dataset size.
    ``split`` ("train,valid,test" weights) splits each dataset's documents as megatron does; a
    dataset too small to have a valid document contributes to train only.
    ``train_samples`` is how many samples the blend is built for (megatron repeats and reshuffles
    a dataset as often as that needs); None: about one pass over the data.

    This composes megatron-core's ``GPTDataset`` and ``BlendedDataset`` the way its
    ``BlendedMegatronDatasetBuilder`` does, except that the builder fails when one of several
    shards is too small to own a valid document (it builds a dataset over zero documents).
    """
    headers = _checked_headers(prefixes, weights, vocab_size)

    def make_config(path_to_cache: str) -> GPTDatasetConfig:
        return GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_len,
            blend=(list(prefixes), list(map(float, weights)) if weights is not None else None),
            split=split,
            path_to_cache=path_to_cache,
            tokenizer=TokenizerInfo(vocab_size, eod_token_id),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            mmap_bin_files=True,
        )

    root = os.path.expanduser(cache_dir)
    params = {"seq_len": seq_len, "seed": seed, "split": split, "vocab_size": vocab_size, "eod": eod_token_id,
              "weights": weights, "train_samples": train_samples, "valid_samples": valid_samples}
    fingerprint = {"inputs": [indexed_fingerprint(p) for p in prefixes], "params": params}
    name = os.path.basename(prefixes[0]) + (f"+{len(prefixes) - 1}" if len(prefixes) > 1 else "")
    folder = os.path.join(root, f"{name}-{digest(fingerprint)}")
    note_inputs(root, {"prefixes": [os.path.abspath(p) for p in prefixes], "params": params}, fingerprint,
                folder, "sample-index")
    low_level = [OrthrosGPTDataset.build_low_level_dataset(p, make_config(folder)) for p in prefixes]
    splits = [split_documents(h.num_documents, split) for h in headers]

    def build(path: str):
        config = make_config(path)
        train = _build_one_split(low_level, prefixes, [s[0] for s in splits], weights, train_samples, "train",
                                 config, seq_len)
        valid = _build_one_split(low_level, prefixes, [s[1] for s in splits], weights, valid_samples, "valid",
                                 config, seq_len)
        return train, valid

    train, valid = _build_on_rank_zero_first(build, folder, fingerprint)
    if train is None or len(train) == 0:
        raise DataError(
            f"{', '.join(prefixes)}: too little data for one training sample of seq_len + 1 = {seq_len + 1} tokens"
        )
    if valid is not None and len(valid) == 0:
        valid = None
    return BlendedSplits(train, valid, list(prefixes), weights)
