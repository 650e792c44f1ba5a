"""What the conversion study measures on a real model (``study/smollm2.py``): held-out loss inside and
beyond W with the KL to the original beyond W, a pass-key probe whose needle is truly beyond W, and
the tokens an arm needs to reach the original's beyond-W loss."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from orthros_train.data.passkey import PASSKEY_QUESTION, draw_passkey, haystack_slice, hide_needle, passkey_sentence
from orthros_train.errors import UserError

PASSKEY_MULTIPLES = (2, 4, 6, 8)  # prompt lengths, in windows
PASSKEY_DEPTHS = (0.05, 0.2, 0.35)  # where the needle sits in the filler: far from the question
PASSKEY_NEW_TOKENS = 8


def heldout_measures(model: torch.nn.Module, original: torch.nn.Module | None, tokens: Sequence[int], seq_len: int,
                     window: int, max_tokens: int) -> dict[str, Any]:
    """Loss at positions < W and >= W of ``seq_len``-token windows cut from ``tokens`` (at most
    ``max_tokens``), and KL(original || model) per token at positions >= W (``original`` None: the
    model is the original, KL 0)."""
    n = min(len(tokens), max_tokens) // seq_len
    if n < 1:
        raise UserError(f"held-out text has {len(tokens)} tokens, fewer than one {seq_len}-token window")
    sums = {"within": 0.0, "beyond": 0.0, "kl": 0.0}
    counts = {"within": 0, "beyond": 0}
    with torch.no_grad():
        for i in range(n):
            ids = torch.tensor(tokens[i * seq_len:(i + 1) * seq_len])[None]
            logp = model(ids).logits.float().log_softmax(-1)[0, :-1]
            ce = -logp.gather(-1, ids[0, 1:, None])[:, 0]
            # The prediction at position p reads tokens 0..p: p >= W is where the window cut something.
            beyond = torch.arange(seq_len - 1) >= window
            sums["within"] += float(ce[~beyond].sum())
            sums["beyond"] += float(ce[beyond].sum())
            counts["within"] += int((~beyond).sum())
            counts["beyond"] += int(beyond.sum())
            if original is not None:
                ref = original(ids).logits.float().log_softmax(-1)[0, :-1][beyond]
                sums["kl"] += float((ref.exp() * (ref - logp[beyond])).sum())
    within, beyond_loss = sums["within"] / counts["within"], sums["beyond"] / counts["beyond"]
    return {"loss": (sums["within"] + sums["beyond"]) / (counts["within"] + counts["beyond"]),
            "loss_within_w": within, "loss_beyond_w": beyond_loss, "perplexity_beyond_w": math.exp(beyond_loss),
            "kl_beyond_w": sums["kl"] / counts["beyond"], "tokens": n * seq_len}


def passkey_prompts(tokenizer, filler: Sequence[int], window: int, seed: int = 0) -> list[dict[str, Any]]:
    """12 prompts of 2-8 windows: filler text, a five-digit pass key near the start, the question at
    the end; the needle ends more than W tokens before the question ends (checked)."""
    rng = random.Random(seed)
    question = tokenizer(" " + PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    prompts = []
    for multiple in PASSKEY_MULTIPLES:
        for depth in PASSKEY_DEPTHS:
            key = draw_passkey(rng)
            needle = tokenizer(" " + passkey_sentence(key), add_special_tokens=False)["input_ids"]
            length = max(multiple * window, len(needle) + len(question) + window + 8)
            budget = length - len(needle) - len(question)
            if budget > len(filler):
                raise UserError(f"the filler has {len(filler)} tokens, fewer than a {length}-token pass-key prompt")
            at = min(int(depth * budget), budget - window - 1)
            ids = hide_needle(haystack_slice(rng, filler, budget), needle, at, question)
            distance = len(ids) - (at + len(needle))  # from the needle's last token to the question's last
            assert distance > window, (distance, window)
            prompts.append({"input_ids": ids, "key": key, "length": len(ids), "distance": distance,
                            "multiple": multiple, "depth": depth})
    return prompts


def passkey_probe(model: torch.nn.Module, tokenizer, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy continuation of each prompt; a hit when the key appears in it."""
    from orthros_train.infer.generate import generate

    stop = (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
    cells = []
    for p in prompts:
        out = generate(model, [p["input_ids"]], max_new_tokens=PASSKEY_NEW_TOKENS, stop_token_ids=stop)
        text = tokenizer.decode([t for t in out.sequences[0] if t not in stop], skip_special_tokens=True)
        cells.append({k: p[k] for k in ("length", "distance", "multiple", "depth", "key")}
                     | {"generation": text, "hit": p["key"] in text})
    return {"accuracy": sum(c["hit"] for c in cells) / len(cells), "prompts": len(cells), "cells": cells}


def tokens_to_reach(curve: Sequence[dict[str, Any]], target: float, key: str = "loss_beyond_w") -> dict[str, Any]:
    """Tokens at which the curve's ``key`` first reaches ``target`` (linear between measured points),
    else extrapolated linearly from its last two points (said so), else never (not falling)."""
    points = [(p["tokens"], p[key]) for p in curve if p.get(key) is not None]
    if points and points[0][1] <= target:
        return {"tokens": points[0][0], "how": "at the start"}
    for (t0, y0), (t1, y1) in zip(points, points[1:]):
        if y1 <= target:
            return {"tokens": t0 + (t1 - t0) * (y0 - target) / (y0 - y1), "how": "measured"}
    if len(points) < 2:
        return {"tokens": None, "how": "one point"}
    (t0, y0), (t1, y1) = points[-2], points[-1]
    slope = (y1 - y0) / (t1 - t0) if t1 != t0 else 0.0
    if slope >= 0:
        return {"tokens": None, "how": "not falling at the end"}
    return {"tokens": t1 + (target - y1) / slope, "how": "extrapolated"}
