"""Pretraining loader: blend proportions, document boundaries, resume, data-parallel sharding."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import REPO, cli_env

from orthros_train.data import DataConfig, build_data
from orthros_train.data.blend import build_blend
from orthros_train.data.indexed import ShardWriter
from orthros_train.data.pretrain import IndexedPretrainData
from orthros_train.data.sampler import ResumableSampler
from orthros_train.errors import UserError
from orthros_train.phase.layout import IGNORE_INDEX

EOD = 0


def _synthetic(path: Path, n_docs: int, seed: int, low: int = 5, high: int = 60, base: int = 1) -> str:
    """A shard whose documents are runs of one token id (base + doc % 50), EOD-terminated."""
    rng = np.random.default_rng(seed)
    w = ShardWriter(str(path), vocab_size=1024)
    for d in range(n_docs):
        n = int(rng.integers(low, high))
        w.add_document(np.append(np.full(n, base + d % 50), EOD))
    w.finish()
    return str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    return [_synthetic(root / f"ds{k}", 300, seed=k, base=1 + 100 * k) for k in range(3)]


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    return [_synthetic(root / f"s{k}", 40, seed=10 + k, base=1 + 100 * k) for k in range(3)]


def _data(shards, chat_tokenizer, cache, weights=(5, 3, 2), mbs=4, rank=0, world=1, seq=32, samples=None, seed=7):
    splits = build_blend(shards, list(weights) if weights else None, seq, seed, 1024, EOD, str(cache),
                         split="95,5,0", train_samples=samples)
    return IndexedPretrainData(splits, chat_tokenizer, EOD, seq, mbs, seed, rank, world)


def test_blend_hits_requested_proportions(shards, tmp_path):
    splits = build_blend(shards, [0.5, 0.3, 0.2], 16, 1, 1024, EOD, str(tmp_path), split="98,2,0",
                         train_samples=10_000)
    assert len(splits.train) == 10_000
    ids = np.array([splits.train[i]["dataset_id"] for i in range(10_000)])
    share = np.bincount(ids, minlength=3) / ids.size
    assert np.all(np.abs(share - [0.5, 0.3, 0.2]) < 0.01), share
    head = np.bincount(ids[:1000], minlength=3) / 1000  # also every prefix, not just the total
    assert np.all(np.abs(head - [0.5, 0.3, 0.2]) < 0.01), head
    # the samples really come from the named dataset (its token ids live in its own range)
    for i in range(50):
        item = splits.train[i]
        body = item["tokens"][item["tokens"] != EOD]
        assert np.all((body > 100 * item["dataset_id"]) & (body <= 100 * item["dataset_id"] + 50))


def test_layout_documents_and_labels(shards, chat_tokenizer, tmp_path):
    data = _data(shards, chat_tokenizer, tmp_path)
    lay = data.next_batch()
    assert lay.num_rows == 4 and lay.num_tokens == 4 * 32 and lay.num_outputs == 4 * 32
    ids, labels = lay.input_ids, lay.labels
    doc = lay.document_ids()
    # documents are runs of one token, so a document of the layout never mixes token ids
    for d in range(int(doc.max()) + 1):
        body = ids[(doc == d) & (ids != EOD)]
        assert body.numel() == 0 or bool((body == body[0]).all())
    assert torch.equal(lay.positions[lay.cu_seqlens[:-1].long()], torch.zeros(lay.cu_seqlens.numel() - 1).long())
    # labels: the next token of the same document; EOD and a document's last token predict nothing
    same = torch.zeros_like(labels, dtype=torch.bool)
    same[:-1] = doc[1:] == doc[:-1]
    p = torch.nonzero(same & (ids != EOD)).flatten()
    assert torch.equal(labels[p], ids[p + 1])
    assert bool((labels[ids == EOD] == IGNORE_INDEX).all())
    assert bool((labels != IGNORE_INDEX).float().mean() > 0.8)


def test_resume_at_k_reproduces_the_rest_exactly(small_shards, chat_tokenizer, tmp_path):
    shards = small_shards
    small = _data(shards, chat_tokenizer, tmp_path, mbs=8)  # ~100 samples: the run wraps into epoch 2
    n = small.sampler.num_samples
    steps = n // 8 + 5
    ref = [small.next_batch() for _ in range(steps)]
    for k in (0, 3, steps - 4):
        fresh = _data(shards, chat_tokenizer, tmp_path, mbs=8)
        for _ in range(k):
            fresh.next_batch()
        state = json.loads(json.dumps(fresh.state_dict()))  # what a checkpoint stores
        resumed = _data(shards, chat_tokenizer, tmp_path, mbs=8)
        resumed.load_state_dict(state)
        for j in range(k, steps):
            got = resumed.next_batch()
            assert torch.equal(got.input_ids, ref[j].input_ids) and torch.equal(got.labels, ref[j].labels)
            assert torch.equal(got.cu_seqlens, ref[j].cu_seqlens)
    assert small.sampler.epoch >= 1  # the second epoch is reshuffled, not a replay
    first = [small.sampler.dataset_index(p) for p in range(n)]
    second = [small.sampler.dataset_index(p) for p in range(n, 2 * n)]
    assert sorted(first) == sorted(second) and first != second
    other_seed = _data(shards, chat_tokenizer, tmp_path, mbs=8, seed=8)
    with pytest.raises(UserError, match="seed"):
        other_seed.load_state_dict(state)


def test_two_ranks_see_disjoint_shares_of_the_global_batch(shards, chat_tokenizer, tmp_path):
    world = [_data(shards, chat_tokenizer, tmp_path, mbs=3, rank=r, world=2) for r in range(2)]
    single = _data(shards, chat_tokenizer, tmp_path, mbs=6)
    for _ in range(5):
        idx = [w.sampler.positions() for w in world]
        assert not set(idx[0]) & set(idx[1])
        assert sorted(idx[0] + idx[1]) == single.sampler.positions()
        a, b, both = world[0].next_batch(), world[1].next_batch(), single.next_batch()
        rows = both.input_ids.view(6, -1)
        assert torch.equal(a.input_ids.view(3, -1), rows[0::2]) and torch.equal(b.input_ids.view(3, -1), rows[1::2])
    assert world[0].consumed_samples == world[1].consumed_samples == single.consumed_samples == 30
    # a run resumed on another data-parallel size continues the same global stream
    two = _data(shards, chat_tokenizer, tmp_path, mbs=3, rank=1, world=2)
    two.load_state_dict(single.state_dict())
    assert torch.equal(two.next_batch().input_ids.view(3, -1), single.next_batch().input_ids.view(6, -1)[1::2])


def test_valid_batches_are_fixed_and_held_out(shards, chat_tokenizer, tmp_path):
    data = _data(shards, chat_tokenizer, tmp_path)
    v1, v2 = data.valid_batches(3), data.valid_batches(3)
    assert len(v1) == 3 and all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(v1, v2))
    valid_docs = set()
    for ds in data.valid.datasets:
        valid_docs |= {(ds.dataset_path, int(i)) for i in ds.indices}
    train_docs = set()
    for ds in data.train.datasets:
        train_docs |= {(ds.dataset_path, int(i)) for i in ds.indices}
    assert valid_docs and not valid_docs & train_docs


def test_sampler_rejects_bad_shapes():
    with pytest.raises(UserError):
        ResumableSampler(10, 2, 0, dp_rank=2, dp_size=2)
    with pytest.raises(UserError):
        ResumableSampler(0, 2, 0)


def test_build_data_selects_indexed_blend(shards, chat_tokenizer_dir, tmp_path):
    tok = chat_tokenizer_dir
    cfg = DataConfig(source="indexed", paths=shards[:2], weights=[3.0, 1.0], tokenizer=str(tok),
                     cache_dir=str(tmp_path / "cache"), split="90,10,0", train_samples=2000)
    data = build_data(cfg, seq_len=16, micro_batch_size=4, seed=1)
    assert isinstance(data, IndexedPretrainData) and data.eod_token_id == 0 and data.vocab_size == len(data.tokenizer)
    ids = [data.train[i]["dataset_id"] for i in range(2000)]
    assert abs(np.mean(ids) - 0.25) < 0.01
    assert data.next_batch().num_tokens == 64 and data.valid_batches(1)
    with pytest.raises(UserError, match="weights has 1 entries for 2"):
        DataConfig(source="indexed", paths=shards[:2], weights=[1.0])
    with pytest.raises(UserError, match="needs data.paths"):
        DataConfig(source="indexed")


def test_embedded_default_goes_through_the_indexed_pipeline(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    data = build_data(cfg, seq_len=128, micro_batch_size=2, seed=0)
    assert isinstance(data, IndexedPretrainData)
    summaries = list((tmp_path / "embedded").glob("*/corpus.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text())["documents"] == 49
    lay = data.next_batch()
    assert lay.num_tokens == 256 and data.valid_batches(2)
    text = data.tokenizer.decode(lay.input_ids[:64].tolist())
    assert len(text) > 100
    again = build_data(cfg, seq_len=128, micro_batch_size=2, seed=0)  # cached: same batches
    assert torch.equal(again.next_batch().input_ids, lay.input_ids)


_DIST_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from orthros_train.data import DataConfig, build_data

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    paths, tok, cache, out = sys.argv[1:5]
    cfg = DataConfig(source="indexed", paths=paths.split(","), weights=[1.0, 1.0], tokenizer=tok, cache_dir=cache,
                     train_samples=500)
    data = build_data(cfg, seq_len=16, micro_batch_size=2, seed=3, dp_rank=rank, dp_size=world)
    rows = []
    for _ in range(10):
        rows += data.next_batch().input_ids.view(2, -1).tolist()
    picks = [data.sampler.dataset_index(p) for p in range(rank, 40, world)]
    json.dump({"rows": rows, "picks": picks}, open(f"{out}/rank{rank}.json", "w"))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_two_processes_gloo_disjoint_and_cache_built_once(shards, chat_tokenizer_dir, tmp_path):
    tok = chat_tokenizer_dir
    script = tmp_path / "dist_data.py"
    script.write_text(_DIST_SCRIPT)
    env = cli_env(PYTHONPATH=str(REPO))
    with socket.socket() as sock:  # a free port: other tests may run torchrun at the same time
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           str(script), ",".join(shards[:2]), str(tok), str(tmp_path / "cache"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert not set(r0["picks"]) & set(r1["picks"])
    assert len(r0["rows"]) == len(r1["rows"]) == 20
    single = build_data(DataConfig(source="indexed", paths=shards[:2], weights=[1.0, 1.0], tokenizer=str(tok),
                                   cache_dir=str(tmp_path / "cache"), train_samples=500), 16, 4, 3)
    rows = []
    for _ in range(10):
        rows += single.next_batch().input_ids.view(4, -1).tolist()
    assert rows[0::2] == r0["rows"] and rows[1::2] == r1["rows"]
