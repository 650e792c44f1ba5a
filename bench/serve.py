"""TTFT and decode speed of an Orthros model against the dense Llama of the same weights, both in vLLM.

The paper's serving figures (one H100, 128K prompt: TTFT 77.2 s -> 17.0 s, decode 33.7 vs 33.3
tokens/s) come from a serving engine; this measures the same two numbers in one engine, vLLM,
for a random-weight Orthros model of a preset shape (``20m`` by default) exported with
``orthros-convert to-hf`` and for its dense twin (the same weights as ``LlamaForCausalLM``).

How it measures, so that ratios hold on a shared machine:

* Both engines live in this process (engine core in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
  with ``--threads`` torch threads (1 by default), and are stepped in turn, one engine step each,
  so both see the same load. Every step is timed in process CPU time (``time.process_time``: the
  time this process ran, not the time it waited for a core) and in wall time; the ratios are
  those of CPU time.
* Per prompt length and batch size, each repeat adds ``batch`` random prompts to both engines
  (prefix caching off, ``max_tokens = --decode-tokens + 1``, the whole batch prefilled in one
  step). TTFT is the time of the steps until every request has its first token, best of
  ``--repeats``; decode tokens/s is ``batch`` over the median time of the steps after that (one
  token per request each), over all repeats.
* Beside each TTFT ratio (Llama / Orthros) stand its FLOP-ratio limits (``eval/bench.py``: dense
  forward FLOPs per token over Orthros', every Orthros layer counted in full; and with the last
  layer's base stream doing only its K/V projections: the vLLM model skips that layer's base
  attention and MLP, but still projects the queries there, as one fused QKV product) and the
  ratio's share of each.
* Both engines run as vLLM runs them by default (compiled: on CPU one dynamo trace, inductor),
  or eagerly with ``--eager``.
* ``--speculative ngram``: the Orthros engine decodes with vLLM's n-gram speculative decoding
  (``k`` draft tokens a step) beside the plain Llama (one n-gram engine per process: see
  ``main``); decode tokens/s is then the tokens of all decode steps over their time, and the
  accepted-token rate (vLLM's counters) is printed and written to the JSON.
* The window check times vLLM's CPU paged-attention op as the base stream calls it in one layer
  (``T`` queries over ``T`` cached keys of the preset's heads) with the window ``W`` and without
  one: whether the kernel skips the keys outside the window.

Run it in the serving environment (``make serve-env``)::

    .venv-serve/bin/python bench/serve.py --lengths 1024,4096,16384 --batches 1,2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process

import torch  # noqa: E402

from orthros_train.convert.to_hf import convert_to_hf, export_llama_twin  # noqa: E402
from orthros_train.eval.bench import prefill_flop_limits  # noqa: E402
from orthros_train.infer.loading import PRESETS  # noqa: E402
from orthros_train.model.config import OrthrosConfig  # noqa: E402
from orthros_train.model.orthros import OrthrosForCausalLM  # noqa: E402

MODELS = ("orthros", "llama")


def build_models(preset: str, root: Path, max_len: int) -> tuple[OrthrosConfig, Path, Path]:
    """(config, Orthros export dir, dense Llama twin dir) of random weights of ``preset``."""
    cfg = OrthrosConfig(**{**PRESETS[preset], "max_position_embeddings": max_len})
    return (cfg, *random_export(cfg, root))


def random_export(cfg: OrthrosConfig, root: Path) -> tuple[Path, Path]:
    """(Orthros export dir, dense Llama twin dir) of a random-weight model of ``cfg`` under ``root``
    (also gpu_check's serving section)."""
    model = OrthrosForCausalLM(cfg)
    model.reset_parameters(torch.Generator().manual_seed(0))
    model.save_pretrained(root / "orthros")
    export = root / "export"
    convert_to_hf(root / "orthros", export)
    hf = json.loads((export / "config.json").read_text())
    hf.setdefault("eos_token_id", 0)
    (export / "config.json").write_text(json.dumps(hf))
    return export, export_llama_twin(export, root / "llama")


def make_engine(model_dir: Path, cfg: OrthrosConfig, max_len: int, max_batch: int, max_prompt: int, eager: bool,
                speculative: dict | None = None):
    """An fp32 engine whose step budget prefills a whole batch at once, with cache for it; compiled
    as vLLM compiles by default (on CPU: one dynamo trace, inductor) unless ``eager``; with
    ``speculative`` (vLLM's speculative_config) it counts drafts and accepted tokens."""
    from vllm import LLM

    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, fp32
    kv_bytes = max_batch * (max_len + 256) * per_token + (64 << 20)
    extra = dict(speculative_config=speculative, disable_log_stats=False) if speculative else {}
    return LLM(model=str(model_dir), dtype="float32", enforce_eager=eager, max_model_len=max_len,
               enable_prefix_caching=False, kv_cache_memory_bytes=kv_bytes, skip_tokenizer_init=True, seed=0,
               max_num_seqs=max_batch, max_num_batched_tokens=max(max_len, max_prompt * max_batch), **extra)


def acceptance(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters of an engine (drafts, draft tokens, accepted tokens)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}


class Run:
    """One batch of requests in one engine, stepped from outside and timed per step."""

    def __init__(self, llm, tag: str, prompts: list[list[int]], new_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.engine = llm.llm_engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        self.ids = [f"{tag}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(self.ids, prompts):
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        self.tokens = dict.fromkeys(self.ids, 0)
        self.ttft_cpu = self.ttft_wall = 0.0
        self.decode_steps: list[tuple[float, float]] = []  # (cpu s, wall s) of steps after the first tokens
        self.decode_tokens = 0  # tokens those steps produced (more than one per request under speculation)

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        prefilled = all(self.tokens.values())
        c0, w0 = time.process_time(), time.perf_counter()
        outputs = self.engine.step()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        before = sum(self.tokens.values())
        for out in outputs:
            self.tokens[out.request_id] = len(out.outputs[0].token_ids)
        if prefilled:
            self.decode_steps.append((cpu, wall))
            self.decode_tokens += sum(self.tokens.values()) - before
        else:
            self.ttft_cpu += cpu
            self.ttft_wall += wall


def measure(engines: dict, lengths: list[int], batches: list[int], decode_tokens: int, repeats: int,
            vocab: int, speculative: bool = False) -> dict[tuple[str, int, int], dict[str, float]]:
    """TTFT and decode tokens/s per (model, prompt, batch). Under speculation a decode step yields up
    to 1 + k tokens per request: decode tokens/s is then the tokens over the time of all decode steps."""
    g = torch.Generator().manual_seed(1)
    out: dict[tuple[str, int, int], dict[str, float]] = {}
    for t in lengths:
        for b in batches:
            ttft = {m: [] for m in engines}
            steps = {m: [] for m in engines}
            produced = dict.fromkeys(engines, 0)
            for r in range(repeats):
                prompts = [torch.randint(1, vocab, (t,), generator=g).tolist() for _ in range(b)]
                runs = {m: Run(llm, f"{t}-{b}-{r}-{m}", prompts, decode_tokens + 1) for m, llm in engines.items()}
                while not all(run.done for run in runs.values()):
                    for run in runs.values():  # one step of each engine in turn: the same load for both
                        if not run.done:
                            run.step()
                for m, run in runs.items():
                    produced[m] += run.decode_tokens
                    if not speculative and len(run.decode_steps) != decode_tokens:
                        raise RuntimeError(f"{m}: expected {decode_tokens} decode steps after one prefill step, "
                                           f"got {len(run.decode_steps)} (was the batch prefilled in chunks?)")
                    ttft[m].append((run.ttft_cpu, run.ttft_wall))
                    steps[m].extend(run.decode_steps)
            for m in engines:
                row = {"ttft_cpu_s": min(c for c, _ in ttft[m]), "ttft_wall_s": min(w for _, w in ttft[m])}
                if speculative:
                    row["decode_tok_s_cpu"] = produced[m] / sum(c for c, _ in steps[m])
                    row["decode_tok_s_wall"] = produced[m] / sum(w for _, w in steps[m])
                else:
                    row["decode_tok_s_cpu"] = b / statistics.median(c for c, _ in steps[m])
                    row["decode_tok_s_wall"] = b / statistics.median(w for _, w in steps[m])
                out[(m, t, b)] = row
                print(f"  {m}: T={t} B={b} TTFT {row['ttft_cpu_s']:.3f} s CPU ({row['ttft_wall_s']:.3f} s wall), "
                      f"decode {row['decode_tok_s_cpu']:.1f} tok/s CPU ({row['decode_tok_s_wall']:.1f} wall)",
                      file=sys.stderr, flush=True)
    return out


def window_check(cfg: OrthrosConfig, lengths: list[int], block_size: int, repeats: int) -> list[dict[str, float]]:
    """CPU time of vLLM's CPU paged-attention op for one layer's base stream: window W vs none."""
    from vllm import _custom_ops as ops
    from vllm import envs

    # The engine's choice of kernel variant (ISA) for this dtype and block size; vLLM keeps it in
    # its CPU backend module, and the op needs it to read the cache layout that variant writes.
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    h, kv, d, w = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window
    isa = _get_attn_isa(torch.float32, block_size, d)
    g = torch.Generator().manual_seed(2)
    rows = []
    for t in lengths:
        blocks = -(-t // block_size)
        cache = torch.randn(blocks, kv, block_size * 2, d, generator=g)  # the CPU layout: K and V per block
        key_cache, value_cache = cache.chunk(2, dim=2)
        q = torch.randn(t, h, d, generator=g)
        out = torch.empty_like(q)
        qsl, seq = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        row = {"prompt": t, "window": w}
        for name, window in (("windowed_ms", w), ("full_ms", -1)):
            schedule = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=h, num_kv_heads=kv, head_dim=d, seq_lens=seq, dtype=torch.float32,
                query_start_loc=qsl, causal=True, sliding_window_size=window, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
            best = float("inf")
            for _ in range(repeats):
                c0 = time.process_time()
                ops.cpu_attention_with_kv_cache(
                    query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
                    seq_lens=seq, scale=d**-0.5, causal=True, alibi_slopes=None, sliding_window=window,
                    block_table=table, softcap=0, scheduler_metadata=schedule, s_aux=None)
                best = min(best, time.process_time() - c0)
            row[name] = 1e3 * best
        row["speedup"] = row["full_ms"] / row["windowed_ms"]
        # Keys per query: causal full attention reads (T + 1) / 2 on average; a window W reads at most
        # W, or, a cache block at a time, the blocks the window overlaps (W + block_size at most).
        row["pair_ratio"] = (t + 1) / 2 / min(w, t)
        rows.append(row)
        print(f"  window check T={t}: W={w} {row['windowed_ms']:.1f} ms, full {row['full_ms']:.1f} ms CPU",
              file=sys.stderr, flush=True)
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="20m", choices=sorted(PRESETS))
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths (comma-separated)")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the project's rule: quote 1)")
    p.add_argument("--window-check", default="4096,16384",
                   help="prompt lengths of the kernel window check (comma-separated; empty: skip it)")
    p.add_argument("--eager", action="store_true",
                   help="run both engines eagerly (--enforce-eager) instead of compiled, vLLM's default")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="the Orthros engine decodes with vLLM's speculative decoding (n-gram prompt lookup) "
                        "beside the plain Llama; the accepted-token rate is reported")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return p


def run_engines(args: argparse.Namespace, lengths: list[int], batches: list[int], env: dict):
    """Build both engines, warm them up and time them: ``(cfg, times, accepted, block_size)``."""
    max_len = max(lengths) + args.decode_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        cfg, export, dense = build_models(args.preset, Path(tmp), max_len)
        env["window"] = cfg.sliding_window
        spec = None
        if args.speculative:
            spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        # Under --speculative only the Orthros engine speculates, and it is built last: vLLM's n-gram
        # proposer imports llvmlite (numba) when its engine starts, after which any new engine's
        # worker in this process fails its kernel-override scan of sys.modules. The Llama decodes
        # plainly beside it: the ratio is what speculation gives Orthros against the plain dense engine.
        built = {"llama": make_engine(dense, cfg, max_len, max(batches), max(lengths), args.eager),
                 "orthros": make_engine(export, cfg, max_len, max(batches), max(lengths), args.eager, spec)}
        engines = {m: built[m] for m in MODELS}
        block_size = engines["orthros"].llm_engine.vllm_config.cache_config.block_size
        for llm in engines.values():  # warm-up: first-call allocations and lazy imports
            warm = Run(llm, "warm", [[1] * 64], 3)
            while not warm.done:
                warm.step()
        times = measure(engines, lengths, batches, args.decode_tokens, args.repeats, cfg.vocab_size,
                        speculative=bool(spec))
        accepted = {"orthros": acceptance(engines["orthros"])} if spec else {}
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    return cfg, times, accepted, block_size


def result_rows(cfg, times: dict, lengths: list[int], batches: list[int]) -> list[dict]:
    """One row per (prompt, batch): both engines' times, their ratios and the FLOP limits."""
    rows = []
    for t in lengths:
        for b in batches:
            o, d = times[("orthros", t, b)], times[("llama", t, b)]
            limit, limit_skip = prefill_flop_limits(cfg, t)
            ratio = d["ttft_cpu_s"] / o["ttft_cpu_s"]
            rows.append({"prompt": t, "batch": b, **{f"orthros_{k}": v for k, v in o.items()},
                         **{f"llama_{k}": v for k, v in d.items()}, "ttft_ratio": ratio, "flop_limit": limit,
                         "pct_of_limit": 100 * ratio / limit, "flop_limit_skip": limit_skip,
                         "pct_of_limit_skip": 100 * ratio / limit_skip,
                         "decode_ratio": o["decode_tok_s_cpu"] / d["decode_tok_s_cpu"]})
    return rows


def print_timings(args: argparse.Namespace, env: dict, cfg, rows: list[dict]) -> None:
    """The header line, then the TTFT and decode tables."""
    print(f"vLLM {env['vllm']} (torch {env['torch']}), preset {args.preset} (W = {cfg.sliding_window}), fp32, "
          f"{env['mode']}, "
          f"{env['machine']}, {env['cpus']} CPUs, {env['torch_threads_during_run']} torch thread(s), {env['utc']}, "
          f"load average {env['load_average_start']:.1f} at start, {env['load_average_end']:.1f} at end")
    print("\nTTFT (process CPU time; wall time beside it), best of", args.repeats)
    print("| prompt | batch | Orthros s | Llama s | Llama/Orthros | FLOP limit | % of limit | FLOP limit, last "
          "layer K/V only | % of it | Orthros wall s | Llama wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['prompt']} | {r['batch']} | {r['orthros_ttft_cpu_s']:.3f} | {r['llama_ttft_cpu_s']:.3f} "
              f"| {r['ttft_ratio']:.2f}x | {r['flop_limit']:.2f}x | {r['pct_of_limit']:.0f}% "
              f"| {r['flop_limit_skip']:.2f}x | {r['pct_of_limit_skip']:.0f}% "
              f"| {r['orthros_ttft_wall_s']:.3f} | {r['llama_ttft_wall_s']:.3f} |")
    print(f"\nDecode tokens/s at the prompt's context (median step of {args.decode_tokens} x {args.repeats}; "
          "CPU time, wall time beside it)")
    print("| prompt | batch | Orthros tok/s | Llama tok/s | Orthros/Llama | Orthros wall tok/s | Llama wall tok/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['prompt']} | {r['batch']} | {r['orthros_decode_tok_s_cpu']:.1f} "
              f"| {r['llama_decode_tok_s_cpu']:.1f} | {r['decode_ratio']:.2f}x "
              f"| {r['orthros_decode_tok_s_wall']:.1f} | {r['llama_decode_tok_s_wall']:.1f} |")


def print_checks(args: argparse.Namespace, cfg, checks: list[dict], block_size: int, accepted: dict) -> None:
    """The window check's table and the speculative acceptance (which gains its ``accept_rate``)."""
    if checks:
        print(f"\nWindow check: vLLM's CPU paged attention, one layer's base stream ({cfg.num_attention_heads} "
              f"heads / {cfg.num_key_value_heads} kv heads of {cfg.head_dim}, cache blocks of {block_size}), "
              "T queries over T keys, process CPU time")
        print("| prompt | window W ms | no window ms | speed-up | keys per query, full / W |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for c in checks:
            print(f"| {c['prompt']} | {c['windowed_ms']:.1f} | {c['full_ms']:.1f} | {c['speedup']:.1f}x "
                  f"| {c['pair_ratio']:.1f}x |")
    for m, c in accepted.items():
        rate = c["accepted"] / c["draft_tokens"] if c.get("draft_tokens") else float("nan")
        c["accept_rate"] = rate
        print(f"\n{m}: speculative decoding ({args.speculative}, k = {args.num_speculative_tokens}, warm-up included): "
              f"{c.get('accepted', 0)} of {c.get('draft_tokens', 0)} draft tokens accepted ({rate:.1%}), "
              f"{c.get('drafts', 0)} drafts")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    check_lengths = [int(x) for x in args.window_check.split(",") if x]
    if not lengths or min(lengths) < 2 or not batches or min(batches) < 1:
        p.error("--lengths need values >= 2 and --batches values >= 1")
    if args.decode_tokens < 1 or args.repeats < 1 or args.threads < 1:
        p.error("--decode-tokens, --repeats and --threads need values >= 1")
    # Set before the engines exist: vLLM's CPU worker turns torch.set_num_threads into a no-op.
    torch.set_num_threads(args.threads)
    import vllm

    env = {"utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": cpu_name(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "vllm": vllm.__version__,
           "torch": torch.__version__, "preset": args.preset, "dtype": "float32", "repeats": args.repeats,
           "decode_tokens": args.decode_tokens, "mode": "eager" if args.eager else "compiled",
           "speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
           "load_average_start": os.getloadavg()[0]}
    cfg, times, accepted, block_size = run_engines(args, lengths, batches, env)
    checks = window_check(cfg, check_lengths, block_size, max(args.repeats, 2)) if check_lengths else []
    env["load_average_end"] = os.getloadavg()[0]
    env["torch_threads_during_run"] = torch.get_num_threads()
    rows = result_rows(cfg, times, lengths, batches)
    print_timings(args, env, cfg, rows)
    print_checks(args, cfg, checks, block_size, accepted)
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows, "window_check": checks,
                                         "speculative": accepted}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
