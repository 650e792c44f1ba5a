"""SFT/RL data: answer spans from chat templates to the sft/rl layouts, packing policies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_helpers import chatterbot_conversations, write_jsonl

from data_tools.cli import main as cli_main
from data_tools.pretokenize import TokenizeOptions, run
from orthros_train.data import DataConfig, build_data
from orthros_train.data.chat import ChatFields
from orthros_train.data.indexed import MODE_ANSWER, resolve_prefixes
from orthros_train.data.rl import PromptSet, rl_batch
from orthros_train.data.sft import ConversationStore, PackedConversations, SFTData, fit_segments
from orthros_train.phase.layout import IGNORE_INDEX

KNOWN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "No."},
]
ANSWERS = ["Hello! How can I help?<|im_end|>\n", "No.<|im_end|>\n"]


def _sft(tmp_path, chat_tokenizer_dir, rows, name="chat", **kw):
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = str(tmp_path / name)
    run(TokenizeOptions([str(src)], chat_tokenizer_dir, out, kind="sft", progress=False, **kw))
    return out


def _targets(lay) -> tuple[list[int], list[int]]:
    """(positions p with an output token, token ids they predict)."""
    return (lay.output_index + 1).tolist(), lay.labels.tolist()


@pytest.mark.parametrize("train_turns,expected", [("all", ANSWERS), ("last", ANSWERS[1:])])
def test_loss_mask_covers_exactly_the_assistant_tokens(
    train_turns, expected, chat_tokenizer_dir, chat_tokenizer, tmp_path
):
    out = _sft(tmp_path, chat_tokenizer_dir, [{"messages": KNOWN}], train_turns=train_turns)
    data = build_data(DataConfig(source="indexed", paths=[out], cache_dir=str(tmp_path / "c")), 512, 1, 0)
    assert isinstance(data, SFTData)
    lay = data.next_batch()
    ids = lay.input_ids.tolist()
    assert chat_tokenizer.decode(ids) == chat_tokenizer.apply_chat_template(KNOWN, tokenize=False)
    # independent expectation: find each answer's tokens in the row by its rendered text
    text_ids = chat_tokenizer.decode(ids)
    want = []
    for answer in expected:
        start_char = text_ids.index(answer)
        prefix_len = len(chat_tokenizer(text_ids[:start_char], add_special_tokens=False)["input_ids"])
        n = len(chat_tokenizer(answer, add_special_tokens=False)["input_ids"])
        want += list(range(prefix_len, prefix_len + n))
    targets, labels = _targets(lay)
    assert targets == want
    assert labels == [ids[p] for p in targets]
    assert "".join(chat_tokenizer.decode([t]) for t in labels) == "".join(expected)
    assert bool((lay.loss_weights == 1).all()) and lay.num_loss_tokens == len(want)


def test_prompt_response_records_and_chatterbot_round_trip(chat_tokenizer_dir, chat_tokenizer, tmp_path):
    convs = chatterbot_conversations()
    assert len(convs) > 1500
    out = _sft(tmp_path, chat_tokenizer_dir, [{"messages": m} for m in convs], name="bot", batch_size=64)
    store = ConversationStore(resolve_prefixes(out))
    assert len(store) == len(convs)
    for i in (0, 7, len(convs) // 2, len(convs) - 1):
        parts, modes = store.segments(i)
        rendered = chat_tokenizer.apply_chat_template(convs[i], tokenize=False)
        assert chat_tokenizer.decode(np.concatenate(parts).tolist()) == rendered
        answers = [chat_tokenizer.decode(p.tolist()) for p, m in zip(parts, modes) if m == MODE_ANSWER]
        assert answers == [m["content"] + "<|im_end|>\n" for m in convs[i] if m["role"] == "assistant"]
    pr = _sft(tmp_path, chat_tokenizer_dir, [{"prompt": "2+2?", "response": "4", "sys": "Be brief."}], name="pr",
              fields=ChatFields(system="sys"))
    parts, modes = ConversationStore(resolve_prefixes(pr)).segments(0)
    assert chat_tokenizer.decode(np.concatenate(parts).tolist()) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    assert [chat_tokenizer.decode(p.tolist()) for p, m in zip(parts, modes) if m == MODE_ANSWER] == ["4<|im_end|>\n"]


def test_packing_keeps_conversations_whole_and_separate(chat_tokenizer_dir, chat_tokenizer, tmp_path):
    convs = chatterbot_conversations(limit=300)
    out = _sft(tmp_path, chat_tokenizer_dir, [{"messages": m} for m in convs], name="pack")
    data = build_data(DataConfig(source="indexed", paths=[out], cache_dir=str(tmp_path / "c"), split="100,0,0"),
                      256, 4, 5)
    rows = [data.train.row(r) for r in range(len(data.train))]
    assert all(len(t) <= 256 for t, _, _ in rows)
    seen = sorted(int(c) for c in data.train.convs)
    assert seen == sorted(set(seen)) and len(seen) + data.train.stats.dropped == 300
    lay = data.next_batch()
    doc = lay.document_ids()
    # every output token predicts a token of its own document (conversation)
    assert bool((doc[lay.output_index] == doc[lay.output_index + 1]).all())
    assert bool((lay.labels != IGNORE_INDEX).all())
    # resume reproduces, two ranks are disjoint
    state = data.state_dict()
    nxt = data.next_batch()
    again = build_data(DataConfig(source="indexed", paths=[out], cache_dir=str(tmp_path / "c"), split="100,0,0"),
                       256, 4, 5)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch().input_ids, nxt.input_ids)
    r0 = build_data(DataConfig(source="indexed", paths=[out], split="100,0,0"), 256, 2, 5, dp_rank=0, dp_size=2)
    r1 = build_data(DataConfig(source="indexed", paths=[out], split="100,0,0"), 256, 2, 5, dp_rank=1, dp_size=2)
    assert not set(r0.sampler.positions()) & set(r1.sampler.positions())


def test_overlong_conversations_truncate_or_drop_never_inside_an_answer():
    lengths = np.array([10, 20, 8, 30])  # prompt, answer, prompt, answer
    modes = np.array([0, 1, 0, 1])
    assert fit_segments(lengths, modes, 100, "truncate") == 4
    assert fit_segments(lengths, modes, 100, "drop") == 4
    assert fit_segments(lengths, modes, 60, "truncate") == 2  # ends after the first whole answer
    assert fit_segments(lengths, modes, 60, "drop") == 0
    assert fit_segments(lengths, modes, 29, "truncate") == 0  # the first answer does not fit whole
    assert fit_segments(np.array([5, 5, 3]), np.array([0, 1, 2]), 20, "drop") == 2  # reference never input


def test_packing_policy_counts(chat_tokenizer_dir, tmp_path):
    long_answer = "word " * 300
    rows = [{"messages": KNOWN}, {"prompt": "Say a lot", "response": long_answer},
            {"messages": KNOWN[:3] + [{"role": "user", "content": "More?"},
                                      {"role": "assistant", "content": long_answer}]}]
    out = _sft(tmp_path, chat_tokenizer_dir, rows, name="long")
    store = ConversationStore(resolve_prefixes(out))
    idx = np.arange(3)
    trunc = PackedConversations(store, idx, 128, 0, "truncate")
    assert (trunc.stats.truncated, trunc.stats.dropped) == (1, 1)
    drop = PackedConversations(store, idx, 128, 0, "drop")
    assert (drop.stats.truncated, drop.stats.dropped) == (0, 2)
    with pytest.raises(Exception, match="no conversation fits"):
        SFTData(store, None, 0, 8, 1, 0)


def test_rl_prompts_and_weighted_layout(chat_tokenizer_dir, chat_tokenizer, tmp_path):
    src = write_jsonl(tmp_path / "rl.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4"},
        {"messages": [{"role": "user", "content": "Name a color"}, {"role": "assistant", "content": "blue"}]},
    ])
    out = str(tmp_path / "rl")
    assert cli_main(["rl", str(src), "--tokenizer", chat_tokenizer_dir, "--output", out, "--reference-field", "answer",
                     "--no-progress"]) == 0
    assert json.loads((tmp_path / "rl.json").read_text())["kind"] == "rl"
    prompts = PromptSet(resolve_prefixes(out), micro_batch_size=2, seed=0)
    got = {chat_tokenizer.decode(p.input_ids.tolist()): chat_tokenizer.decode(p.reference_ids.tolist())
           for p in prompts.next_prompts()}
    assert got == {"<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n": "4",
                   "<|im_start|>user\nName a color<|im_end|>\n<|im_start|>assistant\n": "blue"}
    lay = rl_batch([np.array([5, 6, 7]), np.array([8, 9])], [np.array([10, 11]), np.array([12])], [0.5, [-1.0]])
    assert lay.output_index.tolist() == [2, 3, 6] and lay.labels.tolist() == [10, 11, 12]
    assert lay.loss_weights.tolist() == [0.5, 0.5, -1.0]
    with pytest.raises(Exception, match="RL prompt sets feed the RL loop"):
        build_data(DataConfig(source="indexed", paths=[out], tokenizer=chat_tokenizer_dir), 64, 1, 0)


def test_cli_sft_inspect_reports_span_coverage(chat_tokenizer_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": KNOWN}] * 3)
    out = str(tmp_path / "o")
    assert cli_main(["sft", str(src), "--tokenizer", chat_tokenizer_dir, "--output", out, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", out, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "sft" and report["spans"]["answer_spans"] == 6
    assert report["spans"]["documents_with_answer"] == 3 and 0 < report["spans"]["coverage"] < 1
    assert "[[Hello! How can I help?<|im_end|>\n]]" in report["sample"]["text"]
