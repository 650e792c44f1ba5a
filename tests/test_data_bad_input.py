"""Bad input: each case is a clear error naming the file (and line), or a counted skip under --on-error skip."""

from __future__ import annotations

import json
import os

import pytest
from data_helpers import write_jsonl
from fixtures import REPO, cli_env

from data_tools.cli import main as cli_main
from data_tools.pretokenize import TokenizeOptions, run
from orthros_train.common.tokenizer import TokenizerError
from orthros_train.data.indexed import DataError, ShardWriter, open_indexed, read_index_header


def _opts(inputs, tok, out, **kw):
    return TokenizeOptions([str(i) for i in inputs], tok, str(out), progress=False, **kw)


def _messy_jsonl(path):
    return write_jsonl(path, [
        {"text": "good one"},
        '{"text": "broken", ',  # malformed JSON, line 2
        {"body": "no text field"},  # missing field, line 3
        {"text": "   "},  # empty document, line 4
        {"text": 42},  # wrong type, line 5
        "[1, 2]",  # not an object, line 6
        {"text": "good two"},
    ])


@pytest.mark.parametrize(
    "row,line,message",
    [
        ('{"text": "broken", ', 2, "malformed JSON"),
        ({"body": "x"}, 2, "no 'text' field (fields: body)"),
        ({"text": ""}, 2, "empty document"),
        ({"text": ["a"]}, 2, "field 'text' is a list, not text"),
        ("[1, 2]", 2, "expected a JSON object"),
    ],
)
def test_each_bad_record_is_a_clear_error(row, line, message, chat_tokenizer_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, row])
    with pytest.raises(DataError) as err:
        run(_opts([src], chat_tokenizer_dir, tmp_path / "out"))
    assert f"{src}:{line}: {message}" in str(err.value) and "--on-error skip" in str(err.value)


def test_skip_policy_counts_every_kind(chat_tokenizer_dir, tmp_path):
    src = _messy_jsonl(tmp_path / "in.jsonl")
    summary = run(_opts([src], chat_tokenizer_dir, tmp_path / "out", on_error="skip"))
    assert summary["documents"] == 2 and summary["records"] == 7
    assert summary["skipped"] == {"malformed": 2, "missing_field": 2, "empty": 1}
    assert summary["skipped_examples"]["malformed"].startswith(f"{src}:2:")


def test_non_utf8_files(chat_tokenizer_dir, tmp_path):
    txt = tmp_path / "latin1.txt"
    txt.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text("plain text")
    with pytest.raises(DataError, match=f"{txt}: not valid UTF-8 \\(byte 3"):
        run(_opts([txt, good], chat_tokenizer_dir, tmp_path / "a"))
    summary = run(_opts([txt, good], chat_tokenizer_dir, tmp_path / "b", on_error="skip"))
    assert summary["documents"] == 1 and summary["skipped"] == {"not_utf8": 1}
    jl = tmp_path / "latin1.jsonl"
    jl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=f"{jl}:2: not valid UTF-8"):
        run(_opts([jl], chat_tokenizer_dir, tmp_path / "c"))


def test_missing_input_and_unknown_type(chat_tokenizer_dir, tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        run(_opts([tmp_path / "nope.jsonl"], chat_tokenizer_dir, tmp_path / "o"))
    (tmp_path / "x.docx").write_text("?")
    with pytest.raises(DataError, match="unsupported file type"):
        run(_opts([tmp_path / "x.docx"], chat_tokenizer_dir, tmp_path / "o"))
    (tmp_path / "x.txt").write_text("?")
    with pytest.raises(TokenizerError, match="no such tokenizer"):
        run(_opts([tmp_path / "x.txt"], str(tmp_path / "no_tok"), tmp_path / "o"))


def test_all_records_bad_is_an_error_not_an_empty_dataset(chat_tokenizer_dir, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"text": " "}])
    with pytest.raises(DataError, match="no usable records"):
        run(_opts([src], chat_tokenizer_dir, tmp_path / "out", on_error="skip"))


def test_tokenizer_without_chat_template(plain_tokenizer_dir, chat_tokenizer_dir, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hi", "response": "hello"}])
    with pytest.raises(DataError, match="has no chat template; pass --chat-template"):
        run(_opts([src], plain_tokenizer_dir, tmp_path / "o", kind="sft"))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    summary = run(_opts([src], plain_tokenizer_dir, tmp_path / "o", kind="sft", chat_template=str(template)))
    assert summary["documents"] == 1


def test_bad_conversations(chat_tokenizer_dir, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},  # line 2: nothing to train
        {"messages": [{"role": "wizard", "content": "x"}]},  # line 3: unknown role
        {"messages": [{"role": "user"}]},  # line 4: no content
        {"question": "?"},  # line 5: neither messages nor prompt/response
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=f"{src}:2: no assistant message"):
        run(_opts([src], chat_tokenizer_dir, tmp_path / "a", kind="sft"))
    summary = run(_opts([src], chat_tokenizer_dir, tmp_path / "b", kind="sft", on_error="skip"))
    assert summary["documents"] == 1
    assert summary["skipped"] == {"no_answer": 1, "bad_role": 1, "missing_field": 2}


def _shard(tmp_path, name, docs):
    w = ShardWriter(str(tmp_path / name), vocab_size=1000)
    for d in docs:
        w.add_document(d)
    w.finish()
    return str(tmp_path / name)


def test_truncated_or_mismatched_bin_idx_named_on_open(tmp_path, capsys):
    a = _shard(tmp_path, "a", [[1, 2, 3], [4, 5]])
    b = _shard(tmp_path, "b", [[1, 2, 3, 4, 5, 6, 7]])
    assert read_index_header(a).num_tokens == 5 and len(open_indexed(a)) == 2
    data = open(a + ".bin", "rb").read()
    with open(a + ".bin", "wb") as f:
        f.write(data[:-2])
    with pytest.raises(DataError, match=f"{a}.bin: truncated \\(8 bytes, {a}.idx describes 10\\)"):
        open_indexed(a)
    os.replace(b + ".bin", a + ".bin")  # a .bin that belongs to another index
    with pytest.raises(DataError, match=f"{a}.bin: longer than its index"):
        open_indexed(a)
    b = _shard(tmp_path, "c", [[1, 2, 3, 4, 5, 6, 7]])
    idx = open(b + ".idx", "rb").read()
    with open(b + ".idx", "wb") as f:
        f.write(idx[:-3])
    with pytest.raises(DataError, match=f"{b}.idx: truncated or corrupt index"):
        read_index_header(b)
    with open(b + ".idx", "wb") as f:
        f.write(b"not an index at all, really")
    with pytest.raises(DataError, match=f"{b}.idx: not a megatron indexed-dataset index"):
        read_index_header(b)
    os.remove(b + ".idx")
    with pytest.raises(DataError, match=f"{b}.idx: missing"):
        read_index_header(b)
    assert cli_main(["inspect", a]) == 2
    assert f"{a}.bin: longer than its index" in capsys.readouterr().err


def test_hub_name_offline_is_a_clear_error(chat_tokenizer_dir, tmp_path):
    with pytest.raises(DataError, match="some-org/some-corpus: cannot open as a hub dataset"):
        run(_opts(["some-org/some-corpus"], chat_tokenizer_dir, tmp_path / "o"))


def test_cli_exit_code_and_message(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, '{"text": '])
    code = cli_main(
        ["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(tmp_path / "o"), "--no-progress"]
    )
    assert code == 2
    assert f"orthros-data: error: {src}:2: malformed JSON" in capsys.readouterr().err
    code = cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(tmp_path / "o2"),
                     "--no-progress", "--on-error", "skip"])
    assert code == 0 and "skipped {'malformed': 1}" in capsys.readouterr().out
    assert json.loads((tmp_path / "o2.json").read_text())["skipped"] == {"malformed": 1}


def test_unwritable_output_is_a_message_and_nothing_is_written(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(blocker / "sub" / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--output {blocker / 'sub' / 'out'}: cannot write in {blocker / 'sub'}" in err
    assert "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and blocker.read_text() == "not a directory"


def test_token_ids_past_the_vocabulary_are_caught_when_the_data_is_opened(tmp_path):
    import numpy as np

    from orthros_train.data.blend import build_blend

    prefix = str(tmp_path / "foreign")
    writer = ShardWriter(prefix, 50000)  # written with a bigger vocabulary than the model's
    writer.add_document(np.array([5, 6, 7, 8] * 40, dtype=np.int64))
    writer.add_document(np.array([5, 6, 7, 1030, 9] * 40, dtype=np.int64))
    writer.finish()
    with pytest.raises(DataError) as err:
        build_blend([prefix], None, 16, 0, 1024, 0, str(tmp_path / "cache"))
    message = str(err.value)
    assert f"{prefix}.bin: token id 1030 at token position 163" in message and "document 1" in message
    assert "vocabulary of 1024" in message and "data.tokenizer" in message


@pytest.mark.parametrize("flag", ["--workers", "--docs-per-shard", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_counts_must_be_positive_integers(flag, value, chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(out), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and ("positive integer" in err or "is not an integer" in err)
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_inspect_sample_out_of_range_is_refused(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "one"}, {"text": "two"}])
    out = str(tmp_path / "out")
    assert cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", out, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", out, "--sample", "1"]) == 0
    assert cli_main(["inspect", out, "--sample", "2"]) == 2  # used to wrap round to document 0
    err = capsys.readouterr().err
    assert "--sample 2: " in err and "holds 2 documents; choose one of 0..1" in err
    with pytest.raises(SystemExit):
        cli_main(["inspect", out, "--sample", "-1"])


def _rl_rows():
    return [
        {"prompt": "2 + 2 = ?", "answer": 4},  # line 1: a number -> "4"
        {"prompt": "half of 5?", "answer": 2.5},  # line 2: -> "2.5"
        {"prompt": "capital of France?", "answer": "Paris"},  # line 3
        {"prompt": "no answer here"},  # line 4: missing
        {"prompt": "a flag?", "answer": True},  # line 5: bool, refused
        {"prompt": "nothing?", "answer": "  "},  # line 6: empty, refused
    ]


def test_rl_reference_answers_numbers_are_text_missing_ones_are_named(chat_tokenizer_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from orthros_train.data.rl import PromptSet

    src = write_jsonl(tmp_path / "rl.jsonl", _rl_rows())
    base = ["rl", str(src), "--tokenizer", chat_tokenizer_dir, "--reference-field", "answer", "--no-progress"]
    assert cli_main([*base, "--output", str(tmp_path / "strict")]) == 2
    err = capsys.readouterr().err
    assert f"{src}:4: no reference answer field 'answer' (fields: prompt)" in err and "--on-error skip" in err
    assert not (tmp_path / "strict.json").exists() or not json.loads((tmp_path / "strict.json").read_text())["complete"]
    out = tmp_path / "lenient"
    assert cli_main([*base, "--output", str(out), "--on-error", "skip"]) == 0
    printed = capsys.readouterr().out
    assert "3 documents" in printed and "'missing_reference': 1" in printed and "'bad_reference': 2" in printed
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    prompts = PromptSet([str(out) + "_00000"], 1, 0)
    refs = sorted(tok.decode(prompts.prompt(i).reference_ids.tolist()) for i in range(len(prompts)))
    assert refs == ["2.5", "4", "Paris"]
    summary = json.loads((tmp_path / "lenient.json").read_text())
    assert "rl.jsonl:5" in summary["skipped_examples"]["bad_reference"]
    assert "bool" in summary["skipped_examples"]["bad_reference"]


def test_empty_assistant_answer_is_refused_not_trained(chat_tokenizer_dir, tmp_path):
    """An empty answer used to become a trained span holding only the end-of-turn marker."""
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]},
        {"prompt": "and now?", "response": "   "},
    ]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DataError, match=f"{src}:2: assistant message 1 is empty"):
        run(_opts([src], chat_tokenizer_dir, tmp_path / "a", kind="sft"))
    summary = run(_opts([src], chat_tokenizer_dir, tmp_path / "b", kind="sft", on_error="skip"))
    assert summary["documents"] == 1 and summary["skipped"] == {"empty_answer": 2}
    # train_turns=last: an empty earlier turn is context, only the trained (last) one must say something
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}]
    src = write_jsonl(tmp_path / "last.jsonl", rows)
    assert run(_opts([src], chat_tokenizer_dir, tmp_path / "c", kind="sft", train_turns="last"))["documents"] == 1


def test_out_of_vocabulary_ids_in_a_bin_whose_summary_claims_a_smaller_vocabulary(chat_tokenizer_dir, tmp_path):
    import numpy as np

    from orthros_train.data.blend import build_blend

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine text " * 30}, {"text": "more text " * 30}])
    out = tmp_path / "out"
    summary = run(_opts([src], chat_tokenizer_dir, out))
    assert summary["tokenizer"]["vocab_size"] == 1024
    prefix = str(out) + "_00000"
    build_blend([prefix], None, 16, 0, 1024, 0, str(tmp_path / "cache"))  # as written: fine, no scan needed
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    tokens[70] = 5000  # rewritten after orthros-data recorded it (e.g. copied from other data)
    tokens.tofile(prefix + ".bin")
    with pytest.raises(DataError) as err:
        build_blend([prefix], None, 16, 0, 1024, 0, str(tmp_path / "cache"))
    message = str(err.value)
    assert f"{prefix}.bin: token id 5000 at token position 70 (byte offset 140" in message
    assert "summary claims a vocabulary of 1024" in message and "data.tokenizer" in message


def test_overwrite_with_fewer_shards_leaves_no_stale_shard(chat_tokenizer_dir, tmp_path):
    from orthros_train.data.indexed import resolve_prefixes

    out = tmp_path / "data" / "corpus"
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": f"document number {i}"} for i in range(3)])
    assert len(run(_opts([first], chat_tokenizer_dir, out, docs_per_shard=1))["shards"]) == 3
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "only one now"}])
    with pytest.raises(DataError, match="exists for other inputs"):
        run(_opts([second], chat_tokenizer_dir, out, docs_per_shard=1))
    summary = run(_opts([second], chat_tokenizer_dir, out, docs_per_shard=1, overwrite=True))
    assert summary["complete"] and len(summary["shards"]) == 1 and "replacing" not in summary
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus.json", "corpus_00000.bin", "corpus_00000.idx"]
    assert resolve_prefixes(str(out.parent)) == [str(out) + "_00000"]  # a directory reads the new data only


def test_unreadable_summary_is_named_and_overwrite_rebuilds(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    out = tmp_path / "out"
    (tmp_path / "out.json").write_text('{"kind": "pretr')  # cut short by a full disk
    args = ["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(out), "--no-progress"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert f"{out}.json: unreadable summary of an earlier run" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert cli_main([*args, "--overwrite"]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["complete"]


def test_concurrent_tokenize_into_one_prefix_takes_turns(chat_tokenizer_dir, tmp_path):
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"document {i} " * 50} for i in range(400)])
    out = tmp_path / "out"
    env = cli_env(PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "data_tools.cli", "-v", "tokenize", str(src), "--tokenizer", chat_tokenizer_dir,
           "--output", str(out), "--no-progress", "--docs-per-shard", "50"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    logs = "".join(r[1] for r in results)
    assert "is complete; nothing to do" in logs  # the second one waited, then found the work done
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["complete"] and summary["documents"] == 400 and len(summary["shards"]) == 8
    assert not (tmp_path / "out.lock").exists()
    assert all(read_index_header(str(tmp_path / s["prefix"])).num_documents == 50 for s in summary["shards"])


def test_chat_template_file_problems_are_named_before_any_record(plain_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hi", "response": "hello"}] * 3)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}\n{% if")
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    cases = [(tmp_path / "missing.jinja", "cannot read it (No such file or directory)"),
             (tmp_path, "cannot read it (Is a directory)"),
             (latin1, "cannot read it ("),
             (broken, f"--chat-template {broken}:2: not a valid Jinja template")]
    for template, message in cases:
        code = cli_main(["sft", str(src), "--tokenizer", plain_tokenizer_dir, "--output", str(tmp_path / "o"),
                         "--chat-template", str(template), "--no-progress", "--on-error", "skip"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err
        assert not (tmp_path / "o.json").exists()


def test_empty_input_writes_nothing(chat_tokenizer_dir, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    code = cli_main(["tokenize", str(tmp_path / "empty.jsonl"), "--tokenizer", chat_tokenizer_dir, "--output",
                     str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and "no records at all (empty input); nothing was written" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]  # no summary promising a resume


def test_output_that_would_overwrite_an_input_is_refused(chat_tokenizer_dir, tmp_path, capsys):
    src = tmp_path / "docs.json"
    src.write_text('[{"text": "precious"}]')
    code = cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(tmp_path / "docs"),
                     "--overwrite", "--no-progress"])
    assert code == 2 and f"would overwrite the input {src}" in capsys.readouterr().err
    assert src.read_text() == '[{"text": "precious"}]' and sorted(p.name for p in tmp_path.iterdir()) == ["docs.json"]


def test_inspect_with_an_explicit_missing_tokenizer_is_an_error(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "one"}])
    out = str(tmp_path / "out")
    assert cli_main(["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", out, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", out, "--tokenizer", str(tmp_path / "nope")]) == 2  # used to be ignored silently
    assert f"{tmp_path / 'nope'}: no such tokenizer" in capsys.readouterr().err


def test_interrupt_and_io_errors_end_with_one_line(chat_tokenizer_dir, tmp_path, capsys, monkeypatch):
    import data_tools.pretokenize as pretokenize

    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "one"}])
    args = ["tokenize", str(src), "--tokenizer", chat_tokenizer_dir, "--output", str(tmp_path / "out"), "--no-progress"]
    for exc, code, message in [(KeyboardInterrupt(), 130, "interrupted; finished shards are kept"),
                               (OSError(28, "No space left on device", str(tmp_path / "out_00000.tmp.bin")), 1,
                                "No space left on device")]:
        def boom(opts, exc=exc):
            raise exc

        monkeypatch.setattr(pretokenize, "run", boom)
        assert cli_main(args) == code
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
