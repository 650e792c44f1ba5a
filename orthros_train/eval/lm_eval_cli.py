"""``python -m orthros_train.eval.lm_eval_cli ...``: lm-eval's own command line with the ``orthros``
model registered, for lm-eval releases that do not discover the ``lm_eval.models`` entry point."""

from lm_eval.__main__ import cli_evaluate

import orthros_train.eval.lm_eval_adapter  # noqa: F401  (registers the model "orthros")

if __name__ == "__main__":
    cli_evaluate()
