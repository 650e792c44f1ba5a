"""Publishing into a folder that was new: a second writer that filled it first is not replaced.

Two conversions into the same new destination both passed the "destination is empty" check at
their start; the one that finished last used to swap the other's finished model out and both
reported success. The last one is now refused (``FolderTakenError`` -> ``ConversionError``) and
the first one's model stays, whole.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from fixtures import TINY_HF_SHAPE

from orthros_train.common import publish
from orthros_train.common.publish import FolderTakenError, begin, swap_into_place
from orthros_train.convert import destination
from orthros_train.convert.checkpoint_io import ConversionError
from orthros_train.convert.from_hf import convert_from_hf

transformers = pytest.importorskip("transformers")


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def test_a_build_is_not_published_over_a_folder_filled_meanwhile(tmp_path):
    target = tmp_path / "out"
    built = begin(target)
    (built / "mine.txt").write_text("late writer")
    target.mkdir()
    (target / "theirs.txt").write_text("first writer")  # another writer published while we built
    with pytest.raises(FolderTakenError, match="filled by another writer"):
        swap_into_place(built, target, replace=False)
    assert checksums(target).keys() == {"theirs.txt"}


def test_a_build_replaces_an_empty_or_missing_folder_when_new(tmp_path):
    for exists in (False, True):
        target = tmp_path / f"out{int(exists)}"
        if exists:
            target.mkdir()
        built = begin(target)
        (built / "a.txt").write_text("new")
        swap_into_place(built, target, replace=False)
        assert (target / "a.txt").read_text() == "new"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{target.name}.")) == []


def _hf_model(seed: int, path: Path) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_a_second_conversion_into_the_same_new_folder_keeps_the_first(tmp_path, monkeypatch):
    hf1, hf2 = _hf_model(0, tmp_path / "hf1"), _hf_model(1, tmp_path / "hf2")
    convert_from_hf(hf2, tmp_path / "alone", sliding_window=16)
    dst = tmp_path / "dst"
    real_carry = destination.carry_over

    def other_conversion_finishes_first(previous, built, names):
        monkeypatch.setattr(destination, "carry_over", real_carry)
        convert_from_hf(hf2, dst, sliding_window=16)  # started after ours, done before our swap
        return real_carry(previous, built, names)

    monkeypatch.setattr(destination, "carry_over", other_conversion_finishes_first)
    with pytest.raises(ConversionError, match="written by another process while this conversion ran.*--overwrite"):
        convert_from_hf(hf1, dst, sliding_window=16)
    want = checksums(tmp_path / "alone")
    got = checksums(dst)
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in got if k != destination.MANIFEST)  # the first one's model, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst.")] == []  # our build deleted
    assert publish.leftovers(dst) == {}
