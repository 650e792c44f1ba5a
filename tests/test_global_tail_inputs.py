"""The global tail where a user sets it: ``orthros-convert from-hf --global-tail``, the recipe key
``model.base_global_tail``, ``orthros-eval --override base_global_tail=R``; bad values get one line
naming the key and the fix, a non-zero exit, and nothing written."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from fixtures import TINY_HF_SHAPE, tiny_model

from orthros_train.convert.cli import main as convert_main
from orthros_train.errors import UserError
from orthros_train.eval.common import parse_overrides
from orthros_train.infer.loading import load_model

W = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, **TINY_HF_SHAPE, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root)
    return root


def test_from_hf_writes_the_tail_and_its_default(llama_dir, tmp_path, capsys):
    assert convert_main(["from-hf", str(llama_dir), str(tmp_path / "r5"), "--window", str(W),
                         "--global-tail", "5"]) == 0  # fmt: skip
    assert "global tail 5" in capsys.readouterr().out
    assert json.loads((tmp_path / "r5" / "config.json").read_text())["base_global_tail"] == 5
    from orthros_train.convert.from_hf import DEFAULT_GLOBAL_TAIL

    assert convert_main(["from-hf", str(llama_dir), str(tmp_path / "d"), "--window", str(W)]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["base_global_tail"] == DEFAULT_GLOBAL_TAIL
    assert convert_main(["from-hf", str(llama_dir), str(tmp_path / "z"), "--window", str(W), "--global-tail=0"]) == 0
    assert json.loads((tmp_path / "z" / "config.json").read_text())["base_global_tail"] == 0


@pytest.mark.parametrize("value, message", [
    ("-1", "--global-tail -1 is negative"),
    ("2.5", "--global-tail '2.5' is not an integer"),
    ("ten", "--global-tail 'ten' is not an integer"),
    ("", "--global-tail '' is not an integer"),
])  # fmt: skip
def test_bad_global_tail_flag_is_refused_in_one_line(llama_dir, tmp_path, capsys, value, message):
    dst = tmp_path / "dst"
    code = convert_main(["from-hf", str(llama_dir), str(dst), "--window", str(W), f"--global-tail={value}"])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "pass an integer >= 0" in err
    assert not (tmp_path / "dst").exists()


def test_eval_override_sets_and_clears_the_tail(tmp_path):
    src = tmp_path / "ckpt"
    tiny_model(sliding_window=W, sink_tokens=2).save_pretrained(src)
    assert load_model(src, device="cpu", **parse_overrides(["base_global_tail=6"])).config.base_global_tail == 6
    assert load_model(src, device="cpu", **parse_overrides(["base_global_tail=0"])).config.base_global_tail == 0
    with pytest.raises(UserError, match="base_global_tail must be an integer >= 0"):
        load_model(src, device="cpu", **parse_overrides(["base_global_tail=-2"]))
    dense = tmp_path / "dense"
    tiny_model(attention_type="dense").save_pretrained(dense)
    with pytest.raises(UserError, match="base_global_tail=4 on a dense model does nothing.*drop that override"):
        load_model(dense, device="cpu", **parse_overrides(["base_global_tail=4"]))


@pytest.mark.parametrize("value, message", [
    ("-3", "base_global_tail must be an integer >= 0"),
    ("1.5", "model.base_global_tail=1.5: expected int"),
])  # fmt: skip
def test_a_bad_recipe_value_is_one_line_naming_the_key(value, message):
    from orthros_train.train.config import run_config_from_dict

    with pytest.raises(UserError, match=message):
        run_config_from_dict({"model": {"base_global_tail": float(value) if "." in value else int(value)}})


def test_the_default_tail_is_off_where_the_window_covers_the_context(tmp_path):
    """from-hf's default tail applies where the window is shorter than the model's context; a window
    that covers every position gets 0 (asked for explicitly, the tail is refused there)."""
    from orthros_train.convert.from_hf import convert_from_hf

    src = tmp_path / "short"
    cfg = transformers.LlamaConfig(vocab_size=64, **TINY_HF_SHAPE, max_position_embeddings=W)
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    assert convert_from_hf(src, tmp_path / "o", sliding_window=W).config.base_global_tail == 0
    with pytest.raises(UserError, match="window already covers every position"):
        convert_from_hf(src, tmp_path / "o2", sliding_window=W, global_tail=4)


def test_a_recipe_that_drops_the_checkpoints_tail_is_named(tmp_path):
    """Continuing a converted checkpoint (R = 32) with a recipe that does not state the tail trains
    another key rule than the one converted: the difference is named (a warning at model build)."""
    from orthros_train.train.build import ATTENTION_SHAPE, _config_difference
    from orthros_train.train.config import run_config_from_dict

    src = tmp_path / "ckpt"
    tiny_model(sliding_window=W, base_global_tail=32).save_pretrained(src)
    shape = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 64, "sliding_window": W, "init_from": str(src)}
    cfg = run_config_from_dict({"model": shape})
    assert [line.split(" in the recipe")[0] for line in _config_difference(cfg, ATTENTION_SHAPE)] == \
        ["model.base_global_tail=0"]
    assert not _config_difference(run_config_from_dict({"model": {**shape, "base_global_tail": 32}}), ATTENTION_SHAPE)
