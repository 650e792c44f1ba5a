"""``orthros-study``: the small-scale replication study (docs/study.md).

Three models of one shape (``recipes/study/{orthros,dense,sliding}.yaml``: same data and
tokens; only the attention pattern differs) are trained through the real ``orthros-train`` CLI:
a learning-rate sweep per model at the first seed, then the other seeds at the kept rate. Each
final checkpoint is evaluated on

* validation loss on held-out essays, overall and per position bucket (``eval/ppl.py``),
* associative recall on held-out synthetic documents, accuracy per distance bucket inside and
  beyond the sliding window (``data/synthetic_recall.py`` documents, ``eval/recall.py`` scoring),
* a passkey probe: one key-value needle 4-8 windows back, in a key-value haystack and in prose,

plus prefill time of Orthros against dense attention on the same weights and transformers' SDPA
Llama of the same shape, with the FLOP-ratio limit (``eval/bench.py``). The report
(``<out>/study.md`` by default; the committed one, ``docs/study.md``, only with ``--report``) is
written with tables (mean ± standard deviation over seeds) and PNG figures (``<stem>/`` beside it),
plus a JSON of every number (``<out>/study.json``).
"""

from typing import Any

__all__ = ["ARCHS", "QUICK_OVERRIDES", "StudyOptions", "evaluate_run", "run_study", "train_run"]


def __getattr__(name: str) -> Any:
    # Lazily: study/runs.py (a study's process ownership) must not import torch with the pipeline.
    if name in __all__:
        from orthros_train.study import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
