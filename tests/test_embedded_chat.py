"""The embedded SFT corpus: built on first use into the cache, reused, a corrupt cache refused,
and ``orthros-train --config-name sft_tiny_cpu`` prepares it itself."""

from __future__ import annotations

import json
import os

import pytest
from fixtures import cli_env, run_train

from orthros_train.data import DataConfig, build_data, prepare_embedded
from orthros_train.data.embedded_chat import prepare_embedded_chat
from orthros_train.data.indexed import DataError, resolve_prefixes


def chat_config(tmp_path, **kw) -> DataConfig:
    return DataConfig(source="embedded", corpus="chatterbot", cache_dir=str(tmp_path / "cache"), split="95,5,0", **kw)


def test_built_on_first_use_reused_and_on_the_pretrained_vocabulary(tmp_path):
    cfg = chat_config(tmp_path)
    data = build_data(cfg, 128, 2, 0)
    batch = data.next_batch()
    assert int(batch.loss_weights.gt(0).sum()) > 0  # answer tokens carry loss
    text = data.tokenizer.decode(batch.input_ids)
    assert "User: " in text and "\nAssistant: " in text and "<|endoftext|>" in text
    output, _ = prepare_embedded_chat(cfg)
    summary = json.loads(open(output + ".json").read())
    assert summary["kind"] == "sft" and summary["complete"] and summary["documents"] > 1000
    before = {p: os.path.getmtime(p + ".bin") for p in resolve_prefixes(output)}
    build_data(cfg, 128, 2, 0)  # reused as is: nothing rewritten
    assert before == {p: os.path.getmtime(p + ".bin") for p in resolve_prefixes(output)}
    # the same BPE as the essays' (tiny_cpu's), so a tiny_cpu checkpoint can be fine-tuned on it
    _, essay_tok = prepare_embedded(DataConfig(cache_dir=cfg.cache_dir))
    assert essay_tok.backend_tokenizer.to_str() == data.tokenizer.backend_tokenizer.to_str()
    # the saved copy (what the SFT checkpoint exports) carries the chat template
    from orthros_train.common.tokenizer import load_tokenizer

    saved = load_tokenizer(os.path.join(os.path.dirname(output), "tokenizer"))
    assert saved.chat_template == data.tokenizer.chat_template


def test_corrupt_cache_is_refused_naming_the_folder(tmp_path):
    cfg = chat_config(tmp_path)
    output, _ = prepare_embedded_chat(cfg)
    prefix = resolve_prefixes(output)[0]
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") // 2)
    folder = os.path.dirname(output)
    with pytest.raises(DataError, match=f"cached dataset in {folder} is corrupt.*truncated.*delete {folder}"):
        build_data(cfg, 128, 2, 0)
    with open(output + ".json", "w") as f:
        f.write("{not json")
    with pytest.raises(DataError, match="unreadable summary.*to rebuild it"):
        build_data(cfg, 128, 2, 0)


@pytest.mark.slow
def test_sft_tiny_cpu_prepares_its_own_data(tmp_path):
    """A fresh run directory and a fresh cache: the recipe runs with no data step before it (the
    pretrained model is left out here: the documented-commands test trains it first)."""
    run_dir = tmp_path / "run"
    proc = run_train(
        "--config-name", "sft_tiny_cpu", "trainer.max_steps=2", "model.init_from=null",
        f"data.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}", "trainer.eval_every=2",
        "trainer.eval_batches=1", "trainer.sample_tokens=2", "trainer.progress=false",
        cwd=tmp_path, env=cli_env(WANDB_MODE="disabled"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "final").is_dir()
    assert list((tmp_path / "cache" / "embedded").glob("chatterbot-sft-*/conversations.json"))


def test_chat_corpus_entries_keep_their_roles(tmp_path, monkeypatch):
    """An entry that is a plain string used to become one turn per character, and an empty turn
    used to be dropped, which swapped the roles of every later turn."""
    import orthros_train.data.embedded as embedded

    corpus = tmp_path / "talk.yml"
    corpus.write_text(
        "conversations:\n"
        "- - What is two plus two?\n  - Four.\n"
        "- Just a sentence, not a dialogue\n"
        "- - First question?\n  - First answer.\n  - ''\n  - This answer must not become a question.\n"
    )
    monkeypatch.setattr(embedded, "corpus_files", lambda name: [corpus])
    convs = embedded.chat_conversations("chatterbot")
    assert convs == [
        [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
        [{"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."}],
    ]


def test_the_real_chat_corpus_has_no_single_character_turns():
    from orthros_train.data.embedded import chat_conversations

    convs = chat_conversations("chatterbot")
    assert convs and all(len(m["content"]) > 1 or m["content"].isalnum() for c in convs for m in c)
    assert not any(c[0]["content"] == "I" and c[1]["content"] == "n" for c in convs)
