"""``orthros-study``: the small-scale replication study (issue #11, docs/study.md).

Three runs of one shape (``recipes/study/{orthros,dense,sliding}.yaml``: same data, tokens and
seed; only the attention pattern differs) are trained through the real ``orthros-train`` CLI,
then each final checkpoint is evaluated on

* validation loss on held-out essays, overall and per position bucket (``eval/ppl.py``),
* multi-query associative recall on held-out synthetic documents, accuracy per distance bucket
  inside and beyond the sliding window (``eval/recall.py`` scoring),
* prefill time, Orthros vs dense attention on the same weights (``eval/bench.py``),

and ``docs/study.md`` is written with tables and PNG figures (``docs/study/``), plus a JSON of
every number (``<out>/study.json``).
"""

from orthros_train.study.pipeline import ARCHS, QUICK_OVERRIDES, StudyOptions, evaluate_run, run_study, train_run

__all__ = ["ARCHS", "QUICK_OVERRIDES", "StudyOptions", "evaluate_run", "run_study", "train_run"]
