"""``python -m orthros_train.eval.lm_eval_cli ...``: lm-eval's own command line with the ``orthros``
model registered, for lm-eval releases that do not discover the ``lm_eval.models`` entry point.

Where vLLM is installed (the serving environment), lm-eval's ``vllm`` model is registered too, so
an exported checkpoint is evaluated through vLLM with
``--model vllm --model_args pretrained=EXPORT_DIR`` (lm-eval's registry imports its built-in
models lazily, and this release does not find ``vllm`` by name on its own). ``run_vllm_lm_eval`` is
the same route from Python."""

from __future__ import annotations

import importlib.util
from typing import Any

from lm_eval.__main__ import cli_evaluate

import orthros_train.eval.lm_eval_adapter  # noqa: F401  (registers the model "orthros")

if importlib.util.find_spec("vllm") is not None:
    import lm_eval.models.vllm_causallms  # noqa: F401  (registers the model "vllm")


def run_vllm_lm_eval(
    export_dir: str,
    tasks: list[str],
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = "auto",
    max_length: int | None = None,
    include_paths: list[str] | tuple[str, ...] = (),
    tasks_dir: str | None = None,
    seed: int = 1234,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    **engine_args: Any,
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with lm-eval's ``vllm`` model on an exported Orthros checkpoint.

    ``engine_args`` go to ``vllm.LLM`` as lm-eval passes its extra model arguments (e.g.
    ``kv_cache_memory_bytes``, ``enforce_eager``, ``gpu_memory_utilization``). Returns the same
    JSON-ready summary as the in-process route (``harness.run_lm_eval``).
    """
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError("the vLLM route of lm-eval needs vLLM in this environment (make serve-env), or use the "
                          "in-process route (orthros-eval lm-eval CHECKPOINT)")
    import lm_eval
    import lm_eval.models.vllm_causallms  # noqa: F401, F811  (registers lm-eval's model "vllm")

    from orthros_train.eval.harness import evaluate_summary

    model_args = dict(pretrained=str(export_dir), dtype=dtype, tensor_parallel_size=tensor_parallel_size, seed=seed,
                      **engine_args)
    if max_length is not None:
        model_args["max_model_len"] = int(max_length)
    summary = evaluate_summary("vllm", tasks, limit, num_fewshot, include_paths, tasks_dir, seed,
                               model_args=model_args, batch_size=batch_size)
    return {
        **summary,
        "backend": "vllm",
        "export": str(export_dir),
    }


if __name__ == "__main__":
    cli_evaluate()
