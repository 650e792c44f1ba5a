"""lm-eval's own ``vllm`` model on an exported Orthros checkpoint (``run_vllm_lm_eval``) scores a
loglikelihood task as the project's in-process adapter does: its loglikelihoods are vLLM's prompt
logprobs, which the served model computes with an output token at every prompt position."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

from exports import TEXT, make_orthros  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from orthros_train.eval.harness import run_lm_eval  # noqa: E402
from orthros_train.eval.lm_eval_cli import run_vllm_lm_eval  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402

TASK = """\
task: tiny_last_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_vllm_route_scores_like_the_in_process_adapter(tmp_path, monkeypatch):
    ckpt, export = make_orthros(tmp_path / "model")
    words = TEXT.split()
    docs = [{"context": " ".join(words[i : i + 30 + 7 * i]), "target": words[i + 30 + 7 * i]} for i in range(6)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "tiny_last_word.yaml").write_text(TASK.format(data=tasks / "data.jsonl"))

    served = run_vllm_lm_eval(str(export), ["tiny_last_word"], include_paths=[str(tasks)], dtype="float32",
                              batch_size=4, max_length=512, enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    model = OrthrosForCausalLM.from_pretrained(ckpt).eval()
    local = run_lm_eval(model, AutoTokenizer.from_pretrained(str(export)), ["tiny_last_word"],
                        include_paths=[str(tasks)], batch_size=4, max_length=512)
    got, want = served["results"]["tiny_last_word"], local["results"]["tiny_last_word"]
    assert served["backend"] == "vllm"
    assert got["acc,none"] == want["acc,none"]
    assert 1 < want["perplexity,none"] < float("inf")
    assert got["perplexity,none"] == pytest.approx(want["perplexity,none"], rel=1e-3)

    # The same route from the command line: orthros-eval lm-eval EXPORT --backend vllm.
    from orthros_train.eval.cli import main

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the engine's default would take 4
    out = tmp_path / "cli"
    assert main(["lm-eval", str(export), "--tasks", "tiny_last_word", "--include-path", str(tasks), "--backend",
                 "vllm", "--dtype", "float32", "--batch-size", "4", "--max-length", "512", "--output-dir",
                 str(out)]) == 0
    cli = json.loads((out / "lm_eval.json").read_text())
    assert cli["backend"] == "vllm" and cli["results"]["tiny_last_word"]["acc,none"] == got["acc,none"]
