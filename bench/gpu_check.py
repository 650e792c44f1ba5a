"""One-shot GPU check: the first run on an H100/H200 turns into a table of every figure next to
its target.

    python bench/gpu_check.py --out gpu_check/            # on one GPU, < 9 minutes
    python bench/gpu_check.py --out /tmp/gc --dry-run     # CPU: the plan and the report format

Sections (each under its own time guard; a section that runs out of time records what it
skipped, and the report is written whatever happens):

1. ``correctness``: bf16 forward / backward / decode of the Triton kernels against the fp32
   reference op on pretrain, sft, prefill and packed layouts (max abs error per tensor), and a
   layer forward+backward under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync).
2. ``kernels``: TFLOP/s (counting the pairs the mask allows) of the output stream, the base
   stream and the sft / prefill layouts, forward and backward, T = 4K..32K, head_dim 128, GQA
   32/8, next to SDPA flash on the same causal problem; the configs the autotuner chose.
3. ``train``: one training step (forward, backward, AdamW) of the 1.3B shape at T=4096 with as
   many layers as fit, Orthros (Triton) and the dense baseline (SDPA): tokens/s and MFU from each
   model's own FLOPs (``train/metrics.layout_flops``), peak memory next to ``train/memory.py``.
4. ``inference``: prefill time to first token and decode tokens/s at 32K and 128K, Orthros vs
   the dense baseline (same shape and layers).

Targets: output stream >= 80% of SDPA-flash TFLOP/s; base stream time <= 1.3x its allowed pairs
at the output stream's rate; 1.3B-shape MFU >= 50%. Writes ``gpu_check.json`` and
``gpu_check.md`` into ``--out``. ``--dry-run`` runs the correctness section at a tiny size on the
Triton interpreter (CPU) and only plans the others (cases, FLOPs, memory estimates, nothing timed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as attn_bench  # noqa: E402  (bench/attention.py: problems, FLOPs, timing)

from orthros_train.model import OrthrosConfig, OrthrosForCausalLM  # noqa: E402
from orthros_train.ops import triton_attention as ta  # noqa: E402
from orthros_train.ops.reference import UNBOUNDED, attention_reference  # noqa: E402
from orthros_train.ops.triton_decode import decode_attention  # noqa: E402
from orthros_train.parallel.setup import ParallelConfig  # noqa: E402
from orthros_train.phase import pretrain_layout  # noqa: E402
from orthros_train.train.memory import GIB, estimate_memory  # noqa: E402
from orthros_train.train.metrics import layout_flops, peak_tflops  # noqa: E402

TARGETS = {
    "output_vs_sdpa": 0.80,  # output-stream TFLOP/s / SDPA flash TFLOP/s, >=
    "base_time_ratio": 1.30,  # base-stream time / (its pairs at the output stream's rate), <=
    "mfu": 0.50,  # 1.3B-shape training MFU, >=
}
# Seconds per section (8.5 minutes in all; a run also stops at TOTAL_BUDGET_S).
BUDGET_S = {"correctness": 60, "kernels": 170, "train": 150, "inference": 130}
SHAPE_1P3B = dict(
    vocab_size=32000, hidden_size=2048, num_attention_heads=32, num_key_value_heads=32, head_dim=64,
    intermediate_size=5632, sliding_window=128, max_position_embeddings=131072,
)
# bf16 tolerances against the fp32 reference on unit-variance inputs: the kernels' error is the
# bf16 rounding of their inputs/outputs (about 2**-8 relative), scaled by each tensor's size.
TOL = {"out": 2e-2, "lse": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}


TOTAL_BUDGET_S = 8.5 * 60  # the whole run, whatever the sections left over
_RUN_DEADLINE = [math.inf]  # set by main()


class Guard:
    """Time budget of one section (capped by the whole run's): ``ok()`` is false once spent."""

    def __init__(self, seconds: float) -> None:
        self.deadline = min(time.monotonic() + seconds, _RUN_DEADLINE[0])
        self.skipped: list[str] = []

    def ok(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False


@contextmanager
def section(report: dict, name: str):
    t0 = time.monotonic()
    entry = report["sections"].setdefault(name, {"rows": []})
    try:
        yield entry
    except Exception as exc:  # noqa: BLE001 - a failed section is a result; the others still run
        entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
    entry["seconds"] = round(time.monotonic() - t0, 1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 1. correctness
# ---------------------------------------------------------------------------------------------


def correctness_cases(dry: bool) -> list[dict]:
    t = 64 if dry else 4096
    heads, kv, d, w = (2, 1, 16, 8) if dry else (32, 8, 128, 128)
    cases = []
    for layout in ("pretrain", "sft", "prefill"):
        qi, qw, cu = attn_bench.make_queries(layout, t, w)
        cases.append({"layout": layout, "q_index": qi, "q_window": qw, "cu": cu})
    # packed: several documents in one sequence, sft-like output tokens on every 3rd position
    cu = torch.tensor([0, t // 5, t // 2, t - t // 8, t], dtype=torch.int32)
    out = torch.arange(0, t, 3)
    qi = torch.cat([torch.arange(t), out])
    qw = torch.cat([torch.full((t,), w), torch.full((out.numel(),), UNBOUNDED)])
    cases.append({"layout": "packed", "q_index": qi, "q_window": qw, "cu": cu})
    for c in cases:
        c.update(T=t, heads=heads, kv_heads=kv, head_dim=d)
    return cases


def max_errors(got: list[torch.Tensor], want: list[torch.Tensor], names: list[str]) -> dict[str, float]:
    """Max abs error per tensor, relative to the reference tensor's max magnitude."""
    return {
        n: float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp(min=1e-6))
        for n, a, b in zip(names, got, want)
    }


def run_correctness(report: dict, dev: torch.device, dry: bool) -> None:
    with section(report, "correctness") as sec:
        guard = Guard(math.inf if dry else BUDGET_S["correctness"])  # a dry run checks every case
        dtype = torch.float32 if dry else torch.bfloat16  # the interpreter's bf16 is not the GPU's
        if dry:
            ta.set_block_sizes(16, 16)
        g = torch.Generator().manual_seed(0)
        for c in correctness_cases(dry):
            if not guard.ok(c["layout"]):
                continue
            n_q, t = c["q_index"].numel(), c["T"]
            q32 = torch.randn(n_q, c["heads"], c["head_dim"], generator=g)
            k32 = torch.randn(t, c["kv_heads"], c["head_dim"], generator=g)
            v32 = torch.randn(t, c["kv_heads"], c["head_dim"], generator=g)
            dout = torch.randn(q32.shape, generator=g).to(dev)
            qi, qw, cu = c["q_index"].to(dev), c["q_window"].to(dev), c["cu"].to(dev)
            ins = [x.to(dev, dtype).requires_grad_() for x in (q32, k32, v32)]
            out, lse = ta.attention_triton(*ins, qi, qw, cu, decode=False)
            got = [out, lse, *torch.autograd.grad(out, ins, dout.to(out.dtype))]
            ref_in = [x.detach().float().requires_grad_() for x in ins]  # same rounded inputs, fp32 math
            r_out, r_lse = attention_reference(*ref_in, qi, qw, cu)
            want = [r_out, r_lse, *torch.autograd.grad(r_out, ref_in, dout.float())]
            errs = max_errors(got, want, ["out", "lse", "dq", "dk", "dv"])
            sec["rows"].append({"check": f"{c['layout']} fwd+bwd", "T": t, "dtype": str(dtype).split(".")[-1],
                                "max_rel_err": errs, "ok": all(errs[n] <= TOL[n] for n in errs)})
        # decode: ragged cache lengths, one base + one output query per row
        if guard.ok("decode"):
            lens = [70, 17, 1] if dry else [32768, 4099, 1]
            heads, kv, d = (2, 1, 16) if dry else (32, 8, 128)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            qi = (cu[1:] - 1).long().repeat_interleave(2)
            qw = torch.tensor([128, UNBOUNDED]).repeat(len(lens))
            n_k = int(cu[-1])
            q, k, v = (torch.randn(n, hh, d, generator=g).to(dev, dtype)
                       for n, hh in ((qi.numel(), heads), (n_k, kv), (n_k, kv)))
            out, lse = decode_attention(q, k, v, qi.to(dev), qw.to(dev), cu.to(dev))
            r_out, r_lse = attention_reference(q.float(), k.float(), v.float(), qi.to(dev), qw.to(dev), cu.to(dev))
            errs = max_errors([out, lse], [r_out, r_lse], ["out", "lse"])
            sec["rows"].append({"check": f"decode ragged {lens}", "dtype": str(dtype).split(".")[-1],
                                "max_rel_err": errs, "ok": all(errs[n] <= TOL[n] for n in errs)})
        for backend in ("triton", "auto"):  # auto: what a recipe without attention_backend gets
            if not dry and guard.ok(f"sync-free layers ({backend})"):
                sec["rows"].append(sync_free_check(dev, backend))
        if dry:
            ta.set_block_sizes(None)
        sec["skipped"] = guard.skipped


def sync_free_check(dev: torch.device, backend: str) -> dict:
    """Two layers of the 1.3B shape, forward + backward, under CUDA's sync detector."""
    from orthros_train.model.orthros import plan_for_layout

    cfg = OrthrosConfig(**{**SHAPE_1P3B, "num_hidden_layers": 2, "attention_backend": backend})
    model = OrthrosForCausalLM(cfg).to(dev, torch.bfloat16)
    layout = pretrain_layout(torch.randint(0, cfg.vocab_size, (1, 2048))).to(dev)

    def step():
        plan = plan_for_layout(cfg, layout)
        x = model.embed_tokens(layout.input_ids)
        y = x[layout.output_index]
        for layer in model.layers:
            x, y = layer(x, y, plan)
        return x.float().sum() + y.float().sum()

    step().backward()  # warm-up: autotuning synchronises, once
    _sync()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step().backward()
        ok, err = True, None
    except RuntimeError as exc:
        ok, err = False, str(exc)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"check": f"2 layers fwd+bwd, backend {backend}, under set_sync_debug_mode('error')", "ok": ok,
            "error": err}


# ---------------------------------------------------------------------------------------------
# 2. kernel speed
# ---------------------------------------------------------------------------------------------

KERNEL_T = (4096, 8192, 16384, 32768)
KERNEL_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "window": 128}
STREAMS = (("pretrain", "output"), ("pretrain", "base"), ("sft", "both"), ("prefill", "both"))


def kernel_plan() -> list[dict]:
    h, d, w = KERNEL_SHAPE["heads"], KERNEL_SHAPE["head_dim"], KERNEL_SHAPE["window"]
    rows = []
    for t in KERNEL_T:
        rows.append({"T": t, "case": "sdpa flash causal", "pairs": t * (t + 1) // 2})
        for layout, streams in STREAMS:
            qi, qw, cu = attn_bench.make_queries(layout, t, w, streams)
            pairs = attn_bench.unmasked_pairs(qi, qw, cu)
            rows.append({"T": t, "case": f"orthros {layout}[{streams}]", "pairs": pairs})
    for r in rows:
        fwd, bwd = attn_bench.flops(r["pairs"], h, d)
        r.update(fwd_gflop=fwd / 1e9, bwd_gflop=bwd / 1e9, fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None)
    return rows


def run_kernels(report: dict, dev: torch.device, dry: bool) -> None:
    with section(report, "kernels") as sec:
        rows = kernel_plan()
        sec["rows"] = rows
        sec["shape"] = {**KERNEL_SHAPE, "dtype": "bfloat16"}
        if dry:
            return
        guard = Guard(BUDGET_S["kernels"])
        h, hkv, d, w = (KERNEL_SHAPE[k] for k in ("heads", "kv_heads", "head_dim", "window"))
        g = torch.Generator(device=dev).manual_seed(0)
        for t in KERNEL_T:
            if not guard.ok(f"T={t}"):
                continue
            k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
            for r in (r for r in rows if r["T"] == t):
                if not guard.ok(f"T={t} {r['case']}"):
                    continue
                if r["case"].startswith("sdpa"):
                    qs = torch.randn(1, h, t, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                    ks = k.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
                    vs = v.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
                    f_ms, b_ms = attn_bench.fwd_bwd_ms(attn_bench.sdpa_causal_fn(qs, ks, vs, True), (qs, ks, vs), True)
                else:
                    layout, streams = r["case"].split()[1].rstrip("]").split("[")
                    qi, qw, cu = (x.to(dev) for x in attn_bench.make_queries(layout, t, w, streams))
                    q = torch.randn(qi.numel(), h, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                    f_ms, b_ms = attn_bench.fwd_bwd_ms(attn_bench.orthros_fn(q, k, v, qi, qw, cu), (q, k, v), True)
                r.update(fwd_ms=f_ms, bwd_ms=b_ms, fwd_tflops=r["fwd_gflop"] / f_ms, bwd_tflops=r["bwd_gflop"] / b_ms)
            torch.cuda.empty_cache()
        sec["autotuned"] = chosen_configs()
        sec["skipped"] = guard.skipped


def chosen_configs() -> dict[str, str]:
    """The configs the autotuners settled on, per kernel, stream class and key."""
    out = {}
    for name, tuners in (("fwd", ta._FWD), ("dq", ta._BWD_DQ), ("dkdv", ta._BWD_DKDV)):
        for cls, tuner in tuners.items():
            for key, cfg in getattr(tuner, "cache", {}).items():
                out[f"{name}[{cls}] {key}"] = str(cfg)
    return out


def kernel_targets(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["T"], r["case"]): r for r in rows}
    for t in KERNEL_T:
        sd, o, b = by[t, "sdpa flash causal"], by[t, "orthros pretrain[output]"], by[t, "orthros pretrain[base]"]
        for ph in ("fwd", "bwd"):
            ratio = o[f"{ph}_tflops"] / sd[f"{ph}_tflops"] if o[f"{ph}_tflops"] and sd[f"{ph}_tflops"] else None
            out.append(_target(f"T={t} output stream {ph} TFLOP/s / SDPA flash", ratio, ">=", "output_vs_sdpa"))
            ideal = o[f"{ph}_ms"] * b["pairs"] / o["pairs"] if o[f"{ph}_ms"] else None
            ratio = b[f"{ph}_ms"] / ideal if ideal and b[f"{ph}_ms"] else None
            out.append(_target(f"T={t} base stream {ph} time / pairs at output rate", ratio, "<=", "base_time_ratio"))
    return out


def _target(what: str, value: float | None, op: str, key: str) -> dict:
    goal = TARGETS[key]
    met = None if value is None else (value >= goal if op == ">=" else value <= goal)
    return {"target": what, "value": value, "goal": f"{op} {goal}", "met": met}


# ---------------------------------------------------------------------------------------------
# 3. training step at the 1.3B shape
# ---------------------------------------------------------------------------------------------


def layers_that_fit(device_bytes: int, seq_len: int = 4096) -> tuple[int, dict]:
    """Most layers (<= 24) whose modelled peak stays under 85% of the device (the dense model,
    which keeps no output stream, needs less: the Orthros estimate decides)."""
    best, est = 1, None
    for n in range(1, 25):
        cfg = OrthrosConfig(**{**SHAPE_1P3B, "num_hidden_layers": n})
        e = estimate_memory(cfg, ParallelConfig(), seq_len, 1, "bf16", "flash", 1.0)
        if e.total > 0.85 * device_bytes:
            break
        best, est = n, e
    return best, (est.as_gib() if est else {})


def run_train(report: dict, dev: torch.device, dry: bool) -> None:
    with section(report, "train") as sec:
        device_bytes = torch.cuda.get_device_properties(dev).total_memory if not dry else 80 * GIB
        n_layers, est = layers_that_fit(device_bytes)
        t = 4096
        sec.update(seq_len=t, layers=n_layers, device_gib=round(device_bytes / GIB, 1), estimate_gib=est,
                   note="1.3B shape (hidden 2048, 32 heads of 64, 5632 MLP, vocab 32000); AdamW; bf16 weights")
        layout = pretrain_layout(torch.randint(0, 32000, (1, t), generator=torch.Generator().manual_seed(0)))
        for kind, backend in (("orthros", "triton"), ("dense", "sdpa")):
            cfg = OrthrosConfig(**{**SHAPE_1P3B, "num_hidden_layers": n_layers, "attention_type": kind,
                                   "attention_backend": backend})
            row = {"model": kind, "backend": backend, "flops_per_step": layout_flops(cfg, layout),
                   "step_ms": None, "tokens_per_s": None, "mfu": None, "peak_gib": None}
            sec["rows"].append(row)
            if dry:
                continue
            guard = Guard(BUDGET_S["train"] / 2)
            row.update(measure_train_step(cfg, layout.to(dev), dev, guard))
            row["tokens_per_s"] = t / row["step_ms"] * 1e3 if row["step_ms"] else None
            peak = peak_tflops(dev)
            if row["step_ms"] and peak:
                row["mfu"] = row["flops_per_step"] / (row["step_ms"] / 1e3) / (peak * 1e12)
            row["skipped"] = guard.skipped


def measure_train_step(cfg: OrthrosConfig, layout, dev: torch.device, guard: Guard) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    model = OrthrosForCausalLM(cfg).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = []
    for i in range(8):
        if i >= 3 and not guard.ok(f"step {i}"):
            break
        _sync()
        t0 = time.perf_counter()
        loss = model.forward_layout(layout).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i >= 2:  # two warm-up steps: autotuning, allocator
            times.append((time.perf_counter() - t0) * 1e3)
    out = {"step_ms": sorted(times)[len(times) // 2] if times else None,
           "peak_gib": torch.cuda.max_memory_allocated(dev) / GIB}
    del model, opt
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# 4. prefill / decode
# ---------------------------------------------------------------------------------------------

PROMPTS = (32768, 131072)
DECODE_STEPS = 32


def run_inference(report: dict, dev: torch.device, dry: bool, n_layers: int) -> None:
    with section(report, "inference") as sec:
        guard = Guard(BUDGET_S["inference"])
        sec["layers"] = n_layers
        for kind, backend in (("orthros", "triton"), ("dense", "sdpa")):
            cfg = OrthrosConfig(**{**SHAPE_1P3B, "num_hidden_layers": n_layers, "attention_type": kind,
                                   "attention_backend": backend})
            model = None if dry else OrthrosForCausalLM(cfg).to(dev, torch.bfloat16).eval()
            for t in PROMPTS:
                row = {"model": kind, "prompt": t, "ttft_ms": None, "decode_tokens_per_s": None}
                sec["rows"].append(row)
                if dry or not guard.ok(f"{kind} T={t}"):
                    continue
                ids = torch.randint(0, cfg.vocab_size, (1, t), device=dev)
                with torch.no_grad():
                    model.prefill(ids[:, :1024])  # warm-up (autotuning)
                    _sync()
                    t0 = time.perf_counter()
                    logits, cache = model.prefill(ids)
                    _sync()
                    row["ttft_ms"] = (time.perf_counter() - t0) * 1e3
                    nxt = logits.argmax(-1)
                    logits, cache = model.decode_step(nxt, cache)  # warm-up
                    _sync()
                    t0 = time.perf_counter()
                    for _ in range(DECODE_STEPS):
                        logits, cache = model.decode_step(logits.argmax(-1), cache)
                    _sync()
                    row["decode_tokens_per_s"] = DECODE_STEPS / (time.perf_counter() - t0)
                del cache, logits
                torch.cuda.empty_cache()
            del model
        by = {(r["model"], r["prompt"]): r for r in sec["rows"]}
        sec["speedups"] = [
            {"prompt": t,
             "ttft_dense_over_orthros": _ratio(by["dense", t]["ttft_ms"], by["orthros", t]["ttft_ms"]),
             "decode_orthros_over_dense": _ratio(by["orthros", t]["decode_tokens_per_s"],
                                                 by["dense", t]["decode_tokens_per_s"])}
            for t in PROMPTS
        ]
        sec["skipped"] = guard.skipped


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']}, torch {report['torch']}, triton {report['triton']}"
             + (" — **dry run: nothing was measured**" if report["dry_run"] else ""), ""]
    s = report["sections"]
    if "correctness" in s:
        lines += ["## Correctness (max abs error / max |reference|)", "",
                  "| check | errors | ok |", "| --- | --- | --- |"]
        for r in s["correctness"]["rows"]:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in r.get("max_rel_err", {}).items()) or r.get("error") or ""
            lines.append(f"| {r['check']} | {errs} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if "kernels" in s:
        k = s["kernels"]
        lines += [f"## Kernels ({k.get('shape')})", "",
                  "| T | case | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |", "| --- | --- | --- | --- | --- | --- |"]
        for r in k["rows"]:
            lines.append(f"| {r['T']} | {r['case']} | {_f(r['fwd_ms'], '.3f')} | {_f(r['fwd_tflops'], '.1f')} | "
                         f"{_f(r['bwd_ms'], '.3f')} | {_f(r['bwd_tflops'], '.1f')} |")
        lines.append("")
    if "train" in s:
        tr = s["train"]
        lines += [f"## Training step, 1.3B shape, T={tr.get('seq_len')}, {tr.get('layers')} layers "
                  f"(estimate {tr.get('estimate_gib', {}).get('total')} GiB of {tr.get('device_gib')} GiB)", "",
                  "| model | step ms | tokens/s | MFU | peak GiB |", "| --- | --- | --- | --- | --- |"]
        for r in tr["rows"]:
            lines.append(f"| {r['model']} ({r['backend']}) | {_f(r['step_ms'], '.1f')} | "
                         f"{_f(r['tokens_per_s'], '.0f')} | {_f(r['mfu'], '.1%')} | {_f(r['peak_gib'], '.1f')} |")
        lines.append("")
    if "inference" in s:
        lines += [f"## Prefill / decode ({s['inference'].get('layers')} layers)", "",
                  "| model | prompt | TTFT ms | decode tokens/s |", "| --- | --- | --- | --- |"]
        for r in s["inference"]["rows"]:
            lines.append(f"| {r['model']} | {r['prompt']} | {_f(r['ttft_ms'], '.0f')} | "
                         f"{_f(r['decode_tokens_per_s'], '.1f')} |")
        lines.append("")
    lines += ["## Targets", "", "| target | value | goal | met |", "| --- | --- | --- | --- |"]
    for t in report["targets"]:
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {_f(t['value'], '.3f')} | {t['goal']} | {met} |")
    for name, sec in s.items():
        if sec.get("error") or sec.get("skipped"):
            lines.append(f"\n{name}: error {sec.get('error')}; skipped (time) {sec.get('skipped')}")
    return "\n".join(lines) + "\n"


def all_targets(report: dict) -> list[dict]:
    s = report["sections"]
    out = kernel_targets(s["kernels"]["rows"]) if "rows" in s.get("kernels", {}) else []
    for r in s.get("train", {}).get("rows", []):
        out.append(_target(f"1.3B-shape training MFU ({r['model']})", r["mfu"], ">=", "mfu"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny correctness run, plan the rest, time nothing")
    p.add_argument("--sections", default="correctness,kernels,train,inference")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --dry-run to check the plan and report format on CPU")
    sections = [x for x in args.sections.split(",") if x]
    unknown = set(sections) - set(BUDGET_S)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {list(BUDGET_S)}")
    dev = torch.device("cpu" if args.dry_run else "cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "device": f"CPU ({platform.machine()}), dry run" if args.dry_run else torch.cuda.get_device_name(dev),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "dry_run": args.dry_run, "targets_goal": TARGETS, "budget_s": BUDGET_S, "sections": {},
    }
    t0 = time.monotonic()
    if not args.dry_run:
        _RUN_DEADLINE[0] = t0 + TOTAL_BUDGET_S
    if "correctness" in sections:
        run_correctness(report, dev, args.dry_run)
    if "kernels" in sections:
        run_kernels(report, dev, args.dry_run)
    if "train" in sections:
        run_train(report, dev, args.dry_run)
    if "inference" in sections:
        n_layers = report["sections"].get("train", {}).get("layers") or layers_that_fit(
            80 * GIB if args.dry_run else torch.cuda.get_device_properties(dev).total_memory)[0]
        run_inference(report, dev, args.dry_run, n_layers)
    report["targets"] = all_targets(report)
    report["seconds"] = round(time.monotonic() - t0, 1)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    failed = [r for r in report["sections"].get("correctness", {}).get("rows", []) if not r["ok"]]
    return 1 if failed or any(s.get("error") for s in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
