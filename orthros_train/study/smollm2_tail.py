"""The global tail on SmolLM2-135M: does letting a prompt's last R base queries see the whole cache
bring back the retrieval a converted model loses beyond its window (``orthros-study conversion
--smollm2-only --smollm2-tail``; docs/convert.md, 'The global tail')?

Arms (``tail_arms``): the original (dense); the converted model with S sink tokens and R = 0 (the
paper's layer plus sinks) or R in ``tails``; no sinks with R = ``tail``; and the sink arms of
``study/smollm2.py`` continued with cross entropy (``sinks_ce``) or distillation (``sinks_kd``),
read with R = 0 and R = ``tail``. Training with ``model.base_global_tail`` set is training without
it: a pretraining layout has no prompt, hence no tail (``model/orthros.py`` ``_global_queries``), so
those runs are the sink arms' own runs, read with the tail at inference.

Every probe is answered by greedy generation (``infer.generate``'s prefill and decode steps):

* ``passkey``: a five-digit key hidden in held-out essays, the question (~10 tokens) at the end;
* ``passkey_long_question``: the same, asked in ~50 tokens whose cue ("pass key") lies more than
  32 tokens before the prompt's end, so a short tail holds only the question's last words;
* ``passkey_question_first``: the question before the document, the answer prefix after it;
* ``niah``: ``eval/niah.py``'s needle (question and answer prefix ~25 tokens);
* ``chat`` (ChatML) and ``chat_plain`` (Question/Answer lines): turn 1 asks about the document, the
  model answers, turn 2 asks for the key with turn 1's cache kept or the whole conversation read
  afresh as one prompt (``afresh``);
* ``passkey_4k_8k`` / ``niah_4k_8k``: fewer prompts at 4K-8K tokens.

Arms with the same weights and sinks share every K/V but the last ``max(R)`` tokens' (a base query
outside the tail is windowed whatever R is), so each prompt's prefix is read once and its cache
copied for each R; a chunked prefill equals a one-shot one (tests/test_global_tail.py), and
tests/test_global_tail_study.py holds this reading to ``generate``. Loss: the held-out essays'
loss beyond W (a pretraining layout: no token is in a tail, so it cannot move with R), and the
loss of each 512-token window's last ``SPAN`` tokens read as an answer (an SFT layout: those
tokens and the ``R`` before them are global), beside the same tokens with R = 0 and dense.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from orthros_train.data.passkey import PASSKEY_QUESTION, draw_passkey, haystack_slice, hide_needle, passkey_sentence
from orthros_train.errors import UserError

TAILS = (10, 32, 128)  # R of the sink arms
TAIL = 32  # R of the no-sink arm and of the trained arms
SPAN = 64  # answer tokens at the end of each held-out window (the span loss)
PASSKEY_NEW_TOKENS = 8
NIAH_NEW_TOKENS = 20  # the answer (13 tokens) and a few more, as eval/niah.py gives it
CHAT_ANSWER_TOKENS = 24  # turn 1's answer
LONG_QUESTION = ("A pass key was given somewhere in the text above: a number of five digits, stated twice in one "
                 "place. Go back over all of the text, find that number, and copy it down here exactly as it was "
                 "written, digit by digit, with nothing added. The number is")
QUESTION_FIRST = "Question: what is the pass key? It is given in the text below.\n\n"
CHAT_TURN1 = "\n\nWhat is this text about? Answer in one sentence."
CHAT_TURN2 = "What is the pass key in the text I gave you?"


@dataclass(frozen=True)
class TailArm:
    """One model read one way: its weights (``converted``, ``original`` or a trained arm of
    ``study/smollm2.py``), its sinks S and its tail R."""

    key: str
    name: str
    weights: str = "converted"
    sink_tokens: int = 0
    tail: int = 0
    dense: bool = False

    @property
    def family(self) -> tuple[str, int, bool]:
        """Arms of one family share every K/V outside the tail: their prefixes are read once."""
        return (self.weights, self.sink_tokens, self.dense)


def tail_arms(sinks: int = 4, tails: Sequence[int] = TAILS, tail: int = TAIL, trained: Sequence[str] = ()
              ) -> list[TailArm]:
    """The study's arms; ``trained``: the sink arms of ``study/smollm2.py`` that were trained here."""
    arms = [TailArm("original", "original (dense)", "original", dense=True),
            TailArm("sinks", f"{sinks} sinks", sink_tokens=sinks)]
    arms += [TailArm(f"sinks_r{r}", f"{sinks} sinks + tail R = {r}", sink_tokens=sinks, tail=r) for r in tails]
    arms += [TailArm("converted", "0 sinks, no tail"), TailArm(f"r{tail}", f"0 sinks + tail R = {tail}", tail=tail)]
    names = {"sinks_ce": "CE", "sinks_kd": "distillation"}
    for t in trained:
        arms += [TailArm(t, f"{sinks} sinks + {names[t]}", t, sinks),
                 TailArm(f"{t}_r{tail}", f"{sinks} sinks + {names[t]}, tail R = {tail}", t, sinks, tail)]
    return arms


# -- probes ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeSet:
    key: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...]


def probe_sets(quick: bool) -> list[ProbeSet]:
    """What is asked, in the order it is run (the most important first). ``quick``: the tiny model's sizes."""
    if quick:
        return [ProbeSet("passkey", (192, 256), (0.1, 0.5)), ProbeSet("niah", (256,), (10.0,)),
                ProbeSet("passkey_long_question", (256,), (0.1,)), ProbeSet("passkey_question_first", (256,), (0.1,)),
                ProbeSet("chat", (256,), (0.1,)), ProbeSet("passkey_4k_8k", (384,), (0.1,)),
                ProbeSet("niah_4k_8k", (384,), (50.0,)), ProbeSet("chat_plain", (256,), (0.1,))]
    # Sized for 2 shared CPU cores (one seed, few prompts beyond the first set: see the JSON's counts).
    return [ProbeSet("passkey", (512, 1024, 1536, 2048), (0.1, 0.5)),
            ProbeSet("passkey_4k_8k", (4096, 8192), (0.1,)),
            ProbeSet("passkey_long_question", (1024, 2048), (0.1,)),
            ProbeSet("passkey_question_first", (1024, 2048), (0.1,)),
            ProbeSet("niah", (1024, 2048), (50.0,)),
            ProbeSet("chat", (1024, 2048), (0.1,)),
            ProbeSet("niah_4k_8k", (4096,), (50.0,)),
            ProbeSet("chat_plain", (1024, 2048), (0.1,))]


EVERY_FAMILY = ("passkey", "passkey_4k_8k")  # the other sets: the original and the converted model with sinks


def asks(ps: ProbeSet, arm: TailArm) -> bool:
    """Whether ``ps`` is put to ``arm``'s family (the no-sink and trained families get the pass keys only)."""
    return ps.key in EVERY_FAMILY or arm.dense or (arm.weights == "converted" and arm.sink_tokens > 0)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_prompts(tokenizer, filler: Sequence[int], window: int, ps: ProbeSet, form: str, seed: int = 0
                    ) -> list[dict[str, Any]]:
    """Pass-key prompts of ``ps.lengths`` tokens, the needle at ``ps.depths`` of the filler and always
    more than W tokens before the prompt's end; ``form``: short | long_question | question_first."""
    rng = random.Random(seed)
    before = _ids(tokenizer, QUESTION_FIRST) if form == "question_first" else []
    after = {"short": " " + PASSKEY_QUESTION, "long_question": " " + LONG_QUESTION,
             "question_first": "\n\nAnswer: the pass key is"}[form]
    question = _ids(tokenizer, after)
    prompts = []
    for length in ps.lengths:
        for depth in ps.depths:
            key = draw_passkey(rng)
            needle = _ids(tokenizer, " " + passkey_sentence(key))
            budget = length - len(before) - len(needle) - len(question)
            if budget - window - 1 < 1 or budget > len(filler):
                raise UserError(f"a {length}-token pass-key prompt needs {budget} filler tokens (the filler has "
                                f"{len(filler)}) and more than W = {window}; give other --smollm2-tail lengths")
            at = min(int(depth * budget), budget - window - 1)
            ids = before + hide_needle(haystack_slice(rng, filler, budget), needle, at, question)
            prompts.append({"input_ids": ids, "answer": key, "length": len(ids), "depth": depth,
                            "distance": len(ids) - (len(before) + at + len(needle)),
                            "question_tokens": len(before) + len(question)})
    return prompts


def niah_prompts(tokenizer, window: int, ps: ProbeSet) -> list[dict[str, Any]]:
    """``eval/niah.py``'s prompts (the essays as haystack, its needle and question)."""
    from orthros_train.eval.niah import Needle, build_prompt

    needle = Needle()
    out = []
    for length in ps.lengths:
        for depth in ps.depths:
            p = build_prompt(tokenizer, length, depth, needle)
            ids = p["input_ids"]
            out.append({"input_ids": ids, "answer": needle.answer, "length": len(ids), "depth": depth,
                        "distance": len(ids) - (p["insert_index"] + p["needle_tokens"]),
                        "question_tokens": len(_ids(tokenizer, f"\n\nQuestion: {needle.question}\nAnswer:"
                                                               f"{needle.answer_prefix}"))})
    return out


def chat_turns(tokenizer, filler: Sequence[int], window: int, ps: ProbeSet, form: str = "chatml"
               ) -> list[dict[str, Any]]:
    """Two-turn chats: the document and a first question, then a second turn that asks for the key;
    ``input_ids`` is turn 1, ``turn2`` what follows the answer. ``form``: ``chatml`` (SmolLM2-Instruct's
    template) or ``plain`` (Question/Answer lines, as the pass-key prompts are plain text)."""
    if form == "chatml":
        head = _ids(tokenizer, "<|im_start|>user\n")
        tail = _ids(tokenizer, CHAT_TURN1 + "<|im_end|>\n<|im_start|>assistant\n")
        turn2 = _ids(tokenizer, f"<|im_end|>\n<|im_start|>user\n{CHAT_TURN2}<|im_end|>\n<|im_start|>assistant\n"
                                "The pass key is")
    else:
        head, tail = [], _ids(tokenizer, "\n\nQuestion: What is this text about?\nAnswer:")
        turn2 = _ids(tokenizer, "\n\nQuestion: What is the pass key in the text?\nAnswer: The pass key is")
    docs = passkey_prompts(tokenizer, filler, window, ProbeSet(ps.key, tuple(n - len(head) - len(tail) for n in
                                                                             ps.lengths), ps.depths), "short")
    q = len(_ids(tokenizer, " " + PASSKEY_QUESTION))
    return [{**d, "input_ids": head + d["input_ids"][:-q] + tail, "length": d["length"] - q + len(head) + len(tail),
             "distance": d["distance"] - q + len(tail), "turn2": turn2, "question_tokens": len(turn2)} for d in docs]


def build_probes(ps: ProbeSet, tokenizer, filler: Sequence[int], window: int) -> list[dict[str, Any]]:
    if ps.key.startswith("niah"):
        return niah_prompts(tokenizer, window, ps)
    if ps.key.startswith("chat"):
        return chat_turns(tokenizer, filler, window, ps, "plain" if ps.key == "chat_plain" else "chatml")
    form = {"passkey_long_question": "long_question", "passkey_question_first": "question_first"}.get(ps.key, "short")
    return passkey_prompts(tokenizer, filler, window, ps, form)


# -- reading a family of arms ------------------------------------------------------------------------------


@contextmanager
def read_as(model: torch.nn.Module, arm: TailArm) -> Iterator[torch.nn.Module]:
    """``model`` with the arm's sinks and tail (config fields the key rule reads at every pass)."""
    cfg = model.config
    old = (cfg.sink_tokens, cfg.base_global_tail)
    cfg.sink_tokens, cfg.base_global_tail = arm.sink_tokens, arm.tail
    try:
        yield model
    finally:
        cfg.sink_tokens, cfg.base_global_tail = old


def greedy(model: torch.nn.Module, logits: torch.Tensor, cache, new_tokens: int, stop: set[int],
           write_last: bool = False) -> list[int]:
    """Greedy tokens from the prefill's last ``logits`` on, each appended to ``cache`` by a decode step
    (the base query of a generated token is global under a tail); ``write_last`` also appends the last
    one (a chat's next turn follows it)."""
    from orthros_train.infer.generate import decode

    out: list[int] = []
    for step in range(new_tokens):
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in stop or step == new_tokens - 1:
            if write_last:
                decode(model, torch.tensor([tok]), cache)
            return out
        logits = decode(model, torch.tensor([tok]), cache)
    return out


def _prefix(model: torch.nn.Module, ids: Sequence[int], arms: Sequence[TailArm]):
    """The cache of ``ids`` but its last ``max(R)`` tokens (read with R = 0: none of them is in any arm's
    tail), and those last tokens. With no tail in the family the whole prompt is the rest."""
    from orthros_train.infer.generate import prefill

    keep = max(a.tail for a in arms)
    if keep == 0 or keep >= len(ids):
        return None, list(ids)
    with read_as(model, TailArm("prefix", "", sink_tokens=arms[0].sink_tokens)):
        _, cache = prefill(model, [torch.tensor(ids[:-keep])])
    return cache, list(ids[-keep:])


def _read(model: torch.nn.Module, arm: TailArm, prefix, rest: Sequence[int]):
    """``rest`` read after a copy of the ``prefix`` cache (or alone) with the arm's rule: (logits, cache)."""
    from orthros_train.infer.generate import prefill

    with read_as(model, arm):
        return prefill(model, [torch.tensor(rest)], None if prefix is None else prefix.clone())


def answer_family(model: torch.nn.Module, arms: Sequence[TailArm], probes: Sequence[dict[str, Any]], tokenizer,
                  new_tokens: int, log: Callable[[str], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every probe answered greedily by every arm of one family; a cell per (arm, probe)."""
    stop = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    cells: dict[str, list[dict[str, Any]]] = {a.key: [] for a in arms}
    for p in probes:
        prefix, rest = _prefix(model, p["input_ids"], arms)
        for arm in arms:
            logits, cache = _read(model, arm, prefix, rest)
            with read_as(model, arm):
                if "turn2" in p:
                    cell = _chat(model, arm, p, logits, cache, prefix, rest, tokenizer, new_tokens, stop)
                else:
                    new = greedy(model, logits, cache, new_tokens, stop)
                    text = tokenizer.decode([t for t in new if t not in stop], skip_special_tokens=True)
                    cell = {"generation": text, "hit": _hit(text, p["answer"])}
            cells[arm.key].append({k: p[k] for k in ("length", "depth", "distance", "question_tokens")} | cell)
            if log is not None:
                log(f"tail: {arm.key} {p['length']} tokens: {cell}")
    return cells


def _chat(model, arm: TailArm, p: dict[str, Any], logits, cache, prefix, rest, tokenizer, new_tokens: int,
          stop: set[int]) -> dict[str, Any]:
    """Turn 1 answered, then turn 2 with the cache kept, and the same conversation read afresh."""
    from orthros_train.infer.generate import prefill

    answer = greedy(model, logits, cache, CHAT_ANSWER_TOKENS, stop, write_last=True)
    turn2 = p["turn2"][1:] if answer[-1] == p["turn2"][0] else p["turn2"]  # the answer closed its turn itself
    logits2, cache = prefill(model, [torch.tensor(turn2)], cache)
    kept = tokenizer.decode([t for t in greedy(model, logits2, cache, new_tokens, stop) if t not in stop],
                            skip_special_tokens=True)
    logits3, cache3 = _read(model, arm, prefix, [*rest, *answer, *turn2])
    afresh = tokenizer.decode([t for t in greedy(model, logits3, cache3, new_tokens, stop) if t not in stop],
                              skip_special_tokens=True)
    return {"turn1": tokenizer.decode(answer, skip_special_tokens=True), "generation": kept,
            "hit": _hit(kept, p["answer"]), "afresh": afresh, "hit_afresh": _hit(afresh, p["answer"])}


def _hit(text: str, answer: str) -> bool:
    from orthros_train.eval.niah import normalize

    return normalize(answer) in normalize(text)


# -- loss ----------------------------------------------------------------------------------------------------


def span_loss(model: torch.nn.Module, tokens: Sequence[int], seq_len: int, max_tokens: int, span: int = SPAN
              ) -> float:
    """Mean loss of each ``seq_len``-token window's last ``span`` tokens read as an answer (an SFT layout:
    under a tail they and the R tokens before them are global, as in a generation)."""
    from orthros_train.phase.builders import sft_layout

    n = min(len(tokens), max_tokens) // seq_len
    span = min(span, seq_len // 4)  # --quick's 64-token windows: a quarter
    total = 0.0
    with torch.no_grad():
        for i in range(n):
            ids = torch.tensor(tokens[i * seq_len:(i + 1) * seq_len])
            layout = sft_layout([ids], [[(seq_len - span, seq_len)]])
            total += float(model.forward_layout(layout).loss)
    return total / n


def arms_json(arms: Sequence[TailArm]) -> dict[str, dict[str, Any]]:
    return {a.key: asdict(a) for a in arms}


# -- the section ---------------------------------------------------------------------------------------------


TRAINED = ("sinks_ce", "sinks_kd")  # the arms of study/smollm2.py read again with the tail


def _weights(p, arm: TailArm) -> Any:
    from orthros_train.study.smollm2 import _final

    return p.converted if arm.weights in ("converted", "original") else _final(p.folder / arm.weights)


def _load(p, arm: TailArm) -> torch.nn.Module:
    """The arm's weights with no tail and no sinks (``read_as`` sets them per arm)."""
    from orthros_train.infer.loading import load_model

    dense = {"attention_type": "dense"} if arm.dense else {}
    return load_model(_weights(p, arm), device="cpu", base_global_tail=0, sink_tokens=0, **dense)


def evaluate_tail(opts, p, arms: Sequence[TailArm], sets: Sequence[ProbeSet], save: Callable[[dict], None],
                  log: Callable[[str], None], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every probe set (most important first), family by family; ``save`` gets the rows after each.
    ``previous``: rows an earlier run of the same section measured (kept, not measured again)."""
    from orthros_train.study.smollm2_eval import heldout_measures

    previous = previous or {}
    rows = {a.key: previous.get(a.key) or {"name": a.name, **asdict(a), "probes": {}} for a in arms}
    families: dict[tuple, list[TailArm]] = {}
    for a in arms:
        families.setdefault(a.family, []).append(a)
    probes = {ps.key: build_probes(ps, p.tokenizer, p.heldout, p.window) for ps in sets}
    for ps in sets:
        for family in families.values():
            if not asks(ps, family[0]) or all(ps.key in rows[a.key]["probes"] for a in family):
                continue
            model = _load(p, family[0])
            new = NIAH_NEW_TOKENS if ps.key.startswith("niah") else PASSKEY_NEW_TOKENS
            for key, cells in answer_family(model, family, probes[ps.key], p.tokenizer, new, log).items():
                rows[key]["probes"][ps.key] = cells
            save(rows)
    for family in families.values():  # the losses last: the probes are what decides R
        if all("span_loss" in rows[a.key] for a in family):
            continue
        model = _load(p, family[0])
        for a in family:
            with read_as(model, a):
                rows[a.key].update(heldout_measures(model, None, p.heldout, p.seq_len, p.window,
                                                    opts.smollm2_eval_tokens))
                rows[a.key]["span_loss"] = span_loss(model, p.heldout, p.seq_len, opts.smollm2_eval_tokens)
            save(rows)
    return rows


def run_smollm2_tail(opts, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Prepare (``study/smollm2.py``), train the sink arms of ``TRAINED`` in ``opts.smollm2_arms`` (the same
    runs as the SmolLM2 section's), read every arm with its tail; writes ``<out>/smollm2_tail.json``
    (rewritten after every family, so a stopped run keeps what it measured) and ``smollm2_tail.md``."""
    import json
    import time
    from pathlib import Path

    from orthros_train.eval.common import write_json
    from orthros_train.study.conversion import MARKER, SMOLLM2_TAIL_RESULTS, check_out
    from orthros_train.study.pipeline import _log, load_average
    from orthros_train.study.smollm2 import ARMS, _recipe, plan_steps, prepare, train_arms

    log = log or _log
    out = Path(opts.out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("orthros-study conversion\n")
    started = time.perf_counter()
    recipe = _recipe()
    p = prepare(opts, recipe, log)
    trained = [ARMS[k] for k in TRAINED if k in opts.smollm2_arms]
    steps = plan_steps(opts, p, trained, log) if trained else 0
    facts = train_arms(opts, p, trained, steps, min(recipe["optim"]["warmup_steps"], max(steps - 1, 0)), log)
    arms = tail_arms(opts.sink_tokens, trained=[a.key for a in trained])
    sets = probe_sets(opts.quick)
    path = out / SMOLLM2_TAIL_RESULTS
    previous = json.loads(path.read_text())["arms"] if path.is_file() and not opts.overwrite else {}

    def section(rows: dict[str, Any]) -> dict[str, Any]:
        return {"version": 1, "quick": opts.quick, "command": opts.command, "window": p.window,
                "seq_len": p.seq_len, "sink_tokens": opts.sink_tokens, "heldout_files": p.heldout_files,
                "eval_tokens": opts.smollm2_eval_tokens, "span": SPAN, "training": facts,
                "probe_sets": [asdict(ps) for ps in sets], "seed": 0, "load_average": load_average(),
                "wall_seconds": time.perf_counter() - started, "arms": rows}

    def save(rows: dict[str, Any]) -> None:
        write_json(section(rows), path)

    threads = torch.get_num_threads()
    torch.set_num_threads(opts.eval_threads)
    try:
        rows = evaluate_tail(opts, p, arms, sets, save, log, previous)
    finally:
        torch.set_num_threads(threads)
    result = section(rows)
    write_json(result, path)
    from orthros_train.study.conversion import RESULTS, write_results
    from orthros_train.study.conversion_report import tail_section

    (out / "smollm2_tail.md").write_text(tail_section(result))
    if (out / RESULTS).is_file():  # the small study's report gains the section
        write_results(opts, json.loads((out / RESULTS).read_text()), log)
    log(f"tail: {path}, {out / 'smollm2_tail.md'}")
    return result
