"""TTFT and decode speed of an Orthros model against the dense Llama of the same shape, both in vLLM.

The paper's serving figures (one H100, 128K prompt: TTFT 77.2 s -> 17.0 s, decode 33.7 vs 33.3
tokens/s) come from a serving engine; this measures the same two numbers in one engine, vLLM,
for a random-weight Orthros model of a preset shape (``20m`` by default) exported with
``orthros-convert to-hf`` and for its dense twin (the same weights as ``LlamaForCausalLM``).

Per prompt length and batch size, with prefix caching off (every repeat prefills anew):

* TTFT: wall time of ``generate`` with ``max_tokens=1`` (prefill + the first token), best of
  ``--repeats``;
* decode tokens/s: ``batch * (N - 1)`` over (time of ``max_tokens=N``) minus (the TTFT), median
  of ``--repeats``.

Beside each TTFT ratio (dense / Orthros) stands its FLOP-ratio limit (``eval/bench.py``:
dense forward FLOPs per token over Orthros', every Orthros layer counted in full) and the ratio's
share of it. Run it in the serving environment (``make serve-env``)::

    .venv-serve/bin/python bench/serve.py --lengths 1024,4096,16384 --batches 1,2 [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process

import torch  # noqa: E402

from orthros_train.convert.to_hf import convert_to_hf  # noqa: E402
from orthros_train.eval.bench import prefill_flop_limits  # noqa: E402
from orthros_train.infer.loading import PRESETS  # noqa: E402
from orthros_train.model.config import OrthrosConfig  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402


def build_models(preset: str, root: Path, max_len: int) -> tuple[OrthrosConfig, Path, Path]:
    """(config, Orthros export dir, dense Llama twin dir) of random weights of ``preset``."""
    from safetensors.torch import load_file, save_file

    cfg = OrthrosConfig(**{**PRESETS[preset], "max_position_embeddings": max_len})
    model = OrthrosForCausalLM(cfg)
    model.reset_parameters(torch.Generator().manual_seed(0))
    model.save_pretrained(root / "orthros")
    export = root / "export"
    convert_to_hf(root / "orthros", export)
    hf = json.loads((export / "config.json").read_text())
    hf.setdefault("eos_token_id", 0)
    (export / "config.json").write_text(json.dumps(hf))
    dense = root / "llama"
    dense.mkdir()
    llama = {k: v for k, v in hf.items() if k not in ("auto_map", "qk_norm", "base_window")}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", mlp_bias=False)
    (dense / "config.json").write_text(json.dumps(llama))
    state = {k: v for k, v in load_file(str(export / "model.safetensors")).items()
             if not k.endswith((".gamma", ".beta"))}
    save_file(state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    return cfg, export, dense


def measure(model_dir: Path, lengths: list[int], batches: list[int], decode_tokens: int, repeats: int,
            max_len: int, vocab: int) -> dict[tuple[int, int], dict[str, float]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=max_len,
              enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30, skip_tokenizer_init=True, seed=0,
              max_num_seqs=max(batches))
    out: dict[tuple[int, int], dict[str, float]] = {}
    g = torch.Generator().manual_seed(1)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=[1] * 64)], SamplingParams(max_tokens=2), use_tqdm=False)
        for t in lengths:
            for b in batches:
                prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (t,), generator=g).tolist())
                           for _ in range(b)]
                first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
                full = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True,
                                      detokenize=False)
                ttfts, totals = [], []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    llm.generate(prompts, first, use_tqdm=False)
                    ttfts.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    llm.generate(prompts, full, use_tqdm=False)
                    totals.append(time.perf_counter() - t0)
                ttft = min(ttfts)
                decode_s = statistics.median(max(x - ttft, 1e-9) for x in totals)
                out[(t, b)] = {"ttft_s": ttft, "decode_tok_s": b * decode_tokens / decode_s}
                print(f"  {model_dir.name}: T={t} B={b} TTFT {ttft:.3f} s, decode {out[(t, b)]['decode_tok_s']:.1f} "
                      "tok/s", file=sys.stderr, flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="20m", choices=sorted(PRESETS))
    p.add_argument("--lengths", default="1024,4096,16384,32768", help="prompt lengths (comma-separated)")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    if not lengths or min(lengths) < 2 or not batches or min(batches) < 1:
        p.error("--lengths need values >= 2 and --batches values >= 1")
    max_len = max(lengths) + args.decode_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        cfg, export, dense = build_models(args.preset, Path(tmp), max_len)
        orthros = measure(export, lengths, batches, args.decode_tokens, args.repeats, max_len, cfg.vocab_size)
        llama = measure(dense, lengths, batches, args.decode_tokens, args.repeats, max_len, cfg.vocab_size)
    rows = []
    for (t, b), o in orthros.items():
        d = llama[(t, b)]
        limit = prefill_flop_limits(cfg, t)[0]
        ratio = d["ttft_s"] / o["ttft_s"]
        rows.append({"prompt": t, "batch": b, "orthros_ttft_s": o["ttft_s"], "dense_ttft_s": d["ttft_s"],
                     "ttft_ratio": ratio, "flop_limit": limit, "pct_of_limit": 100 * ratio / limit,
                     "orthros_decode_tok_s": o["decode_tok_s"], "dense_decode_tok_s": d["decode_tok_s"],
                     "decode_ratio": o["decode_tok_s"] / d["decode_tok_s"]})
    import vllm

    env = {"date": date.today().isoformat(), "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "vllm": vllm.__version__, "preset": args.preset,
           "window": cfg.sliding_window, "dtype": "float32", "repeats": args.repeats,
           "decode_tokens": args.decode_tokens}
    print(f"vLLM {env['vllm']}, preset {args.preset} (W = {cfg.sliding_window}), fp32, {env['cpus']} CPUs, "
          f"torch threads {env['torch_threads']}, {env['utc']}")
    print("| prompt | batch | Orthros TTFT s | Llama TTFT s | TTFT Llama/Orthros | FLOP limit | % of limit "
          "| Orthros decode tok/s | Llama decode tok/s | decode Orthros/Llama |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['prompt']} | {r['batch']} | {r['orthros_ttft_s']:.3f} | {r['dense_ttft_s']:.3f} "
              f"| {r['ttft_ratio']:.2f}x | {r['flop_limit']:.2f}x | {r['pct_of_limit']:.0f}% "
              f"| {r['orthros_decode_tok_s']:.1f} | {r['dense_decode_tok_s']:.1f} | {r['decode_ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
