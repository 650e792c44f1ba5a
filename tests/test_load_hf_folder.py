"""A Hugging Face folder given where an Orthros checkpoint is expected (orthros-eval, generate):
the refusal names what the folder is and the way out, not only the fields it does not know."""

from __future__ import annotations

import json

import pytest

from orthros_train.errors import UserError
from orthros_train.infer.loading import load_checkpoint


@pytest.mark.parametrize("model_type, fix", [
    ("llama", r"a Hugging Face llama model: convert it first \(orthros-convert from-hf SRC DST\) and pass DST"),
    ("orthros", r"a Hugging Face export \(what orthros-convert to-hf writes\): pass the Orthros checkpoint it was"),
])  # fmt: skip
def test_a_hugging_face_folder_is_named_with_the_fix(tmp_path, model_type, fix):
    config = {"model_type": model_type, "architectures": ["X"], "vocab_size": 128, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"config.json: not an Orthros model config \(unknown .*\); it is {fix}"):
        load_checkpoint(tmp_path)


def test_an_orthros_config_with_a_stray_field_gets_no_hugging_face_hint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128, "bogus": 1}))
    with pytest.raises(UserError, match="not an Orthros model config") as err:
        load_checkpoint(tmp_path)
    assert "Hugging Face" not in str(err.value)
