"""lm-eval's own ``vllm`` model on an exported Orthros checkpoint (``run_vllm_lm_eval``) scores a
loglikelihood task as the project's in-process adapter does: its loglikelihoods are vLLM's prompt
logprobs, which the served model computes with an output token at every prompt position."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("lm_eval")

from exports import TEXT, make_orthros  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from orthros_train.eval.harness import run_lm_eval  # noqa: E402
from orthros_train.eval.lm_eval_cli import run_vllm_lm_eval  # noqa: E402
from orthros_train.eval.tasks import example_task_yaml  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402


def last_word_task(tasks) -> None:
    """The example ``pg_lambada`` task's YAML (the one in ``orthros_train.eval.tasks``) under the name
    ``tiny_last_word`` (an example task's own name would make lm-eval build the essays' data), reading
    ``tasks/pg_lambada.jsonl``."""
    spec = yaml.safe_load(example_task_yaml("pg_lambada", tasks))
    del spec["tag"]
    (tasks / "tiny_last_word.yaml").write_text(yaml.safe_dump({**spec, "task": "tiny_last_word"}))


def test_vllm_route_scores_like_the_in_process_adapter(tmp_path, monkeypatch):
    ckpt, export = make_orthros(tmp_path / "model")
    words = TEXT.split()
    docs = [{"context": " ".join(words[i : i + 30 + 7 * i]), "target": words[i + 30 + 7 * i]} for i in range(6)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "pg_lambada.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    last_word_task(tasks)

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
