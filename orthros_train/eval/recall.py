"""``orthros-eval recall``: multi-query associative recall (MQAR) with pairs beyond the window.

Each sample is a context of ``length`` tokens of filler with ``num_pairs`` key-value pairs spread
through it, followed by one query per key. The distance from a pair to its query is drawn
log-uniformly between ``min_distance`` and the context length, so every distance bucket (inside
the window, 1-2 windows away, ... the whole context) gets queries. A query is answered by
teacher forcing: one forward pass per sample with output tokens only at the positions that
predict value tokens; the query is correct iff every value token is the argmax.

Two formats:

* ``text`` (needs a tokenizer): filler = the Paul Graham essays; a pair is the sentence
  ``" The code for {key} is {value}."`` (key ``word-NN``, value a 4-digit number) and a query the
  same sentence at the end. A text-trained model does this by in-context copying.
* ``tokens`` (Zoology-style, raw ids; for models trained on MQAR): key ids, value ids and
  filler ids come from three disjoint thirds of the vocabulary; a pair is ``[k, v]``, a query
  ``[k, v]`` with ``v`` predicted from the output token at ``k``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orthros_train.errors import UserError
from orthros_train.eval.common import environment, write_json

WORDS = (
    "apple river stone cloud tiger maple silver orange violet falcon harbor candle meadow copper lemon "
    "piano rocket garden winter summer forest castle dragon mirror planet thunder velvet marble saddle "
    "anchor bamboo cactus dolphin ember glacier hazel island jasmine kettle lantern mango nectar olive "
    "pepper quartz raven sierra tulip umber walnut yarrow zebra"
).split()


@dataclass
class RecallSample:
    input_ids: list[int]
    output_positions: list[int] = field(default_factory=list)  # positions whose output predicts a value token
    targets: list[int] = field(default_factory=list)  # the value token each of them must predict
    query_of_output: list[int] = field(default_factory=list)  # which query each output belongs to
    distances: list[int] = field(default_factory=list)  # per query: tokens from the pair's value to the query's


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    lo = max(1, lo)
    if hi <= lo:
        return lo
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _assemble(
    filler: list[int],
    pairs: list[tuple[list[int], list[int], list[int]]],
    offsets: list[int],
    bos: list[int],
) -> RecallSample:
    """Insert ``pairs`` (prefix, value, suffix) at filler ``offsets`` (sorted) and append the queries."""
    ids = list(bos)
    value_pos: dict[int, int] = {}
    prev = 0
    for q, off in sorted(enumerate(offsets), key=lambda x: x[1]):
        ids.extend(filler[prev:off])
        prefix, value, suffix = pairs[q]
        ids.extend(prefix)
        value_pos[q] = len(ids)
        ids.extend(value)
        ids.extend(suffix)
        prev = off
    ids.extend(filler[prev:])
    sample = RecallSample(input_ids=ids)
    for q in range(len(pairs)):  # queries in key order (a different order from the pairs' placement)
        prefix, value, suffix = pairs[q]
        ids.extend(prefix)
        start = len(ids)
        ids.extend(value)
        ids.extend(suffix)
        sample.distances.append(start - value_pos[q])
        for j, tok in enumerate(value):
            sample.output_positions.append(start + j - 1)
            sample.targets.append(tok)
            sample.query_of_output.append(q)
    order = sorted(range(len(sample.output_positions)), key=lambda i: sample.output_positions[i])
    sample.output_positions = [sample.output_positions[i] for i in order]
    sample.targets = [sample.targets[i] for i in order]
    sample.query_of_output = [sample.query_of_output[i] for i in order]
    return sample


def _offsets(rng: random.Random, n_filler: int, num_pairs: int, min_distance: int) -> list[int]:
    """Filler offsets whose distance to the end is log-uniform in [min_distance, n_filler]."""
    return [n_filler - min(n_filler, _log_uniform(rng, min_distance, n_filler)) for _ in range(num_pairs)]


def make_text_sample(
    tokenizer, length: int, num_pairs: int, rng: random.Random, min_distance: int = 1, corpus: str = "paul_graham"
) -> RecallSample:
    from orthros_train.eval.niah import encode, haystack_tokens

    names = [f"{w}-{n}" for w in WORDS for n in range(10, 100)]
    if not 1 <= num_pairs <= len(names):
        raise UserError(
            f"--num-pairs {num_pairs}: the text format has {len(names)} distinct keys; use --num-pairs between 1 "
            f"and {len(names)}, or --format tokens"
        )
    keys = rng.sample(names, num_pairs)
    pairs = []
    for key in keys:
        value = f" {rng.randint(1000, 9999)}"
        pairs.append((encode(tokenizer, f" The code for {key} is"), encode(tokenizer, value), encode(tokenizer, ".")))
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    used = len(bos) + 2 * sum(len(p) + len(v) + len(s) for p, v, s in pairs)
    n_filler = length - used
    if n_filler < 1:
        raise UserError(f"length {length} is too short for {num_pairs} pairs and their queries ({used} tokens)")
    start = rng.randint(0, 50_000)
    filler = haystack_tokens(tokenizer, start + n_filler, corpus)[start:]
    return _assemble(filler, pairs, _offsets(rng, n_filler, num_pairs, min_distance), bos)


def make_token_sample(
    vocab_size: int, length: int, num_pairs: int, rng: random.Random, min_distance: int = 1
) -> RecallSample:
    third = vocab_size // 3
    if third < num_pairs:
        raise UserError(f"vocab {vocab_size} too small for {num_pairs} distinct keys")
    keys = rng.sample(range(0, third), num_pairs)
    pairs = [([k], [rng.randrange(third, 2 * third)], []) for k in keys]
    n_filler = length - 4 * num_pairs
    if n_filler < 1:
        raise UserError(f"length {length} is too short for {num_pairs} pairs and their queries")
    filler = [rng.randrange(2 * third, vocab_size) for _ in range(n_filler)]
    return _assemble(filler, pairs, _offsets(rng, n_filler, num_pairs, min_distance), [])


def distance_buckets(window: int, length: int) -> list[tuple[int, int]]:
    """``[0, W), [W, 2W), [2W, 4W), ...`` up to ``length``."""
    edges = [0, window]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    return list(zip(edges[:-1], edges[1:]))


@torch.no_grad()
def score_sample(model: torch.nn.Module, sample: RecallSample) -> list[bool]:
    """Per query: every value token is the argmax (teacher forcing, one forward).

    The values are answers (``OrthrosLayout.answers``): a model with a global tail reads each one
    as a generation would, the cache kept between them (its prompt tail and fed-back value tokens
    global), so the probe measures what ``generate`` would retrieve."""
    from orthros_train.phase.builders import positions_layout

    device = next(model.parameters()).device
    ids = torch.tensor(sample.input_ids, device=device)[None]
    pos = torch.tensor(sample.output_positions, device=device)
    layout = positions_layout(ids, pos)
    layout.answers = True
    logits = model.forward_layout(layout).logits
    hit = (logits.argmax(-1).cpu() == torch.tensor(sample.targets)).tolist()
    return score_queries(hit, sample.query_of_output, len(sample.distances))


def score_queries(token_hits: Sequence[bool], query_of_output: Sequence[int], num_queries: int) -> list[bool]:
    """A query is correct iff all its value tokens are."""
    ok = [True] * num_queries
    for h, q in zip(token_hits, query_of_output):
        ok[q] = ok[q] and bool(h)
    return ok


def summarize(correct: Sequence[bool], distances: Sequence[int], window: int, length: int) -> list[dict[str, Any]]:
    """Accuracy per distance bucket."""
    out = []
    for lo, hi in distance_buckets(window, length):
        hits = [c for c, d in zip(correct, distances) if lo <= d < hi]
        out.append({
            "low": lo, "high": hi, "label": f"[{lo}, {hi})", "queries": len(hits),
            "accuracy": sum(hits) / len(hits) if hits else None,
            "beyond_window": lo >= window,
        })  # fmt: skip
    return out


def run_recall(
    model: torch.nn.Module,
    tokenizer=None,
    length: int = 2048,
    num_pairs: int = 16,
    num_samples: int = 8,
    fmt: str = "auto",
    min_distance: int = 1,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    if fmt == "auto":
        fmt = "text" if tokenizer is not None else "tokens"
    if fmt == "text" and tokenizer is None:
        raise UserError("the text format needs a tokenizer (the checkpoint has none): use --format tokens")
    if fmt not in ("text", "tokens"):
        raise UserError(f"format must be text, tokens or auto, got {fmt!r}")
    window = model.config.sliding_window
    rng = random.Random(seed)
    correct: list[bool] = []
    distances: list[int] = []
    for i in range(num_samples):
        if fmt == "text":
            sample = make_text_sample(tokenizer, length, num_pairs, rng, min_distance)
        else:
            sample = make_token_sample(model.config.vocab_size, length, num_pairs, rng, min_distance)
        ok = score_sample(model, sample)
        correct.extend(ok)
        distances.extend(sample.distances)
        if log is not None:
            log(f"recall sample {i + 1}/{num_samples}: {sum(ok)}/{len(ok)} correct")
    beyond = [c for c, d in zip(correct, distances) if d >= window]
    within = [c for c, d in zip(correct, distances) if d < window]
    return {
        "format": fmt,
        "length": length,
        "num_pairs": num_pairs,
        "num_samples": num_samples,
        "window": window,
        "accuracy": sum(correct) / len(correct) if correct else None,
        "accuracy_within_window": sum(within) / len(within) if within else None,
        "accuracy_beyond_window": sum(beyond) / len(beyond) if beyond else None,
        "buckets": summarize(correct, distances, window, length),
        "queries": [{"distance": d, "correct": c} for d, c in zip(distances, correct)],
        "environment": environment(next(model.parameters()).device),
        "config": model.config.to_dict(),
    }


def save_recall(result: dict[str, Any], output_dir: str | Path, plot: bool = True) -> dict:
    output_dir = Path(output_dir)
    paths = {"json": str(write_json(result, output_dir / "recall.json"))}
    if plot:
        from orthros_train.eval.plots import recall_curve

        title = f"MQAR recall ({result['format']}, {result['length']} tokens, {result['num_pairs']} pairs)"
        paths["png"] = str(recall_curve(result["buckets"], output_dir / "recall.png", result["window"], title))
    return paths
