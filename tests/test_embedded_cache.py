"""The embedded corpus cache is shared by every checkout on a machine without clashing."""

from __future__ import annotations

import shutil

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
