"""The conversion study's real-model arms (``study/smollm2.py``, ``study/smollm2_eval.py``): what each arm
passes the trainer, the measures (loss and KL beyond W, the pass key truly beyond W, tokens to reach the
original), the report's tables; the whole section runs on a tiny random Llama (slow), never on SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from orthros_train.errors import UserError
from orthros_train.study.conversion import ConversionOptions
from orthros_train.study.smollm2_eval import heldout_measures, passkey_prompts, tokens_to_reach


def test_tokens_to_reach_measured_extrapolated_or_never() -> None:
    curve = [{"tokens": 0, "loss_beyond_w": 4.0}, {"tokens": 100, "loss_beyond_w": 3.5},
             {"tokens": 200, "loss_beyond_w": 3.0}]
    assert tokens_to_reach(curve, 3.25) == {"tokens": 150.0, "how": "measured"}  # between two points
    assert tokens_to_reach(curve, 4.5) == {"tokens": 0, "how": "at the start"}
    assert tokens_to_reach(curve, 2.0) == {"tokens": 400.0, "how": "extrapolated"}  # the last slope, 0.5 / 100
    flat = [*curve[:2], {"tokens": 200, "loss_beyond_w": 3.6}]
    assert tokens_to_reach(flat, 3.0) == {"tokens": None, "how": "not falling at the end"}


def _tiny(attention: str = "orthros", window: int = 8, sinks: int = 0):
    from orthros_train.model import OrthrosConfig, OrthrosForCausalLM

    torch.manual_seed(0)
    return OrthrosForCausalLM(OrthrosConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, sliding_window=window, attention_type=attention, sink_tokens=sinks)).eval()


def test_heldout_loss_and_kl_beyond_the_window() -> None:
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    original, converted = _tiny("dense"), _tiny("orthros")
    with torch.no_grad():  # sharper attention and logits than the small random init: the window then matters
        for name, p in original.named_parameters():
            if not name.endswith(("gamma", "beta")):  # 1/0: the output stream equals dense inside W
                p.mul_(4)
    converted.load_state_dict(original.state_dict())
    same = heldout_measures(original, original, tokens, 32, 8, 128)
    assert same["tokens"] == 128 and abs(same["kl_beyond_w"]) < 1e-6
    m = heldout_measures(converted, original, tokens, 32, 8, 128)
    assert abs(m["loss_within_w"] - same["loss_within_w"]) < 1e-5  # identical inside W
    assert m["kl_beyond_w"] > 1e-4 and m["loss_beyond_w"] != same["loss_beyond_w"]
    with pytest.raises(UserError, match="fewer than one 32-token window"):
        heldout_measures(original, None, tokens[:20], 32, 8, 128)


def test_passkey_needles_end_more_than_w_before_the_question(tmp_path) -> None:
    from orthros_train.data.embedded import corpus_documents, train_tokenizer

    tokenizer = train_tokenizer(corpus_documents("paul_graham"), 1024, tmp_path / "tok")
    filler = tokenizer(corpus_documents("paul_graham")[-1], add_special_tokens=False)["input_ids"]
    for window in (16, 128):
        prompts = passkey_prompts(tokenizer, filler, window)
        assert len(prompts) >= 12 and len({p["key"] for p in prompts}) == len(prompts)
        assert all(p["distance"] > window for p in prompts)
        assert {p["multiple"] for p in prompts} == {2, 4, 6, 8}
        assert max(p["length"] for p in prompts) >= 8 * window
        for p in prompts:
            assert p["key"] in tokenizer.decode(p["input_ids"])
            assert tokenizer.decode(p["input_ids"]).endswith("The pass key is")


def test_every_arm_passes_its_objective_and_sinks_to_the_trainer(tmp_path) -> None:
    from orthros_train.study import smollm2
    from orthros_train.study.smollm2 import ARMS, Prepared, arm_overrides

    p = Prepared(tmp_path, tmp_path / "conv", None, tmp_path / "essays", 128, 512, 1, [], [], [])
    opts = ConversionOptions(sink_tokens=4, smollm2_points=4, smollm2_alpha=0.7)
    kv = {k: dict(o.lstrip("+").split("=", 1) for o in arm_overrides(a, p, opts, 24, 5)) for k, a in ARMS.items()}
    for key, o in kv.items():
        assert o["model.init_from"] == str(tmp_path / "conv") and o["trainer.max_steps"] == "24"
        assert o["trainer.save_every"] == "6" and o["trainer.keep_last_k"] == "0"  # the curve's checkpoints
        # stated by every arm, so the recipe's own setting never leaks into an arm without sinks
        assert o["model.sink_tokens"] == ("4" if key.startswith("sinks") else "0")
        assert ("distill.enabled" in o) == key.endswith("kd")
        if smollm2.trainer_has("optim.trainable"):
            assert o["optim.trainable"] == "self_attn"
    assert kv["sinks_kd"]["distill.alpha"] == "0.7" and "distill.align" not in kv["sinks_kd"]
    assert kv["sinks_align_kd"]["distill.align"] == "mse" and kv["sinks_align_kd"]["distill.align_steps"] == "6"
    assert kv["dense"]["model.attention_type"] == "dense" and "model.attention_type" not in kv["ce"]
    assert not ARMS["sinks"].trained and all(a.trained for k, a in ARMS.items() if k != "sinks")


@pytest.mark.parametrize(("given", "needle"), [
    ({"smollm2_arms": ("ce", "sinkz")}, "choose one or more of"),
    ({"smollm2_arms": ()}, "choose one or more of"),
    ({"smollm2_steps": 2, "smollm2_points": 3}, "fewer than the curve's 3 points"),
    ({"smollm2_alpha": 1.5}, "--smollm2-alpha must lie in [0, 1]"),
    ({"smollm2_alpha": float("nan")}, "--smollm2-alpha must lie in [0, 1]"),
])
def test_bad_smollm2_options_are_refused(given: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ConversionOptions(**given)


def _row(name: str, trained: bool, loss: float, kl: float, curve: list | None = None) -> dict[str, Any]:
    row = {"name": name, "trained": trained, "loss": loss, "loss_within_w": 3.6, "loss_beyond_w": loss,
           "perplexity_beyond_w": 2.718 ** loss, "kl_beyond_w": kl, "passkey": 0.25, "niah": 0.5, "niah_beyond_w": 0.4,
           "tokens": 4096, "passkey_cells": [{"length": 256, "distance": 150}] * 12, "niah_cells": []}
    if trained:
        row["training"] = {"steps": 24, "train_seconds": 600, "tokens": 12288}
        row["curve"] = curve
        row["to_original"] = tokens_to_reach(curve, 3.24)
    return row


def test_report_shows_every_arm_the_curves_and_the_tokens_table(tmp_path) -> None:
    from orthros_train.study.cli import main

    curve = [{"step": s, "tokens": 512 * s, "loss": 3.5 - s / 100, "loss_within_w": 3.6,
              "loss_beyond_w": 3.5 - s / 100, "kl_beyond_w": 0.3 - s / 100} for s in (0, 8, 16, 24)]
    rows = {"original": _row("original SmolLM2 (dense)", False, 3.24, 0.0),
            "converted": _row("converted, W = 128, not trained", False, 3.58, 0.34),
            "sinks": _row("sinks, not trained", False, 3.26, 0.02),
            "sinks_kd": _row("sinks + distillation", True, 3.26, 0.06, curve)}
    section = {"version": 2, "window": 128, "seq_len": 512, "sink_tokens": 4, "recipe": "convert_smollm2_cpu",
               "steps": 24, "tokens_per_step": 512, "recipe_settings": "lr 5e-05", "trainable": "self_attn",
               "alpha": 0.5, "train_documents": 47, "heldout_files": ["a.txt", "b.txt"], "heldout_tokens": 4096,
               "target_loss_beyond_w": 3.24, "passkey": {"prompts": 12, "lengths": [256, 1024], "min_distance": 150},
               "niah": {"cells": 6, "lengths": [512, 1024], "depths": [10, 50, 90], "beyond_w": 5}, "rows": rows,
               "load_average": "1 1 1", "wall_seconds": 1200, "jobs": 2}
    out = tmp_path / "out"
    out.mkdir()
    (out / ".orthros-conversion-study").write_text("")
    (out / "smollm2.json").write_text(json.dumps(section))
    assert main(["conversion", "--report-only", "--out", str(out)]) == 0  # a --smollm2-only folder
    text = (out / "conversion.md").read_text()
    for row in rows.values():
        assert f"| {row['name']} |" in text
    assert "KL to the original >= 128" in text and "| 0.3400 |" in text
    assert "Tokens to reach the original's loss at positions >= W (3.240)" in text
    assert "| sinks + distillation | 3.260 | 13,312 | extrapolated from the last two points' slope |" in text
    assert (out / "conversion" / "smollm2_recovery.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_quick_smollm2_section_end_to_end(tmp_path) -> None:
    """Every arm through the real trainer on a tiny random Llama (no SmolLM2): curves, tokens, report."""
    from orthros_train.study.cli import main

    out = tmp_path / "conv"
    assert main(["conversion", "--quick", "--smollm2-only", "--out", str(out), "--smollm2-steps", "4",
                 "--smollm2-points", "2", "--smollm2-eval-tokens", "512"]) == 0
    s = json.loads((out / "smollm2.json").read_text())
    assert list(s["rows"]) == ["original", "converted", "ce", "sinks", "sinks_ce", "sinks_kd", "sinks_align_kd",
                               "dense"]
    assert s["rows"]["original"]["kl_beyond_w"] == 0.0 and s["rows"]["converted"]["kl_beyond_w"] > 0
    for key in ("ce", "sinks_ce", "sinks_kd", "sinks_align_kd", "dense"):
        row = s["rows"][key]
        assert [p["step"] for p in row["curve"]] == [0, 2, 4] and row["training"]["steps"] == 4
        assert row["to_original"]["how"] in ("at the start", "measured", "extrapolated", "not falling at the end")
    recipe = json.loads((out / "smollm2" / "sinks_align_kd" / "recipe.json").read_text())
    assert recipe["model"]["sink_tokens"] == 4 and recipe["distill"]["align"] == "mse"
    assert (out / "conversion.md").is_file() and Path(out / "conversion" / "smollm2_recovery.png").is_file()


def test_overwrite_drops_the_stale_section_before_retraining(tmp_path) -> None:
    from orthros_train.study.smollm2 import drop_stale_section

    out = tmp_path / "out"
    (out / "conversion").mkdir(parents=True)
    for name in ("smollm2.json", "conversion.md", "conversion/smollm2_recovery.png"):
        (out / name).write_text("old")
    (out / "smollm2" / "ce").mkdir(parents=True)  # the runs themselves go one by one as they retrain
    drop_stale_section(ConversionOptions(out=out, report=out / "conversion.md", overwrite=True), lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == ["smollm2"]
