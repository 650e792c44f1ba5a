"""orthros-data tokenize: round trip on real essays, shards, resume, summary, inspect, CLI."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from data_helpers import essay_files, essays

from data_tools.cli import main as cli_main
from data_tools.pretokenize import TokenizeOptions, run
from orthros_train.data.blend import build_blend
from orthros_train.data.indexed import ShardWriter, open_indexed, read_index_header, resolve_prefixes


@pytest.fixture(scope="module")
def essays_out(chat_tokenizer_dir, tmp_path_factory):
    """The 49 essays tokenized by 2 worker processes into shards of 20 documents."""
    out = str(tmp_path_factory.mktemp("essays") / "essays")
    summary = run(TokenizeOptions([str(essay_files()[0].parent)], chat_tokenizer_dir, out, workers=2, docs_per_shard=20,
                                  batch_size=8, progress=False))
    return out, summary


def _decode_docs(chat_tokenizer, prefix: str, eod: int) -> list[str]:
    ds = open_indexed(prefix)
    out = []
    for i in range(len(ds)):
        ids = ds[i]
        assert ids[-1] == eod, "every document ends with the EOD token"
        out.append(chat_tokenizer.decode(ids[:-1].tolist()))
    return out


def test_round_trip_documents_in_order(essays_out, chat_tokenizer):
    out, summary = essays_out
    eod = summary["tokenizer"]["eod_token_id"]
    prefixes = resolve_prefixes(out)
    assert [os.path.basename(p) for p in prefixes] == ["essays_00000", "essays_00001", "essays_00002"]
    decoded = [d for p in prefixes for d in _decode_docs(chat_tokenizer, p, eod)]
    assert decoded == essays()  # byte-level BPE is lossless: the exact files, in order
    assert summary["complete"] and summary["documents"] == 49 and summary["records"] == 49
    assert summary["tokens"] == sum(read_index_header(p).num_tokens for p in prefixes)
    assert summary["tokenizer"]["vocab_size"] == len(chat_tokenizer)
    assert len(summary["source"]["fingerprint"]) == 64 and summary["skipped"] == {}


def test_round_trip_through_packed_sequences(essays_out, chat_tokenizer, tmp_path):
    """indexed dataset -> megatron packed samples (seq_len + 1) -> the documents, in sample order."""
    out, summary = essays_out
    eod = summary["tokenizer"]["eod_token_id"]
    prefix = resolve_prefixes(out)[0]
    seq = 256
    splits = build_blend([prefix], None, seq, seed=3, vocab_size=len(chat_tokenizer), eod_token_id=eod,
                         cache_dir=str(tmp_path), split="100,0,0")
    gpt = splits.train.dataset
    inverse = np.argsort(np.asarray(gpt.shuffle_index))  # sample j of the unshuffled stream
    stream = []
    for j in range(len(gpt)):
        item = gpt[int(inverse[j])]
        tokens, doc = item["tokens"], item["doc"]
        assert tokens.shape == (seq + 1,) and item["pad"] == 0
        # a new document starts exactly after each EOD token
        assert np.array_equal(np.flatnonzero(np.diff(doc)), np.flatnonzero(tokens[:-1] == eod))
        stream.append(tokens if j == len(gpt) - 1 else tokens[:-1])
    stream = np.concatenate(stream)
    order = [int(d) for d in gpt.document_index]  # megatron's shuffled document order
    assert sorted(order) == list(range(20))
    ds = open_indexed(prefix)
    assert np.array_equal(stream, np.concatenate([ds[d] for d in order])[: stream.size])
    pieces = chat_tokenizer.decode(stream.tolist()).split("<|endoftext|>")
    docs = essays()[:20]
    assert pieces[:-1] == [docs[d] for d in order[: len(pieces) - 1]]
    assert docs[order[len(pieces) - 1]].startswith(pieces[-1])  # the last sample ends mid-document


def test_resume_skips_finished_shards_and_matches_a_clean_run(essays_out, chat_tokenizer_dir, tmp_path, monkeypatch):
    ref_out, _ = essays_out
    out = str(tmp_path / "essays")
    opts = TokenizeOptions([str(essay_files()[0].parent)], chat_tokenizer_dir, out, docs_per_shard=20, progress=False)
    calls = {"n": 0}
    real_finish = ShardWriter.finish

    def crash_on_third(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated crash")
        real_finish(self)

    monkeypatch.setattr(ShardWriter, "finish", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        run(opts)
    monkeypatch.setattr(ShardWriter, "finish", real_finish)
    partial = json.loads(open(out + ".json").read())
    assert not partial["complete"] and [s["index"] for s in partial["shards"]] == [0, 1]
    assert not any(f.endswith(".tmp.bin") or f.endswith(".tmp.idx") for f in os.listdir(tmp_path))
    with pytest.raises(Exception, match="did not finish"):
        resolve_prefixes(out)
    mtime = os.path.getmtime(out + "_00000.bin")
    summary = run(opts)
    assert summary["complete"] and summary["documents"] == 49
    assert os.path.getmtime(out + "_00000.bin") == mtime  # finished shards were kept, not rewritten
    for k in range(3):  # one worker or two, crash or not: the same bytes
        for ext in (".bin", ".idx"):
            a = open(f"{ref_out}_{k:05d}{ext}", "rb").read()
            assert a == open(f"{out}_{k:05d}{ext}", "rb").read()
    assert run(opts)["complete"]  # a third run has nothing to do


def test_rerun_with_other_settings_is_refused(essays_out, chat_tokenizer_dir):
    out, _ = essays_out
    opts = TokenizeOptions([str(essay_files()[0].parent)], chat_tokenizer_dir, out, docs_per_shard=10, progress=False)
    with pytest.raises(Exception, match="other inputs, tokenizer or settings"):
        run(opts)


def test_jsonl_parquet_and_txt_inputs_mix(chat_tokenizer_dir, chat_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps({"text": "first doc", "id": 1}), "", json.dumps({"text": "second"})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines))
    pq.write_table(pa.table({"body": ["third doc", "fourth"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("fifth: a whole file\nwith two lines\n")
    out = str(tmp_path / "out" / "mixed")
    with pytest.raises(Exception, match="no 'text' field"):  # the parquet column is called body
        run(TokenizeOptions([str(tmp_path / n) for n in ("a.jsonl", "b.parquet")], chat_tokenizer_dir, out,
                            progress=False))
    (tmp_path / "b.parquet").unlink()
    pq.write_table(pa.table({"text": ["third doc", "fourth"]}), tmp_path / "b.parquet")
    summary = run(TokenizeOptions([str(tmp_path / n) for n in ("a.jsonl", "b.parquet", "c.txt")], chat_tokenizer_dir,
                                  out, progress=False, overwrite=True))
    eod = summary["tokenizer"]["eod_token_id"]
    assert _decode_docs(chat_tokenizer, resolve_prefixes(out)[0], eod) == [
        "first doc", "second", "third doc", "fourth", "fifth: a whole file\nwith two lines\n"]


def test_cli_tokenize_and_inspect(chat_tokenizer_dir, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"document number {i} " * (i + 1)})
                                                 for i in range(30)))
    out = str(tmp_path / "o" / "docs")
    assert cli_main(["tokenize", str(tmp_path / "d.jsonl"), "--tokenizer", chat_tokenizer_dir, "--output", out,
                     "--docs-per-shard", "7", "--no-progress"]) == 0
    assert "30 documents" in capsys.readouterr().out
    assert len(resolve_prefixes(out)) == 5
    assert cli_main(["inspect", out, "--sample", "3"]) == 0
    report = capsys.readouterr().out
    assert "pretrain data, 5 shard(s), 30 documents" in report
    assert "histogram" in report and "document number 3 document number 3" in report
    assert cli_main(["inspect", out, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["documents"] == 30 and sum(c for _, _, c in data["histogram"]) == 30


def test_save_to_disk_folders_are_read_as_datasets(plain_tokenizer_dir, tmp_path):
    import datasets

    from data_tools.pretokenize import TokenizeOptions, run

    tok = plain_tokenizer_dir
    texts = [f"document number {i} about startups and essays" for i in range(5)]
    single = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(single))
    both = tmp_path / "saved_dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": texts[:3]}), "test": datasets.Dataset.from_dict({"text": texts})}
    ).save_to_disk(str(both))
    summary = run(TokenizeOptions([str(single)], tok, str(tmp_path / "out" / "a"), progress=False))
    assert summary["documents"] == 5 and not summary.get("skipped")
    summary = run(TokenizeOptions([str(both)], tok, str(tmp_path / "out" / "b"), progress=False))
    assert summary["documents"] == 3  # the train split (--hub-split) of a DatasetDict
