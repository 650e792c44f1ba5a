"""``python -m orthros_train.eval.lm_eval_cli ...``: lm-eval's own command line with the ``orthros``
model registered, for lm-eval releases that do not discover the ``lm_eval.models`` entry point.

Where vLLM is installed (the serving environment), lm-eval's ``vllm`` model is registered too, so
an exported checkpoint is evaluated through vLLM with
``--model vllm --model_args pretrained=EXPORT_DIR`` (lm-eval's registry imports its built-in
models lazily, and this release does not find ``vllm`` by name on its own)."""

import importlib.util

from lm_eval.__main__ import cli_evaluate

import orthros_train.eval.lm_eval_adapter  # noqa: F401  (registers the model "orthros")

if importlib.util.find_spec("vllm") is not None:
    import lm_eval.models.vllm_causallms  # noqa: F401  (registers the model "vllm")

if __name__ == "__main__":
    cli_evaluate()
