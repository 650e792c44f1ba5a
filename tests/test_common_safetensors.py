"""The one safetensors reader and the one sharded writer (``orthros_train.common.safetensors_io``)."""

from __future__ import annotations

import json
import os
import stat

import pytest
import safetensors.torch
import torch

from orthros_train.common.safetensors_io import (
    INDEX_NAME,
    WEIGHTS_NAME,
    NoSafetensorsError,
    SafetensorsFileError,
    SafetensorsReader,
    ShardedSafetensorsWriter,
    check_safetensors_files,
    save_safetensors,
)
from orthros_train.errors import UserError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed_tokens.weight": torch.randn(16, 8, generator=g),  # 512 bytes
        "layers.0.q_proj.weight": torch.randn(8, 8, generator=g).bfloat16(),  # 128 bytes
        "layers.0.gamma": torch.ones(2),
        "norm.weight": torch.arange(8, dtype=torch.int32),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def _write(directory, max_bytes, **kwargs):
    with ShardedSafetensorsWriter(directory, max_bytes, **kwargs) as writer:
        for name, tensor in _tensors().items():
            writer.add(name, tensor)
        return writer.finish()


def _same(reader: SafetensorsReader) -> None:
    expected = _tensors()
    assert sorted(reader.names) == sorted(expected)
    for name, tensor in expected.items():
        assert reader.info(name).shape == tuple(tensor.shape) and reader.info(name).dtype == tensor.dtype
        assert torch.equal(reader[name], tensor)


def _one_line_user_error(err: pytest.ExceptionInfo) -> str:
    assert isinstance(err.value, UserError)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_single_file_round_trip(tmp_path):
    files = _write(tmp_path, 1 << 20)
    assert files == [tmp_path / WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_NAME]  # no index, no temporary left
    with safetensors.safe_open(str(files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with SafetensorsReader(tmp_path) as reader:
        _same(reader)
        assert "norm.weight" in reader and "nope" not in reader and len(reader) == 5
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            reader["nope"]
    _same(SafetensorsReader(files[0]))  # a file by path


def test_sharded_round_trip_and_index(tmp_path):
    files = _write(tmp_path, 600)
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [f.name for f in files] == names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, INDEX_NAME])
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index == {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in _tensors().values())},
        "weight_map": {
            "embed_tokens.weight": names[0],
            "layers.0.q_proj.weight": names[1],  # 512 + 128 > 600: a new shard
            "layers.0.gamma": names[1],
            "norm.weight": names[1],
            "lm_head.weight": names[2],
        },
    }
    for name, file in index["weight_map"].items():
        assert name in safetensors.torch.load_file(tmp_path / file)
    _same(SafetensorsReader(tmp_path))


def test_trainer_style_names_extra_index_fields_and_a_stale_file(tmp_path):
    files = _write(tmp_path, 600, stem="optimizer", of_total=False, single_name=None, index_name="index.json",
                   metadata=None)  # fmt: skip
    assert [f.name for f in files] == [f"optimizer-{i:05d}.safetensors" for i in (1, 2, 3)]
    safetensors.torch.save_file({"stale": torch.ones(1)}, tmp_path / "optimizer-00009.safetensors")
    reader = SafetensorsReader(tmp_path, index_name="index.json")  # files the index does not list are ignored
    _same(reader)
    writer = ShardedSafetensorsWriter(tmp_path / "one", 1 << 20, single_name=None, index_name="index.json")
    writer.add("a", torch.ones(3))
    writer.finish({"step": 7})
    index = json.loads((tmp_path / "one" / "index.json").read_text())
    assert index["step"] == 7 and index["weight_map"] == {"a": "model-00001-of-00001.safetensors"}


def test_a_failed_write_leaves_no_shard_behind(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardedSafetensorsWriter(tmp_path, 600) as writer:
            for name, tensor in _tensors().items():
                writer.add(name, tensor)
                if name == "lm_head.weight":
                    raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_missing_shard_is_a_one_line_error_naming_it(tmp_path):
    files = _write(tmp_path, 600)
    files[1].unlink()
    with pytest.raises(SafetensorsFileError) as err:
        SafetensorsReader(tmp_path, fix="point at a complete checkpoint")
    message = _one_line_user_error(err)
    assert files[1].name in message and "again" in message and message.endswith("point at a complete checkpoint")


def test_index_entry_without_its_tensor_is_named(tmp_path):
    _write(tmp_path, 600)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(SafetensorsFileError, match=r"ghost\.weight in model-00001-of-00003") as err:
        SafetensorsReader(tmp_path)
    _one_line_user_error(err)
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(SafetensorsFileError, match="not a readable index") as err:
        SafetensorsReader(tmp_path)
    _one_line_user_error(err)


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.999])
def test_corrupt_header_is_a_one_line_error_naming_the_file(tmp_path, keep):
    path = save_safetensors(_tensors(), tmp_path / WEIGHTS_NAME)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    for read in (lambda: SafetensorsReader(tmp_path), lambda: check_safetensors_files(tmp_path)):
        with pytest.raises(SafetensorsFileError, match=r"model\.safetensors \(.* bytes\) is not a readable") as err:
            read()
        assert "truncated or corrupt" in _one_line_user_error(err)


def test_no_weights_and_unindexed_shards_are_named(tmp_path):
    with pytest.raises(NoSafetensorsError, match="does not exist"):
        SafetensorsReader(tmp_path / "nowhere")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(NoSafetensorsError, match="safe_serialization=True"):
        SafetensorsReader(tmp_path)
    _write(tmp_path, 600)
    (tmp_path / INDEX_NAME).unlink()
    with pytest.raises(SafetensorsFileError, match="3 \\*.safetensors files but no model.safetensors.index.json"):
        SafetensorsReader(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_file_modes_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        _write(tmp_path / "sharded", 600)
        save_safetensors({"a": torch.ones(2)}, tmp_path / "single.safetensors")
    finally:
        os.umask(old)
    for path in [*(tmp_path / "sharded").iterdir(), tmp_path / "single.safetensors"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name
