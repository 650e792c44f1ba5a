"""The embedded corpus cache is shared by every checkout on a machine without clashing."""

from __future__ import annotations

import shutil

import numpy as np

import orthros_train.data as data
from orthros_train.data import DataConfig, prepare_embedded
from orthros_train.data.embedded import corpus_files


def test_two_checkouts_share_the_cache_dir_without_clashing(tmp_path, monkeypatch):
    sources = corpus_files("paul_graham")[:3]
    copies = {}
    for name in ("checkout_a", "checkout_b"):
        folder = tmp_path / name
        folder.mkdir()
        copies[name] = [shutil.copy(p, folder / p.name) for p in sources]
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=300)
    outputs = []
    for name in ("checkout_a", "checkout_b", "checkout_a"):
        files = [type(sources[0])(p) for p in copies[name]]
        monkeypatch.setattr(data, "corpus_files", lambda corpus, files=files: files)
        monkeypatch.setattr(data, "corpus_documents", lambda corpus, files=files: [f.read_text() for f in files])
        output, _ = prepare_embedded(cfg)  # the second checkout used to fail: "exists for other inputs"
        outputs.append(output)
    assert outputs[0] != outputs[1] and outputs[0] == outputs[2]


def _use_files(monkeypatch, files):
    monkeypatch.setattr(data, "corpus_files", lambda corpus: list(files))
    monkeypatch.setattr(data, "corpus_documents", lambda corpus: [f.read_text() for f in files])


def test_changed_corpus_content_at_the_same_paths_is_tokenized_again(tmp_path, monkeypatch, caplog):
    """A package upgrade rewrites the corpus files in place: the cached tokenized copy must not be
    reused (it was keyed by paths and the tokenizer, which a small edit need not change)."""
    import logging
    from pathlib import Path

    from orthros_train.data.indexed import load_summary, open_indexed, resolve_prefixes

    folder = tmp_path / "pkg"
    folder.mkdir()
    files = [Path(shutil.copy(p, folder / p.name)) for p in corpus_files("paul_graham")[:3]]
    _use_files(monkeypatch, files)
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), tokenizer_vocab_size=300)
    first, tok = prepare_embedded(cfg)
    # keep the tokenizer the same (it is trained on the content): only the corpus bytes change
    monkeypatch.setattr(data, "train_tokenizer", lambda docs, vocab, cache: tok)
    files[1].write_text(files[1].read_text() + "\n\nA new closing paragraph about startups.")
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        second, _ = prepare_embedded(cfg)
    assert second != first
    ds = open_indexed(resolve_prefixes(second)[0])
    text = tok.decode(np.asarray(ds[1]).tolist())
    assert text.strip().endswith("A new closing paragraph about startups.<|endoftext|>")
    assert load_summary(second)["source"]["fingerprint"][1]["path"] == str(files[1])
    stale = [r.getMessage() for r in caplog.records if "no longer matches its inputs" in r.getMessage()]
    assert len(stale) == 1 and "embedded-corpus cache" in stale[0] and "files[1].sha256" in stale[0]


def test_a_saved_tokenizer_of_another_tokenizer_is_replaced(bpe_tokenizer_dir, tmp_path, caplog):
    import logging

    from transformers import AutoTokenizer

    from orthros_train.data.tokenize import save_tokenizer_once

    a = AutoTokenizer.from_pretrained(bpe_tokenizer_dir(300))
    b = AutoTokenizer.from_pretrained(bpe_tokenizer_dir(400))
    folder = str(tmp_path / "cache")
    tok_dir = save_tokenizer_once(a, folder)
    assert len(AutoTokenizer.from_pretrained(tok_dir)) == len(a)
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        assert save_tokenizer_once(b, folder) == tok_dir
    assert len(AutoTokenizer.from_pretrained(tok_dir)) == len(b) != len(a)
    assert any("rebuilding the tokenizer cache" in r.getMessage() for r in caplog.records)
    assert save_tokenizer_once(b, folder) == tok_dir  # the same one again: reused


def test_an_interrupted_bpe_training_is_redone(tmp_path):
    from orthros_train.data.embedded import train_tokenizer

    docs = [f.read_text() for f in corpus_files("paul_graham")[:2]]
    tok = train_tokenizer(docs, 300, tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("bpe-") and p.is_dir()]
    (folder / "tokenizer.json").write_text("{")  # a copy cut short
    (folder / "fingerprint.json").unlink()
    again = train_tokenizer(docs, 300, tmp_path)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
