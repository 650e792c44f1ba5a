"""orthros-eval: NIAH, MQAR recall, perplexity, the lm-eval adapter and bench-prefill on a tiny model."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fixtures import cli_env, tiny_model

from orthros_train.errors import UserError
from orthros_train.eval.cli import main
from orthros_train.eval.common import parse_depths, parse_lengths, parse_overrides, parse_token_count
from orthros_train.eval.niah import Needle, build_prompt, normalize, place_needle, score_answer
from orthros_train.eval.recall import _assemble, distance_buckets, make_token_sample, score_queries, summarize


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from orthros_train.data.embedded import corpus_documents, train_tokenizer

    return train_tokenizer(corpus_documents("paul_graham"), 400, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    """A tiny random Orthros checkpoint with its tokenizer, as ``orthros-train`` saves one."""
    model = tiny_model(len(tokenizer), sliding_window=16, initializer_range=0.1)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    from orthros_train.infer import load_model

    return load_model(ckpt, device="cpu")


# -- argument parsing ----------------------------------------------------------------------------


def test_parsers():
    assert parse_token_count("4k") == 4096 and parse_token_count("1m") == 2**20 and parse_token_count("300") == 300
    assert parse_lengths("1k..8k") == [1024, 2048, 4096, 8192]
    assert parse_lengths("4k,1k,1k") == [1024, 4096]
    assert parse_depths("0..100:5") == [0, 25, 50, 75, 100]
    assert parse_depths("10,90") == [10, 90]
    assert parse_overrides(["sliding_window=256", "attention_backend=reference"]) == {
        "sliding_window": 256, "attention_backend": "reference",
    }  # fmt: skip
    with pytest.raises(UserError):
        parse_token_count("4x")


# -- needle in a haystack --------------------------------------------------------------------------


def test_niah_scoring_on_known_strings():
    ans = "eat a sandwich and sit in Dolores Park on a sunny day"
    assert score_answer(" eat a sandwich and sit in Dolores Park on a sunny day.", ans)["exact_match"] == 1
    assert (
        score_answer(" Eat a sandwich, and sit in Dolores Park on a sunny day! Then go home.", ans)["exact_match"] == 1
    )
    assert score_answer(" eat a sandwich and sit in Dolores Park", ans)["exact_match"] == 0
    assert score_answer(" eat a sandwich and sit in Dolores Park on a sunny dayz", ans)["exact_match"] == 0
    s = score_answer(" I think: eat a sandwich and sit in Dolores Park on a sunny day", ans)
    assert s["exact_match"] == 0 and s["contains"] == 1 and s["word_recall"] == 1
    s = score_answer(" sit in the park\neat a sandwich and sit in Dolores Park on a sunny day", ans)
    assert s["exact_match"] == 0 and s["contains"] == 1  # exact match reads the first line only
    assert score_answer("", ans) == {"exact_match": 0.0, "contains": 0.0, "word_recall": 0.0}
    assert normalize("  Hello,   World!! ") == "hello world"


@pytest.mark.parametrize("depth", [0, 10, 33.3, 50, 90, 100])
def test_needle_goes_to_the_requested_token_depth(depth):
    hay = list(range(1000, 1200))  # 200 tokens
    needle = [1, 2, 3]
    tokens, at = place_needle(hay, needle, depth)
    assert at == round(depth / 100 * len(hay))
    assert tokens[at : at + 3] == needle and tokens[:at] == hay[:at] and tokens[at + 3 :] == hay[at:]
    # Snapping moves it back to just after a sentence end (here: every token divisible by 7).
    ends = {t for t in hay if t % 7 == 0}
    tokens, snapped = place_needle(hay, needle, depth, ends, max_backoff=10)
    assert snapped <= at and at - snapped <= 10
    assert snapped in (0, len(hay)) or hay[snapped - 1] in ends


def test_niah_prompt_has_exact_length_and_needle_at_depth(tokenizer):
    needle = Needle()
    needle_ids = tokenizer(needle.needle, add_special_tokens=False)["input_ids"]
    for length in (200, 500):
        for depth in (0, 25, 50, 100):
            p = build_prompt(tokenizer, length, depth, needle, snap_to_sentence=False)
            ids = p["input_ids"]
            assert len(ids) == length
            at = p["insert_index"]
            assert ids[at : at + len(needle_ids)] == needle_ids
            assert at == round(depth / 100 * p["haystack_tokens"])  # no BOS in this tokenizer
            assert tokenizer.decode(ids).rstrip().endswith("Answer: The best thing to do in San Francisco is")
        p = build_prompt(tokenizer, length, 50, needle, snap_to_sentence=True)
        assert abs(p["actual_depth"] - 50) <= 100 * 64 / p["haystack_tokens"]
    with pytest.raises(UserError, match="no room"):
        build_prompt(tokenizer, 20, 50, needle)


def test_niah_end_to_end_cli(ckpt, tmp_path):
    out = tmp_path / "niah"
    rc = main(["niah", str(ckpt), "--lengths", "192,320", "--depths", "0,50,100", "--batch-size", "3",
               "--prefill-chunk-size", "64", "--output-dir", str(out), "--max-new-tokens", "4"])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "niah.json").read_text())
    assert result["lengths"] == [192, 320] and result["depths"] == [0, 50, 100]
    assert len(result["scores"]) == 3 and all(len(r) == 2 for r in result["scores"])
    assert len(result["results"]) == 6 and all(r["prompt_tokens"] == r["length"] for r in result["results"])
    assert (out / "niah.png").stat().st_size > 1000


# -- recall (MQAR) ----------------------------------------------------------------------------------


def test_mqar_placement_and_scoring():
    rng = random.Random(0)
    sample = make_token_sample(vocab_size=300, length=400, num_pairs=10, rng=rng, min_distance=20)
    ids = sample.input_ids
    assert len(ids) == 400
    assert len(sample.distances) == 10 and len(sample.output_positions) == 10
    for pos, target, q in zip(sample.output_positions, sample.targets, sample.query_of_output):
        assert ids[pos + 1] == target  # the output at pos predicts the value that follows the key
        value_at = pos + 1 - sample.distances[q]
        assert ids[value_at] == target and ids[value_at - 1] == ids[pos]  # the pair [k, v] sits `distance` back
    assert min(sample.distances) >= 20
    # Multi-token values: a query counts only when all its tokens are right.
    assert score_queries([True, True, False, True], [0, 0, 1, 1], 2) == [True, False]
    s = _assemble([9] * 50, [([1], [2, 3], [4]), ([5], [6], [])], [10, 30], [])
    assert s.targets == [2, 3, 6] and s.query_of_output == [0, 0, 1]
    buckets = summarize([True, False, True, True], [3, 20, 40, 100], window=16, length=128)
    assert [b["label"] for b in buckets] == ["[0, 16)", "[16, 32)", "[32, 64)", "[64, 128)"]
    assert [b["accuracy"] for b in buckets] == [1.0, 0.0, 1.0, 1.0]
    assert distance_buckets(128, 1000)[-1] == (512, 1024)


def test_mqar_perfect_model_scores_one(monkeypatch):
    """With a model that always predicts the right token, every query is correct."""
    from orthros_train.eval import recall

    sample = make_token_sample(vocab_size=300, length=200, num_pairs=5, rng=random.Random(1))

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward_layout(self, layout):
            assert layout.answers  # the values are read as answers (a model with a tail: global)
            nxt = layout.input_ids[layout.output_index + 1]
            return SimpleNamespace(logits=F.one_hot(nxt, 300).float())

    assert recall.score_sample(Oracle(), sample) == [True] * 5


@pytest.mark.parametrize("fmt", ["text", "tokens"])
def test_recall_end_to_end_cli(ckpt, tmp_path, fmt):
    out = tmp_path / fmt
    rc = main(["recall", str(ckpt), "--length", "256", "--num-pairs", "4", "--num-samples", "2",
               "--format", fmt, "--output-dir", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "recall.json").read_text())
    assert result["format"] == fmt and len(result["queries"]) == 8
    assert sum(b["queries"] for b in result["buckets"]) == 8
    assert (out / "recall.png").is_file()


# -- perplexity -----------------------------------------------------------------------------------------


def test_ppl_equals_direct_computation(model, tokenizer, tmp_path):
    from orthros_train.eval.ppl import run_ppl, token_documents

    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 12)
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "How to start a startup: make something people want."}) + "\n"
    )
    docs = list(token_documents([str(tmp_path)], tokenizer))
    assert len(docs) == 2
    result = run_ppl(model, docs, seq_len=48, batch_tokens=64, log=None)
    nll = []
    with torch.no_grad():
        for doc in docs:
            for s in range(0, len(doc), 48):
                piece = torch.tensor(doc[s : s + 48])
                if piece.numel() < 2:
                    continue
                logits = model(piece[None]).logits[0, :-1]
                nll.append(F.cross_entropy(logits, piece[1:], reduction="none"))
    nll = torch.cat(nll)
    assert result["tokens"] == nll.numel()
    assert math.isclose(result["loss"], float(nll.mean()), rel_tol=1e-5)
    assert sum(b["tokens"] for b in result["buckets"]) == result["tokens"]
    assert [b["label"] for b in result["buckets"]] == ["[0, 16)", "[16, 32)", "[32, 64)"]
    assert result["buckets"][1]["beyond_window"] and not result["buckets"][0]["beyond_window"]


def test_ppl_cli_on_text(ckpt, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Startups are companies designed to grow fast. " * 20)
    assert main(["ppl", str(ckpt), str(text), "embedded:paul_graham", "--seq-len", "64", "--max-tokens", "300",
                 "--output-dir", str(tmp_path / "out")]) == 0  # fmt: skip
    result = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert result["tokens"] == 300 and math.isfinite(result["perplexity"])


@pytest.mark.slow  # importing megatron-core takes 10-30 s on the shared CPU
def test_ppl_on_indexed_dataset_equals_text(ckpt, tokenizer, tmp_path):
    pytest.importorskip("megatron.core")
    import numpy as np

    from orthros_train.data.indexed import ShardWriter

    text = tmp_path / "doc.txt"
    text.write_text("Startups are companies designed to grow fast. " * 20)
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids += tokenizer(text.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    writer = ShardWriter(str(tmp_path / "shard"), vocab_size=len(tokenizer))
    writer.add_document(np.array(ids))
    writer.finish()
    results = []
    for data in (str(text), str(tmp_path / "shard")):
        out = tmp_path / ("ppl_" + data.split("/")[-1])
        assert main(["ppl", str(ckpt), data, "--seq-len", "64", "--output-dir", str(out)]) == 0
        results.append(json.loads((out / "ppl.json").read_text()))
    assert results[0]["tokens"] == results[1]["tokens"]  # same tokens, same windows: same numbers
    assert math.isclose(results[0]["loss"], results[1]["loss"], rel_tol=1e-6)


# -- lm-eval adapter -------------------------------------------------------------------------------------


def _requests(*args):
    return [SimpleNamespace(args=a) for a in args]


def test_lm_eval_loglikelihood_equals_forward(model, tokenizer):
    pytest.importorskip("lm_eval")
    from orthros_train.eval.lm_eval_adapter import OrthrosLM

    lm = OrthrosLM(model=model, tokenizer=tokenizer, max_batch_tokens=40)
    pairs = [("The best thing to do in San Francisco is", " eat a sandwich"), ("Startups", " grow fast."),
             ("Why ", "do founders fail?"), ("", "Hello world")]  # fmt: skip
    results = lm.loglikelihood(_requests(*pairs))
    for (ctx, cont), (logp, greedy) in zip(pairs, results):
        if ctx:
            ctx_s, cont_s = ctx.rstrip(), ctx[len(ctx.rstrip()) :] + cont  # trailing space moves to the continuation
            whole = tokenizer(ctx_s + cont_s, add_special_tokens=False)["input_ids"]
            n_ctx = len(tokenizer(ctx_s, add_special_tokens=False)["input_ids"])
        else:
            whole = [lm.prefix_token_id] + tokenizer(cont, add_special_tokens=False)["input_ids"]
            n_ctx = 1
        ids = torch.tensor(whole)
        with torch.no_grad():
            lp = F.log_softmax(model(ids[None, :-1]).logits[0].float(), -1)
        targets = ids[n_ctx:]
        picked = lp[n_ctx - 1 :].gather(-1, targets[:, None]).squeeze(-1)
        assert math.isclose(logp, float(picked.sum()), rel_tol=1e-4, abs_tol=1e-4)
        assert greedy == bool((lp[n_ctx - 1 :].argmax(-1) == targets).all())
    # Left truncation to max_length: the same as scoring the last max_length+1 tokens directly.
    short = OrthrosLM(model=model, tokenizer=tokenizer, max_length=8)
    ctx, cont = "one two three four five six seven eight nine ten", " eleven"
    (logp, _), = short.loglikelihood(_requests((ctx, cont)))  # fmt: skip
    whole = tokenizer(ctx + cont, add_special_tokens=False)["input_ids"]
    n_cont = len(whole) - len(tokenizer(ctx, add_special_tokens=False)["input_ids"])
    ids = torch.tensor(whole[-9:])
    with torch.no_grad():
        lp = F.log_softmax(model(ids[None, :-1]).logits[0].float(), -1)
    assert math.isclose(logp, float(lp[-n_cont:].gather(-1, ids[-n_cont:, None]).sum()), rel_tol=1e-4)


def test_lm_eval_rolling_and_generate_until(model, tokenizer):
    pytest.importorskip("lm_eval")
    from orthros_train.eval.lm_eval_adapter import OrthrosLM
    from orthros_train.infer import generate

    lm = OrthrosLM(model=model, tokenizer=tokenizer, max_length=16)
    text = "Paul Graham wrote many essays about startups and programming languages."
    (rolled,) = lm.loglikelihood_rolling(_requests((text,)))
    ids = [lm.prefix_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    # Each token predicted once, with up to max_length tokens of context (the harness's windows).
    from lm_eval import utils as lm_utils

    total = 0.0
    for ctx, cont in map(lm_utils.make_disjoint_window,
                         lm_utils.get_rolling_token_windows(ids[1:], lm.prefix_token_id, 16, 1)):  # fmt: skip
        full = torch.tensor((ctx + cont)[-17:])
        with torch.no_grad():
            lp = F.log_softmax(model(full[None, :-1]).logits[0].float(), -1)
        total += float(lp[-len(cont) :].gather(-1, full[-len(cont) :, None]).sum())
    assert math.isclose(rolled, total, rel_tol=1e-4)
    lm = OrthrosLM(model=model, tokenizer=tokenizer, batch_size=2)
    prompts = ["The pass key is", "Startups are", "How to"]
    outs = lm.generate_until(_requests(*[(p, {"until": ["\n"], "max_gen_toks": 5}) for p in prompts]))
    for p, o in zip(prompts, outs):
        new = generate(model, [tokenizer(p)["input_ids"]], max_new_tokens=5, stop_token_ids=[lm.eot_token_id])
        want = tokenizer.decode(new.sequences[0], skip_special_tokens=False).split("\n")[0]
        assert o == want.split(tokenizer.eos_token)[0]


def test_example_tasks_are_built_from_the_essays(tmp_path):
    from orthros_train.eval.tasks import EXAMPLE_TASKS, write_example_tasks

    d = write_example_tasks(tmp_path / "tasks")
    for name in EXAMPLE_TASKS:
        assert str(d) in (d / f"{name}.yaml").read_text()
        rows = [json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines()]
        assert rows
    lam = [json.loads(line) for line in (d / "pg_lambada.jsonl").read_text().splitlines()]
    assert all(r["target"].isalpha() and len(r["context"].split()) >= 39 for r in lam)
    key = [json.loads(line) for line in (d / "pg_passkey.jsonl").read_text().splitlines()]
    assert all(f"The pass key is {r['answer']}." in r["context"] for r in key)
    assert (d / "pg_essays.jsonl").read_text() == write_example_tasks(tmp_path / "again").joinpath(
        "pg_essays.jsonl").read_text()  # fmt: skip


def test_lm_eval_cli_runs_example_tasks_offline(ckpt, tmp_path):
    pytest.importorskip("lm_eval")
    out = tmp_path / "lm"
    rc = main(["lm-eval", str(ckpt), "--tasks", "pg_lambada,pg_passkey,pg_essays", "--limit", "2",
               "--max-length", "256", "--tasks-dir", str(tmp_path / "tasks"), "--output-dir", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "lm_eval.json").read_text())
    res = result["results"]
    assert "acc,none" in res["pg_lambada"] and "perplexity,none" in res["pg_lambada"]
    assert "exact_match,digits" in res["pg_passkey"]
    assert "word_perplexity,none" in res["pg_essays"]


# -- bench-prefill -----------------------------------------------------------------------------------


def test_bench_prefill_smoke(tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench-prefill", "tiny", "--lengths", "64,128", "--decode-tokens", "2", "--decode-rounds", "2",
               "--output-dir", str(out), "--json", str(tmp_path / "copy.json"), "--prefill-chunk-size", "48",
               "--max-baseline-length", "64"])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench_prefill.json").read_text())
    assert [r["length"] for r in result["rows"]] == [64, 128]
    for r in result["rows"]:
        assert r["orthros_ttft_s"] > 0 and r["orthros_decode_tokens_per_s"] > 0 and r["decode_ratio"] > 0
    assert result["rows"][0]["prefill_speedup"] > 0
    assert "dense_ttft_s" not in result["rows"][1]  # baseline prefill skipped, its decode still measured
    assert result["rows"][1]["cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # tiny: 2 layers, 2 kv heads x 16
    assert (out / "bench_prefill.png").is_file() and (tmp_path / "copy.json").is_file()
    assert "prefill dense/Orthros" in (out / "bench_prefill.md").read_text()
    assert result["decode_step"] == "eager"


def test_bench_prefill_times_the_static_decode_step(tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench-prefill", "tiny", "--lengths", "64", "--decode-tokens", "2", "--decode-rounds", "1",
               "--output-dir", str(out), "--no-peer", "--no-plot", "--cuda-graph"])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench_prefill.json").read_text())
    assert result["decode_step"] == "static"  # CPU: the step without a graph
    assert result["rows"][0]["orthros_decode_tokens_per_s"] > 0 and result["rows"][0]["dense_decode_tokens_per_s"] > 0
    assert "Decode step: static." in (out / "bench_prefill.md").read_text()


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["niah", str(tmp_path), "--lengths", "64"]) == 2
    assert "not an Orthros checkpoint" in capsys.readouterr().err
    assert main(["bench-prefill", "no-such-preset", "--lengths", "64"]) == 2


def test_generate_text_cuts_at_stop_strings(model, tokenizer):
    from orthros_train.infer import generate, generate_text

    prompts = ["The best thing to do", "Startups"]
    texts, out = generate_text(model, tokenizer, prompts, max_new_tokens=6)
    for p, t, seq in zip(prompts, texts, out.sequences):
        ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        ref = generate(model, [ids], max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id]).sequences[0]
        assert seq == ref
        assert t == tokenizer.decode([x for x in ref if x != tokenizer.eos_token_id], skip_special_tokens=True)
    stop = texts[0][2:4] if len(texts[0]) >= 4 else texts[0]
    cut, _ = generate_text(model, tokenizer, prompts[:1], max_new_tokens=6, stop_strings=[stop])
    assert stop not in cut[0] and texts[0].startswith(cut[0])


def test_truncated_checkpoint_weights_are_named(ckpt, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["ppl", str(broken), "embedded:paul_graham", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{weights}" in err and "truncated or corrupt" in err


def test_nan_checkpoint_weights_are_named(ckpt, tmp_path, capsys):
    import shutil

    import safetensors.torch

    broken = tmp_path / "diverged"
    shutil.copytree(ckpt, broken)
    weights = safetensors.torch.load_file(broken / "model.safetensors")
    weights["layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    safetensors.torch.save_file(weights, broken / "model.safetensors")
    assert main(["ppl", str(broken), "embedded:paul_graham", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "layers.1.mlp.down_proj.weight holds NaN or infinite values" in err and "earlier checkpoint" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_is_a_message(ckpt, tmp_path, capsys):
    assert main(["recall", str(ckpt), "--device", "cuda", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is visible" in err and "--device cpu" in err


def test_lm_eval_task_that_needs_the_hub_offline_is_a_message(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: orthros-nonexistent/hub-only-dataset\noutput_type: loglikelihood\n"
        "test_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{target}}'\nmetric_list:\n  - metric: acc\n"
    )
    args = ["lm-eval", str(ckpt), "--tasks", "hub_task", "--include-path", str(task_dir), "--limit", "2"]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "orthros-nonexistent/hub-only-dataset" in err and "offline" in err.lower() and "dataset_path: json" in err


def test_lm_eval_vllm_backend_names_what_it_needs(ckpt, tmp_path, capsys):
    import importlib.util

    args = ["lm-eval", "--tasks", "pg_lambada", "--backend", "vllm", "--output-dir", str(tmp_path / "out")]
    # An Orthros checkpoint is not an export: the message says how to make one.
    assert main([args[0], str(ckpt), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert "orthros-convert to-hf" in err and "auto_map" in err
    if importlib.util.find_spec("vllm") is None:  # the main venv: an export without vLLM installed
        from orthros_train.convert.to_hf import convert_to_hf

        convert_to_hf(ckpt, tmp_path / "export")
        assert main([args[0], str(tmp_path / "export"), *args[1:]]) == 2
        err = capsys.readouterr().err
        assert "needs vLLM" in err and "make serve-env" in err
    assert not (tmp_path / "out" / "lm_eval.json").exists()


def test_lm_eval_finds_orthros_through_its_entry_point():
    """The ``lm_eval.models`` entry point lm-eval's plugin discovery reads names the adapter."""
    import importlib.metadata as md

    from lm_eval.api.registry import get_model

    points = {e.name: e for e in md.entry_points(group="lm_eval.models")}
    assert points["orthros"].value == "orthros_train.eval.lm_eval_adapter:OrthrosLM"
    adapter = points["orthros"].load()  # what lm-eval does when it resolves --model orthros
    assert get_model("orthros") is adapter


@pytest.mark.slow
def test_lm_eval_command_line_with_model_orthros(ckpt, tmp_path):
    import subprocess
    import sys

    from orthros_train.eval.tasks import write_example_tasks

    tasks = write_example_tasks(tmp_path / "tasks")
    cmd = [
        sys.executable, "-m", "orthros_train.eval.lm_eval_cli", "--model", "orthros",
        "--model_args", f"pretrained={ckpt}", "--device", "cpu", "--tasks", "pg_lambada", "--include_path",
        str(tasks), "--limit", "2", "--batch_size", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pg_lambada" in proc.stdout and "acc" in proc.stdout


def test_ppl_takes_the_prefix_orthros_data_printed(ckpt, tmp_path, capsys):
    from data_tools.cli import main as data_main

    src = tmp_path / "docs.jsonl"
    row = json.dumps({"text": "Startups are companies designed to grow fast. " * 8})
    src.write_text("\n".join([row] * 3))
    prefix = tmp_path / "tok" / "essays"
    assert data_main(["tokenize", str(src), "--tokenizer", str(ckpt), "--output", str(prefix)]) == 0
    printed = capsys.readouterr().out.split(":")[0]
    for data in (str(prefix), printed):
        out = tmp_path / f"ppl_{Path(data).name}"
        assert main(["ppl", str(ckpt), data, "--seq-len", "64", "--output-dir", str(out)]) == 0, data
        assert json.loads((out / "ppl.json").read_text())["tokens"] > 0


# -- bad input: named before anything loads, exit status 2 -------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["recall", "{ckpt}", "--num-pairs", "0"], "argument --num-pairs: '0': must be a positive integer"),
        (["recall", "{ckpt}", "--num-samples", "0"], "argument --num-samples: '0': must be a positive integer"),
        (["recall", "{ckpt}", "--num-pairs", "x"], "argument --num-pairs: not an integer: 'x'"),
        (["recall", "{ckpt}", "--length", "0"], "argument --length: '0': must be a positive token count"),
        (["bench-prefill", "tiny", "--repeats", "0"], "argument --repeats: '0': must be a positive integer"),
        (["bench-prefill", "tiny", "--decode-rounds", "0"], "argument --decode-rounds"),
        (["bench-prefill", "tiny", "--decode-tokens", "-1"], "argument --decode-tokens: '-1': must be an integer >= 0"),
        (["lm-eval", "{ckpt}", "--tasks", "pg_lambada", "--max-length", "0"], "argument --max-length: '0'"),
        (["lm-eval", "{ckpt}", "--tasks", "pg_lambada", "--batch-size", "0"], "argument --batch-size: '0'"),
        (["lm-eval", "{ckpt}", "--tasks", "pg_lambada", "--limit", "0"], "argument --limit: '0': must be a positive"),
        (["ppl", "{ckpt}", "embedded:paul_graham", "--seq-len", "0"], "argument --seq-len: '0'"),
        (["ppl", "{ckpt}", "embedded:paul_graham", "--batch-tokens", "-4k"], "argument --batch-tokens"),
        (["niah", "{ckpt}", "--batch-size", "0"], "argument --batch-size: '0'"),
        (["recall", "{ckpt}", "--threads", "0"], "argument --threads: '0'"),
    ],
)
def test_zero_and_negative_sizes_are_refused_by_the_parser(ckpt, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main([a.format(ckpt=ckpt) for a in args] + ["--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--override", "sliding_window=abc"], "sliding_window='abc': expected int"),
        (["--override", "tie_word_embeddings=1"], "tie_word_embeddings=1: expected a boolean, true or false"),
        (["--override", "sliding_window=0"], "sliding_window must be an integer >= 1"),
        (["--override", "windw=4"], "unknown key windw in --override; valid keys: ["),
        (["--override", "sliding_window"], "must look like key=value"),
        (["--attention-backend", "flash"], "--attention-backend flash: choose one of auto, reference, sdpa, triton"),
    ],
)
def test_bad_model_overrides_are_named(ckpt, tmp_path, capsys, args, message):
    rc = main(["recall", str(ckpt), "--format", "tokens", "--length", "256", "--num-samples", "1",
               "--output-dir", str(tmp_path / "out"), "--no-plot", *args])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "recall.json").exists()


def test_triton_backend_on_cpu_is_a_message(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' CPU interpreter would run it
    assert main(["recall", str(ckpt), "--device", "cpu", "--attention-backend", "triton",
                 "--output-dir", str(tmp_path)]) == 2  # fmt: skip
    assert "--attention-backend triton needs a CUDA device" in capsys.readouterr().err
    assert main(["bench-prefill", "tiny", "--device", "cpu", "--override", "attention_backend=triton",
                 "--output-dir", str(tmp_path)]) == 2  # fmt: skip
    assert "needs a CUDA device" in capsys.readouterr().err


def test_bad_lengths_and_unwritable_output_are_named_before_running(ckpt, tmp_path, capsys):
    assert main(["bench-prefill", "tiny", "--lengths", "0", "--output-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "bad lengths '0'" in err and "TTFT" not in out  # nothing printed as if it had started
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["recall", str(ckpt), "--output-dir", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {blocker / 'out'}: cannot create it" in err and "recall sample" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["niah", "{ckpt}", "--depths", "0..200:3"], "depth 200.0 outside 0..100"),
        (["niah", "{ckpt}", "--depths", "0..100:x"], "bad depths '0..100:x'"),
        (["niah", "{ckpt}", "--depths", "0..100:0"], "the count after ':' must be >= 1"),
        (["niah", "{ckpt}", "--lengths", "0"], "bad lengths '0'"),
        (["lm-eval", "{ckpt}", "--tasks", ","], "--tasks ',' names no task"),
        (["recall", "{ckpt}", "--device", "tpu"], "--device tpu: not a device"),
    ],
)
def test_bad_depths_tasks_and_devices_are_named(ckpt, tmp_path, capsys, args, message):
    assert main([a.format(ckpt=ckpt) for a in args] + ["--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
