"""The one tokenizer loader (``orthros_train.common.tokenizer``): small, offline tokenizers only."""

from __future__ import annotations

import json

import pytest

from orthros_train.common.tokenizer import TokenizerError, has_tokenizer, load_tokenizer
from orthros_train.errors import UserError


@pytest.fixture
def word_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2}, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(folder)
    return folder


def test_a_folder_and_a_tokenizer_json_file(word_dir):
    assert has_tokenizer(word_dir) and has_tokenizer(word_dir / "tokenizer.json")
    tok = load_tokenizer(word_dir)
    assert tok("a b a")["input_ids"] == [0, 1, 0] and tok.eos_token == "<eos>"
    assert tok.pad_token_id is None  # left as saved: its special tokens key data caches
    assert load_tokenizer(str(word_dir / "tokenizer.json"))("b a")["input_ids"] == [1, 0]
    assert load_tokenizer(word_dir, pad_with_eos=True).pad_token_id == 2


def test_an_orthros_config_with_yarn_beside_the_tokenizer_is_no_obstacle(word_dir):
    (word_dir / "config.json").write_text(json.dumps({
        "model_type": "orthros", "vocab_size": 3, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 1024,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    }))  # fmt: skip
    tok = load_tokenizer(word_dir, pad_with_eos=True)
    assert tok("a b")["input_ids"] == [0, 1] and tok.eos_token == "<eos>" and tok.pad_token_id == 2


def test_missing_and_empty_are_none_when_not_required(tmp_path):
    assert load_tokenizer(tmp_path / "nope", required=False) is None
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path, required=False) is None
    assert not has_tokenizer(tmp_path)


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    return str(err.value)


def test_refusals_are_one_line_user_errors_naming_the_path(tmp_path, word_dir):
    with pytest.raises(TokenizerError, match="no such tokenizer") as err:
        load_tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in _one_line(err)
    with pytest.raises(TokenizerError, match=r"the folder holds no tokenizer files \(tokenizer.json") as err:
        load_tokenizer(tmp_path)
    _one_line(err)
    (word_dir / "tokenizer.json").write_text("{broken")
    (word_dir / "tokenizer_config.json").write_text("{broken")
    # the broken file is named, with the fix (the tokenizers library's "EOF while parsing" names none)
    with pytest.raises(TokenizerError, match=r"tokenizer.json: not valid JSON .*truncated or corrupt: copy it again"
                       ) as err:
        load_tokenizer(word_dir)
    assert str(word_dir / "tokenizer.json") in _one_line(err)
    (word_dir / "tokenizer.json").write_text('{"model": "trunc')  # json's message ends in "starting at"
    with pytest.raises(TokenizerError, match=r"not valid JSON \(Unterminated string starting at: line 1 column 11\)"):
        load_tokenizer(word_dir)
