"""Derived caches know their inputs: data rewritten in place gets fresh indices, builds take turns."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import write_jsonl
from fixtures import run_train

from data_tools.cli import main as data_main
from orthros_train.data import DataConfig, build_data
from orthros_train.data.cache import BuildLock, build_once, read_fingerprint

WORDS = ("apple", "river", "stone", "cloud", "ember", "frost", "grove", "harbor", "island", "jungle")


def _corpus(path: Path, n_docs: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    rows = [{"text": " ".join(rng.choice(WORDS, size=int(rng.integers(5, 80))).tolist())} for _ in range(n_docs)]
    return write_jsonl(path, rows)


@pytest.fixture
def tok(bpe_tokenizer_dir) -> str:
    """A 512-token BPE without a chat template."""
    return bpe_tokenizer_dir(512, chat_template=False)


def _samples(prefix: Path, tok: str, cache: Path, n_batches: int = 30) -> list[list[int]]:
    cfg = DataConfig(source="indexed", paths=[str(prefix)], tokenizer=tok, cache_dir=str(cache), split="100,0,0")
    data = build_data(cfg, 16, 4, 1)
    rows = []
    for _ in range(n_batches):
        rows += data.next_batch().input_ids.view(4, -1).tolist()
    return rows


def test_retokenized_prefix_gets_fresh_indices_not_the_stale_cache(tok, tmp_path, caplog):
    """The documented workflow: tokenize, train, tokenize other data into the same prefix with
    --overwrite, train again with the same cache_dir. The second run must read the new data
    (exactly what a fresh cache gives), not samples cut by the old data's index."""
    prefix = tmp_path / "data" / "corpus"
    cache = tmp_path / "cache"
    args = ["--tokenizer", tok, "--output", str(prefix), "--no-progress"]
    assert data_main(["tokenize", str(_corpus(tmp_path / "a.jsonl", 40, seed=1)), *args]) == 0
    old = _samples(prefix, tok, cache)
    assert data_main(["tokenize", str(_corpus(tmp_path / "b.jsonl", 120, seed=2)), *args, "--overwrite"]) == 0
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        new = _samples(prefix, tok, cache)
    fresh = _samples(prefix, tok, tmp_path / "fresh_cache")
    assert new == fresh and new != old
    stale = [r.getMessage() for r in caplog.records if "no longer matches its inputs" in r.getMessage()]
    assert len(stale) == 1 and "sample-index cache" in stale[0] and str(cache) in stale[0]
    assert "inputs[0].idx.size" in stale[0]
    # the old data's folder is left alone, the new one records what it was built from
    folders = sorted(p for p in (cache / "indices").iterdir() if p.is_dir())
    assert len(folders) == 2
    assert all(read_fingerprint(str(f))["inputs"][0]["prefix"].endswith("corpus_00000") for f in folders)


@pytest.mark.slow
def test_retrain_after_retokenize_with_the_same_cache_dir(tok, tmp_path):
    """The trainer itself: two steps on the old data, re-tokenize, two steps on the new one."""
    prefix = tmp_path / "data" / "corpus"
    args = ["--tokenizer", tok, "--output", str(prefix), "--no-progress"]
    assert data_main(["tokenize", str(_corpus(tmp_path / "a.jsonl", 30, seed=3)), *args]) == 0

    def train(run: str) -> subprocess.CompletedProcess:
        return run_train(
            "--config-name", "tiny_cpu", "data=indexed_blend", f"data.paths=[{prefix}]", f"data.tokenizer={tok}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer_vocab_size=512", "data.split='90,10,0'",
            "trainer.max_steps=2", "trainer.eval_every=0", "trainer.progress=false", "trainer.sample_prompt=null",
            "trainer.wandb.enabled=false", "model.hidden_size=64", "model.num_hidden_layers=1",
            "trainer.seq_len=64", "trainer.micro_batch_size=2", "trainer.global_batch_size=null",
            f"trainer.run_dir={tmp_path / run}", cwd=tmp_path,
        )  # fmt: skip

    first = train("run1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert data_main(["tokenize", str(_corpus(tmp_path / "b.jsonl", 150, seed=4)), *args, "--overwrite"]) == 0
    second = train("run2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "no longer matches its inputs" in second.stdout + second.stderr  # Hydra logs to stdout
    assert len((tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()) == 2


def test_an_interrupted_build_leaves_no_cache_and_is_redone(tmp_path):
    folder = str(tmp_path / "c" / "thing")
    calls = []

    def crash(path):
        Path(path, "half.npy").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_once(folder, {"v": 1}, crash, lambda p: "loaded", "test")
    assert not os.path.exists(folder) and os.listdir(tmp_path / "c") == []

    def build(path):
        calls.append(path)
        Path(path, "data").write_text("ok")
        return "built"

    assert build_once(folder, {"v": 1}, build, lambda p: "loaded", "test") == "built"
    assert build_once(folder, {"v": 1}, build, lambda p: "loaded", "test") == "loaded"
    assert len(calls) == 1 and Path(folder, "data").read_text() == "ok"


def test_a_folder_with_another_fingerprint_is_rebuilt_with_a_log_line(tmp_path, caplog):
    folder = str(tmp_path / "thing")
    build_once(folder, {"v": 1}, lambda p: Path(p, "a").write_text("1"), lambda p: None, "test")
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        build_once(folder, {"v": 2}, lambda p: Path(p, "a").write_text("2"), lambda p: None, "test")
    assert Path(folder, "a").read_text() == "2" and read_fingerprint(folder) == {"v": 2}
    assert any(f"rebuilding the test cache {folder}" in r.getMessage() and "v: 1 -> 2" in r.getMessage()
               for r in caplog.records)


def test_concurrent_builders_take_turns(tmp_path):
    """Four threads race to build one folder: one builds, the others wait and load its result."""
    folder = str(tmp_path / "shared")
    active, peak, builds, results = [0], [0], [], []
    guard = threading.Lock()

    def build(path):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        Path(path, "v").write_text("done")
        builds.append(path)
        with guard:
            active[0] -= 1
        return "built"

    def go():
        results.append(build_once(folder, {"k": 1}, build, lambda p: Path(p, "v").read_text(), "test"))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and len(builds) == 1
    assert sorted(results) == ["built", "done", "done", "done"]
    assert not os.path.exists(folder + ".lock")


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    path = str(tmp_path / "x.lock")
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    Path(path).write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "started": 0, "token": "t"}))
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        with BuildLock(path, stale_after=60, timeout=5):
            assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert not os.path.exists(path)
    assert any("taking over the lock" in r.getMessage() and f"pid {dead}" in r.getMessage()
               and "on this host is gone" in r.getMessage() for r in caplog.records)


def test_a_lock_without_heartbeat_from_another_host_goes_stale(tmp_path, caplog):
    path = str(tmp_path / "y.lock")
    Path(path).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0, "token": "t"}))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="orthros_train.data.cache"):
        with BuildLock(path, stale_after=0.5, poll=0.05, timeout=10):
            pass
    assert 0.4 < time.monotonic() - t0 < 5
    assert any("heartbeat is" in r.getMessage() and "host elsewhere" in r.getMessage() for r in caplog.records)


def test_a_live_holder_keeps_its_lock_while_it_beats(tmp_path):
    path = str(tmp_path / "z.lock")
    holder = BuildLock(path, stale_after=0.6, heartbeat=0.1)
    holder.acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still held by host .*, pid"):
            with BuildLock(path, stale_after=0.6, poll=0.05, timeout=1.5):
                pass
        assert time.monotonic() - t0 >= 1.4
    finally:
        holder.release()
    assert not os.path.exists(path)


def test_an_unwritable_cache_dir_is_named(tmp_path):
    from orthros_train.data.blend import build_blend
    from orthros_train.data.indexed import DataError, ShardWriter

    prefix = str(tmp_path / "ds")
    writer = ShardWriter(prefix, 1000)
    for _ in range(20):
        writer.add_document(np.arange(1, 40))
    writer.finish()
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder should be")
    with pytest.raises(DataError, match=f"cannot create the sample-index cache folder {blocker}.*data.cache_dir"):
        build_blend([prefix], None, 16, 0, 1000, 0, str(blocker))
    with pytest.raises(DataError, match="x.lock: cannot create its folder .*must be writable"):
        BuildLock(str(blocker / "x.lock")).acquire()
    assert blocker.read_text() == "a file where the cache folder should be"
