"""The global-tail arms of the SmolLM2 study (``study/smollm2_tail.py``) and the tail column of the prefill
benchmark: a family read from one shared prefix answers as ``generate`` does with each arm's own model,
the probes put the needle (and the long question's cue) where they claim, the pretraining loss cannot
move with R, the table counts only needles beyond W; the whole section on a tiny random Llama (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from orthros_train.infer.generate import generate
from orthros_train.model import OrthrosConfig, OrthrosForCausalLM
from orthros_train.study.conversion_report import tail_table
from orthros_train.study.smollm2_tail import (
    LONG_QUESTION,
    ProbeSet,
    TailArm,
    answer_family,
    passkey_prompts,
    read_as,
    tail_arms,
)


class _Tok:
    """Token ids as their own text: enough for the family runner's decoding."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def _tiny(sinks: int = 0, tail: int = 0, seed: int = 0) -> OrthrosForCausalLM:
    torch.manual_seed(seed)
    model = OrthrosForCausalLM(OrthrosConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, sliding_window=8, sink_tokens=sinks, base_global_tail=tail,
        max_position_embeddings=512)).eval()
    with torch.no_grad():  # sharper than the small init: the window and the tail then change the argmax
        for name, p in model.named_parameters():
            if not name.endswith(("gamma", "beta")):
                p.mul_(4)
    return model


def test_a_family_read_from_one_prefix_answers_as_generate_does() -> None:
    shared = _tiny()
    arms = [TailArm("s", "", sink_tokens=2), *(TailArm(f"r{r}", "", sink_tokens=2, tail=r) for r in (3, 12))]
    gen = torch.Generator().manual_seed(3)
    probes = [{"input_ids": torch.randint(0, 64, (n,), generator=gen).tolist(), "answer": "x", "length": n,
               "depth": 0.1, "distance": n, "question_tokens": 1} for n in (40, 70)]
    cells = answer_family(shared, arms, probes, _Tok(), new_tokens=6)
    outs = set()
    for arm in arms:
        own = _tiny(sinks=2, tail=arm.tail)
        for p, cell in zip(probes, cells[arm.key]):
            want = generate(own, [p["input_ids"]], max_new_tokens=6).sequences[0]
            assert cell["generation"] == _Tok().decode(want), arm
            outs.add(cell["generation"])
    assert len(outs) > 2  # the tail changes what is generated: the comparison is not vacuous
    assert shared.config.sink_tokens == 0 and shared.config.base_global_tail == 0  # read_as restored them


def test_the_pretraining_loss_does_not_move_with_the_tail() -> None:
    model = _tiny(sinks=2)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(ids).logits
        with read_as(model, TailArm("t", "", sink_tokens=2, tail=16)):
            tailed = model(ids).logits
    assert torch.equal(plain, tailed)  # a pretraining layout has no prompt, hence no tail


def test_passkey_needles_lie_beyond_w_and_the_long_question_puts_its_cue_out_of_a_short_tail(tmp_path) -> None:
    from orthros_train.data.embedded import corpus_documents, train_tokenizer

    tokenizer = train_tokenizer(corpus_documents("paul_graham"), 1024, tmp_path / "tok")
    filler = tokenizer(corpus_documents("paul_graham")[-1], add_special_tokens=False)["input_ids"]
    ps = ProbeSet("passkey", (192, 256), (0.1, 0.9))
    for form in ("short", "long_question", "question_first"):
        prompts = passkey_prompts(tokenizer, filler, 16, ps, form)
        assert [p["length"] for p in prompts] == [192, 192, 256, 256]
        for p in prompts:
            assert p["distance"] > 16 and p["answer"] in tokenizer.decode(p["input_ids"])
    long = passkey_prompts(tokenizer, filler, 16, ps, "long_question")[0]["input_ids"]
    cue = tokenizer(" " + LONG_QUESTION, add_special_tokens=False)["input_ids"]
    assert long[-len(cue):] == cue and len(cue) > 32  # "pass key" opens it: out of a tail of 32


def test_the_table_counts_needles_beyond_w_only() -> None:
    cells = [{"distance": 200, "hit": True}, {"distance": 300, "hit": False}, {"distance": 50, "hit": True}]
    section = {"window": 128, "span": 64, "seq_len": 512, "arms": {
        "sinks_r32": {"name": "4 sinks + tail R = 32", "probes": {"passkey": cells}, "loss_beyond_w": 3.0851,
                      "span_loss": 2.5}}}
    row = tail_table(section).splitlines()[2]
    assert row.startswith("| 4 sinks + tail R = 32 | 1/2 | - |") and row.endswith("| 3.085 | 2.500 |")


def test_arms_name_the_trained_runs_and_their_tail() -> None:
    keys = [a.key for a in tail_arms(trained=["sinks_ce"])]
    assert keys == ["original", "sinks", "sinks_r10", "sinks_r32", "sinks_r128", "converted", "r32", "sinks_ce",
                    "sinks_ce_r32"]


def test_tail_flop_ratio_is_one_plus_r_over_w_plus_s_at_any_length() -> None:
    from orthros_train.eval.bench import format_tail_table, tail_flop_ratios

    cfg = _tiny(sinks=4).config
    for length in (4096, 16384):
        model, attention = tail_flop_ratios(cfg, length, 6)
        assert attention == pytest.approx(1 + 6 / 12, rel=0.01) and 1 < model < attention
    assert tail_flop_ratios(cfg, 10, 6) == (1.0, 1.0)  # T <= W + S: every query already sees every key
    result = {"time_basis": "process CPU time", "rows": [{"length": 4096, "orthros_ttft_cpu_s": 2.0, "tails": [
        {"tail": 32, "ttft_cpu_s": 2.2, "over_orthros": 1.1, "flop_ratio": 1.01, "base_attention_flop_ratio": 1.24,
         "dense_over_tail": 1.5}]}]}
    assert "| 32 |" in format_tail_table(result) and "1.240x" in format_tail_table(result)
    assert format_tail_table({"rows": [{"length": 1}]}) == ""


@pytest.mark.slow
def test_quick_tail_section_end_to_end(tmp_path) -> None:
    from orthros_train.study.conversion import ConversionOptions
    from orthros_train.study.smollm2_tail import run_smollm2_tail

    opts = ConversionOptions(out=tmp_path / "out", quick=True, smollm2=True, smollm2_steps=2, smollm2_points=1,
                             jobs=1, smollm2_arms=("sinks",), smollm2_eval_tokens=256)
    result = run_smollm2_tail(opts, log=lambda _: None)
    saved = json.loads((tmp_path / "out" / "smollm2_tail.json").read_text())
    assert list(saved["arms"]) == ["original", "sinks", "sinks_r10", "sinks_r32", "sinks_r128", "converted", "r32"]
    assert saved["arms"]["r32"]["probes"].keys() == {"passkey", "passkey_4k_8k"}  # the other sets: main family
    assert len(saved["arms"]["sinks"]["probes"]) == 8 and result["arms"]["sinks"]["span_loss"] > 0
    same = {saved["arms"][k]["loss_beyond_w"] for k in ("sinks", "sinks_r10", "sinks_r32", "sinks_r128")}
    assert len(same) == 1  # the pretraining layout's loss is one number whatever R
    assert "| 4 sinks + tail R = 32 |" in (tmp_path / "out" / "smollm2_tail.md").read_text()


def test_bench_prefill_times_each_tail_and_refuses_a_bad_one(tmp_path, capsys) -> None:
    from orthros_train.eval.cli import main

    out = tmp_path / "bench"
    args = ["bench-prefill", "tiny", "--device", "cpu", "--lengths", "128", "--no-peer", "--decode-tokens", "0",
            "--override", "sink_tokens=2", "--no-plot", "--output-dir", str(out)]
    assert main([*args, "--global-tails", "4,16"]) == 0
    row = json.loads((out / "bench_prefill.json").read_text())["rows"][0]
    assert [x["tail"] for x in row["tails"]] == [4, 16] and all(x["ttft_cpu_s"] > 0 for x in row["tails"])
    assert "The global tail" in (out / "bench_prefill.md").read_text()
    assert main([*args, "--global-tails", "0"]) == 2
    assert "--global-tails '0': every R must be >= 1" in capsys.readouterr().err
