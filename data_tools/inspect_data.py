"""``orthros-data inspect``: counts, length histogram, a decoded sample and answer-span coverage."""

from __future__ import annotations

import numpy as np

from orthros_train.data.indexed import (
    MODE_ANSWER,
    MODE_REFERENCE,
    DataError,
    load_summary,
    open_indexed,
    read_index_header,
    resolve_prefixes,
)


def _doc_lengths(lengths: np.ndarray, doc_idx: np.ndarray) -> np.ndarray:
    per_seq = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return per_seq[doc_idx[1:]] - per_seq[doc_idx[:-1]]


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) over power-of-two bins [low, high)."""
    if lengths.size == 0:
        return []
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [0] + [2**k for k in range(top + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return [(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts) if c]


def inspect_dataset(path: str, tokenizer=None, sample: int = 0, max_chars: int = 600) -> dict:
    prefixes = resolve_prefixes(path)
    summary = load_summary(path) or {}
    headers = [read_index_header(p) for p in prefixes]
    multimodal = any(h.multimodal for h in headers)
    kind = summary.get("kind") or ("sft" if multimodal else "pretrain")
    doc_lengths = np.concatenate([_doc_lengths(h.sequence_lengths, h.document_indices) for h in headers])
    report = {
        "path": path,
        "kind": kind,
        "shards": len(prefixes),
        "documents": int(doc_lengths.size),
        "tokens": int(doc_lengths.sum()),
        "length": {
            "min": int(doc_lengths.min()) if doc_lengths.size else 0,
            "mean": float(doc_lengths.mean()) if doc_lengths.size else 0.0,
            "median": float(np.median(doc_lengths)) if doc_lengths.size else 0.0,
            "max": int(doc_lengths.max(initial=0)),
        },
        "histogram": length_histogram(doc_lengths),
    }
    if summary:
        report["skipped"] = summary.get("skipped", {})
        report["tokenizer"] = summary.get("tokenizer", {}).get("path")
    if multimodal:
        answer_tokens = ref_tokens = answered = spans = 0
        for p, h in zip(prefixes, headers):
            ds = open_indexed(p)
            modes = ds.index.sequence_modes
            is_answer = modes == MODE_ANSWER
            answer_tokens += int(h.sequence_lengths[is_answer].sum(dtype=np.int64))
            ref_tokens += int(h.sequence_lengths[modes == MODE_REFERENCE].sum(dtype=np.int64))
            per_doc = np.add.reduceat(is_answer.astype(np.int64), h.document_indices[:-1]) if h.sequence_count else []
            answered += int((np.asarray(per_doc) > 0).sum())
            spans += int(is_answer.sum())
        report["spans"] = {
            "answer_tokens": answer_tokens,
            "coverage": answer_tokens / max(report["tokens"] - ref_tokens, 1),
            "answer_spans": spans,
            "documents_with_answer": answered,
            "reference_tokens": ref_tokens,
        }
    if report["documents"]:
        if not 0 <= sample < report["documents"]:
            raise DataError(f"--sample {sample}: {path} holds {report['documents']} documents; "
                            f"choose one of 0..{report['documents'] - 1}")
        report["sample"] = _sample(prefixes, headers, sample, tokenizer, max_chars)
    return report


def _sample(prefixes, headers, index: int, tokenizer, max_chars: int) -> dict:
    which = 0
    while index >= headers[which].num_documents:
        index -= headers[which].num_documents
        which += 1
    prefix, h = prefixes[which], headers[which]
    ds = open_indexed(prefix)
    lo, hi = int(h.document_indices[index]), int(h.document_indices[index + 1])
    parts = ds[lo:hi] if hi > lo else []
    modes = list(ds.index.sequence_modes[lo:hi]) if h.multimodal else [0] * len(parts)
    if isinstance(parts, tuple):
        parts = parts[0]
    ids = [int(t) for part in parts for t in part]
    out = {"shard": prefix, "document": index, "num_tokens": len(ids), "token_ids_head": ids[:32]}
    if tokenizer is not None:
        pieces = []
        for part, mode in zip(parts, modes):
            text = tokenizer.decode([int(t) for t in part])
            if mode == MODE_ANSWER:
                text = f"[[{text}]]"
            elif mode == MODE_REFERENCE:
                text = f"{{ref: {text}}}"
            pieces.append(text)
        text = "".join(pieces)
        if len(text) > max_chars:
            text = text[:max_chars] + f" ... [{len(text) - max_chars} more chars]"
        out["text"] = text
    return out


def format_report(r: dict) -> str:
    lines = [
        f"{r['path']}: {r['kind']} data, {r['shards']} shard(s), {r['documents']:,} documents, {r['tokens']:,} tokens",
        "length (tokens): min {min}  mean {mean:.1f}  median {median:.0f}  max {max}".format(**r["length"]),
        "histogram:",
    ]
    peak = max((c for _, _, c in r["histogram"]), default=1)
    for lo, hi, c in r["histogram"]:
        lines.append(f"  [{lo:>7}, {hi:>7})  {c:>9,}  " + "#" * max(1, round(40 * c / peak)))
    if r.get("skipped"):
        lines.append("skipped while building: " + ", ".join(f"{k}={v}" for k, v in r["skipped"].items()))
    if "spans" in r:
        s = r["spans"]
        lines.append(
            f"answer spans: {s['answer_spans']:,} spans, {s['answer_tokens']:,} tokens "
            f"({100 * s['coverage']:.1f}% of non-reference tokens), "
            f"{s['documents_with_answer']:,} documents with an answer"
        )
        if s["reference_tokens"]:
            lines.append(f"reference answers: {s['reference_tokens']:,} tokens")
    if "sample" in r:
        smp = r["sample"]
        lines.append(f"sample: document {smp['document']} of {smp['shard']} ({smp['num_tokens']} tokens)")
        if "text" in smp:
            lines.append("  (answer spans in [[ ]])" if "spans" in r else "")
            lines.append(smp["text"])
        else:
            lines.append(f"  token ids: {smp['token_ids_head']} ... (pass --tokenizer to decode)")
    return "\n".join(line for line in lines if line != "")
