"""Hostile inputs to the floor (``orthros_train.common``) and its callers: lock files that are not
lock files, weights folders that are not weights, tokenizer paths that hold no tokenizer and
overrides of the wrong kind. Each must end in one clear line, or be handled, never hang or spin."""

from __future__ import annotations

import os
import time

import pytest

from orthros_train.common.lock import HeartbeatLock, read_owner
from orthros_train.errors import UserError
from orthros_train.train.run_lock import RunLock, RunLockedError


def _odd_lock(kind: str, path) -> None:
    if kind == "dangling symlink":
        os.symlink(path.parent / "nowhere", path)
    elif kind == "symlink loop":
        os.symlink(path, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()


ODD_LOCKS = ("dangling symlink", "symlink loop", "fifo", "directory")


@pytest.mark.parametrize("kind", ODD_LOCKS)
def test_run_lock_refuses_an_odd_lock_file_at_once(tmp_path, kind):
    """A name that exists but is no lock file was a busy spin (the stat through a dangling symlink
    said "released", forever) or a blocking read (a FIFO); now it is refused in one line."""
    _odd_lock(kind, tmp_path / "run.lock")
    assert read_owner(tmp_path / "run.lock") is None
    start = time.monotonic()
    with pytest.raises(RunLockedError, match="not a readable lock file.*rm -r"):
        RunLock(tmp_path).acquire()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("kind", ODD_LOCKS)
def test_waiting_lock_takes_an_odd_stale_lock_file_over(tmp_path, kind, caplog):
    """A waiter judges such a name by its own age (``lstat``) and takes it over once stale; a
    directory that stood there is kept aside and named, never deleted."""
    path = tmp_path / "build.lock"
    _odd_lock(kind, path)
    if kind == "directory":
        (path / "notes.txt").write_text("mine")
    old = time.time() - 3600
    os.utime(path, (old, old), follow_symlinks=False)
    lock = HeartbeatLock(path, stale_after=1.0, heartbeat=0.1, timeout=10, poll=0.01)
    with caplog.at_level("WARNING"):
        lock.acquire()
    try:
        assert read_owner(path) is not None and read_owner(path).token == lock.owner.token
    finally:
        lock.release()
    assert not path.exists() and not path.is_symlink()
    kept = list(tmp_path.glob(".build.lock.stale-*"))
    if kind == "directory":
        assert [(k / "notes.txt").read_text() for k in kept] == ["mine"]
        assert f"it is kept as {kept[0]}" in caplog.text
    else:
        assert kept == []


# -- weights folders -------------------------------------------------------------------------------


def _weights(directory, name: str = "model.safetensors", **extra) -> None:
    import safetensors.torch
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({"a": torch.ones(2), **extra}, str(directory / name))


def test_a_directory_named_like_a_shard_is_not_read_as_one(tmp_path):
    """``model.safetensors/`` (a folder) was opened as a weights file and called truncated."""
    from orthros_train.common.safetensors_io import NoSafetensorsError, SafetensorsReader, check_safetensors_files

    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(NoSafetensorsError, match="no \\*.safetensors weights"):
        SafetensorsReader(tmp_path)
    check_safetensors_files(tmp_path)  # nothing to check, nothing to refuse
    _weights(tmp_path, "only.safetensors")
    assert list(SafetensorsReader(tmp_path)) == ["a"]


def test_the_reader_is_a_mapping_get_gives_a_default_and_indexing_names_the_missing_tensor(tmp_path):
    import torch

    from orthros_train.common.safetensors_io import SafetensorsReader

    _weights(tmp_path, "model.safetensors")
    with SafetensorsReader(tmp_path) as reader:
        assert torch.equal(reader["a"], torch.ones(2)) and torch.equal(reader.get("a"), torch.ones(2))
        assert reader.get("b") is None and reader.get("b", 0) == 0 and "b" not in reader
        with pytest.raises(KeyError, match="the checkpoint has no tensor 'b'"):
            reader["b"]


def test_an_index_naming_an_empty_shard_is_refused_as_an_index(tmp_path):
    """An empty shard name pointed at the folder itself ("missing: <the folder's name>")."""
    import json

    from orthros_train.common.safetensors_io import SafetensorsFileError, SafetensorsReader

    _weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": ""}}))
    with pytest.raises(SafetensorsFileError, match="has no 'weight_map' of tensor names to shard files"):
        SafetensorsReader(tmp_path)


def test_loading_weights_that_hold_nan_names_the_tensor():
    """NaN weights (a diverged run's checkpoint, corrupted bytes) used to load and train a NaN model
    to the end, every update skipped, the NaN saved as the final checkpoint."""
    import torch
    from fixtures import tiny_config

    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.setup import DistributedEnv, ParallelConfig, destroy_parallel, init_parallel
    from orthros_train.parallel.state_dict import load_reference_shards

    cfg = tiny_config(64)
    init_parallel(ParallelConfig(backend="gloo"), cfg, DistributedEnv())
    try:
        model = build_parallel_model(cfg, ParallelConfig(), seed=0)
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
        state["norm.weight"][0] = float("inf")
        with pytest.raises(UserError, match="norm.weight holds NaN or infinite values"):
            load_reference_shards(build_parallel_model(cfg, ParallelConfig(), seed=None), state, cfg)
        state["norm.weight"][0] = 1.0
        load_reference_shards(build_parallel_model(cfg, ParallelConfig(), seed=None), state, cfg)
    finally:
        destroy_parallel()
    assert torch.isfinite(state["norm.weight"]).all()


# -- trainer switches --------------------------------------------------------------------------------


def test_zero_sample_tokens_generates_nothing_and_negative_is_refused():
    """``trainer.sample_tokens=0`` crashed the end of a finished run (``torch.stack([])``)."""
    import torch
    from fixtures import tiny_model

    from orthros_train.train.config import TrainerConfig

    model = tiny_model(64).eval()
    ids = torch.zeros((2, 5), dtype=torch.long)
    new = model.generate_greedy(ids, 0)
    assert new.shape == (2, 0) and new.dtype == ids.dtype
    with pytest.raises(UserError, match="trainer.sample_tokens=-1 must be >= 0"):
        TrainerConfig(sample_tokens=-1)


def test_a_run_dir_that_is_a_file_is_named_as_one(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(UserError, match=r"trainer.run_dir=.*run is a file, not a directory"):
        RunLock(tmp_path / "run").acquire()
    assert (tmp_path / "run").read_text() == "not a directory"


# -- tokenizer paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["{}", "garbage{", "\x00\x01"])
def test_a_json_file_that_is_no_tokenizer_is_one_line(tmp_path, content):
    """A ``*.json`` file the tokenizers library cannot parse raised its bare ``Exception``."""
    from orthros_train.common.tokenizer import TokenizerError, load_tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(TokenizerError, match=rf"{path}: not a tokenizer.json a fast tokenizer can read"):
        load_tokenizer(path)


def test_a_tokenizer_path_that_is_another_file_or_empty_is_named_as_such(tmp_path):
    from orthros_train.common.tokenizer import TokenizerError, load_tokenizer

    path = tmp_path / "vocab.txt"
    path.write_text("a\nb\n")
    with pytest.raises(TokenizerError, match="is a file but not a tokenizer.json"):
        load_tokenizer(path)
    assert load_tokenizer(path, required=False) is None
    with pytest.raises(TokenizerError, match="the tokenizer path is empty"):
        load_tokenizer("")
    assert load_tokenizer("", required=False) is None


# -- overrides ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("=5", r"--override '=5' must look like key=value \(the key is empty\)"),
        ("rope_scaling=[1,2]", r"rope_scaling=\[1, 2\]: expected dict\[str, any\] or null"),
        ("vocab_size=99999999999999999999", r"vocab_size=99999999999999999999: too large"),
        ("sliding_window=NaN", r"sliding_window=nan: expected int"),
        ("rope_theta=-Infinity", r"rope_theta=-inf: must be a finite number"),
    ],
)
def test_eval_overrides_name_the_key_and_value(item, message):
    """An empty key read "unknown key  in --override", a list for a dict field "='?': expected any",
    an integer past int64 passed and crashed in torch as an internal error."""
    from orthros_train.eval.common import parse_overrides

    with pytest.raises(UserError, match=message):
        parse_overrides([item])


def test_an_override_the_model_config_refuses_is_named_not_the_config_file(tmp_path):
    """``--override sliding_window=-1`` was reported as "config.json: not an Orthros model config"."""
    from fixtures import tiny_model

    from orthros_train.eval.common import parse_overrides
    from orthros_train.infer.loading import load_checkpoint

    tiny_model(64).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"config.json with the overrides sliding_window=-1: .*sliding_window must be"):
        load_checkpoint(tmp_path, **parse_overrides(["sliding_window=-1"]))
    assert load_checkpoint(tmp_path).config.vocab_size == 64


# -- parallel.compile --------------------------------------------------------------------------------


def test_compile_without_a_cpp_compiler_is_refused_before_the_run(monkeypatch):
    """Without g++ the lazy ``torch.compile`` failed inside the first step as an internal error."""
    import importlib.util

    from torch._inductor import cpp_builder

    from orthros_train.parallel.compile import check_compile_toolchain

    def missing():
        raise RuntimeError("No working C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(UserError, match="parallel.compile=true: no working C\\+\\+ compiler.*parallel.compile=false"):
        check_compile_toolchain("cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match="parallel.compile=true: triton is not installed"):
        check_compile_toolchain("cuda")
    check_compile_toolchain("mps")  # no inductor toolchain to check
