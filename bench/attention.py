"""Benchmark of the Orthros attention kernels.

GPU: a table of ms and TFLOP/s (counting only the pairs the mask allows) for forward and
backward at T = 4K..128K for the pretrain, sft (10% answer tokens) and prefill layouts, next to
torch SDPA (flash backend, full causal over the same T tokens) and FlexAttention with the same
mask, plus the targets:

* output stream (full causal) >= 80% of SDPA-flash TFLOP/s on the same causal problem;
* base stream (window 128) time <= 1.3x its unmasked FLOPs at the output stream's throughput;
* prefill layout at 128K >= 10x faster than full causal SDPA over the same tokens.

CPU (no CUDA): a small correctness smoke on the Triton interpreter instead (kernel vs reference
op, the FlexAttention mask vs the reference, decode kernel), plus the host-side count of the key
tiles the forward kernel visits at the real sizes (work proportional to the mask).
``--compile-sm90`` compiles every kernel config for an H100/H200 (sm_90) without a GPU, specialised
as the JIT does for aligned tensors, and reports registers, spill bytes and shared memory (``--json``:
one list, one object per compile; ``--head-dim``/``--dtype`` narrow it, default 64 and 128 in
bf16, fp16 and fp32).

    python bench/attention.py [--json] [--seqlens 4096,16384] [--layouts pretrain,sft,prefill]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import sys
import time
from datetime import date

import torch

AOT_FLAGS = ("--compile-sm90", "--probe-hopper")  # the real compiler, not the interpreter
if not torch.cuda.is_available() and not any(flag in sys.argv for flag in AOT_FLAGS):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from orthros_train.ops import triton_attention as ta  # noqa: E402
from orthros_train.ops.reference import UNBOUNDED, attention_reference, key_ranges  # noqa: E402
from orthros_train.ops.triton_decode import decode_attention  # noqa: E402

LAYOUTS = ("pretrain", "sft", "prefill")


# ---------------------------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------------------------


def output_positions(layout: str, t: int, seed: int = 0) -> torch.Tensor:
    """Output-token positions of one row of length t (sft: 10% of tokens in answer spans)."""
    if layout == "pretrain":
        return torch.arange(t)
    if layout == "prefill":
        return torch.tensor([t - 1])
    if layout == "sft":
        g = torch.Generator().manual_seed(seed)
        n_ans = max(1, t // 10)
        span = max(1, min(256, t // 20))
        n_spans = math.ceil(n_ans / span)
        slots = torch.sort(torch.randperm(t // span - 1, generator=g)[:n_spans] + 1).values
        targets = (slots[:, None] * span + torch.arange(span)[None, :]).flatten()[:n_ans]
        return targets - 1  # output token p predicts answer token p + 1
    raise ValueError(layout)


def make_queries(layout: str, t: int, window: int, streams: str = "both"):
    """q_index/q_window of ``[base; output]`` (or one stream) and cu_seqlens of one document."""
    out = output_positions(layout, t)
    parts_i, parts_w = [], []
    if streams in ("both", "base"):
        parts_i.append(torch.arange(t))
        parts_w.append(torch.full((t,), window))
    if streams in ("both", "output"):
        parts_i.append(out)
        parts_w.append(torch.full((out.numel(),), UNBOUNDED))
    return torch.cat(parts_i), torch.cat(parts_w), torch.tensor([0, t], dtype=torch.int32)


def unmasked_pairs(q_index, q_window, cu) -> int:
    start, end = key_ranges(q_index, q_window, cu)
    return int((end - start + 1).sum())


def flops(pairs: int, heads: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs: 2 matmuls forward, 5 backward (dq, dk, dv, recomputed s, dp)."""
    fwd = 4.0 * pairs * heads * d
    return fwd, 2.5 * fwd


# ---------------------------------------------------------------------------------------------
# implementations (device-agnostic; the CPU smoke runs the same code small)
# ---------------------------------------------------------------------------------------------


def orthros_fn(q, k, v, q_index, q_window, cu, deterministic=True, blocks=None):
    """The kernels as a model calls them: the tile plan prepared once, outside the timed call.
    ``blocks``: fixed tile sizes instead of the autotuner's (the interpreter's dry runs)."""
    n_band = int((q_window <= k.shape[0]).sum())  # once, on the host side of the benchmark
    prepared = ta.plan_forward(q_index, q_window, cu, k.shape[0], n_band=n_band)
    return lambda: ta.attention_triton(
        q, k, v, q_index, q_window, cu, deterministic=deterministic, decode=False, prepared=prepared, blocks=blocks
    )[0]


def sdpa_causal_fn(q, k, v, flash: bool):
    """Full causal SDPA over q [1, H, T, D] (k/v already expanded to H heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if flash else [SDPBackend.MATH]

    def run():
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def flex_mask(q_index, q_window, cu, n_k, device, block=128, compile_mask=False):
    from torch.nn.attention.flex_attention import create_block_mask

    qi = q_index.to(device).long()
    qw = q_window.to(device).long()
    doc = torch.repeat_interleave(
        torch.arange(cu.numel() - 1, device=device), (cu[1:] - cu[:-1]).long().to(device)
    )

    def mask_mod(b, h, q, kv):
        p = qi[q]
        return (kv <= p) & (p - kv < qw[q]) & (doc[kv] == doc[p])

    return create_block_mask(
        mask_mod, None, None, qi.numel(), n_k, device=device, BLOCK_SIZE=block, _compile=compile_mask
    )


def flex_fn(q, k, v, block_mask, compiled: bool):
    """FlexAttention on [1, H, Nq, D] x [1, Hkv, Nk, D] with the Orthros mask."""
    from torch.nn.attention.flex_attention import flex_attention

    fa = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return lambda: fa(q, k, v, block_mask=block_mask, enable_gqa=True)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def time_ms(fn, cuda: bool, reps: int = 3) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def fwd_bwd_ms(make_out, inputs, cuda: bool, reps: int = 3) -> tuple[float, float]:
    fwd = time_ms(lambda: make_out(), cuda, reps)
    out = make_out()
    dout = torch.randn_like(out)
    bwd = time_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), cuda, reps)
    return fwd, bwd


def kernel_ms(fn, reps: int = 20) -> float | None:
    """Milliseconds the GPU spends in kernels per call of ``fn``: the CUDA kernel durations the
    profiler (CUPTI) records over ``reps`` calls, so the host's launch gaps, which ``do_bench``
    counts, are left out (they dominate a call of a few small kernels). None when it saw none."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    total_us = sum(e.device_time_total for e in prof.events() if e.device_type == cuda)
    return total_us / reps / 1e3 if total_us > 0 else None


def fwd_bwd_kernel_ms(make_out, inputs, reps: int = 20) -> tuple[float | None, float | None]:
    """``fwd_bwd_ms`` by kernel time (``kernel_ms``): forward, then backward alone."""
    out = make_out()
    dout = torch.randn_like(out)
    return kernel_ms(make_out, reps), kernel_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True),
                                                reps)


# ---------------------------------------------------------------------------------------------
# GPU benchmark
# ---------------------------------------------------------------------------------------------


def gpu_bench(args) -> dict:
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    h, hkv, d, w = args.heads, args.kv_heads, args.head_dim, args.window
    rows = []

    def record(layout, t, impl, pairs, fwd_ms, bwd_ms, **extra):
        f_fl, b_fl = flops(pairs, h, d)
        row = {
            "layout": layout, "T": t, "impl": impl, "pairs": pairs,
            "fwd_ms": fwd_ms, "fwd_tflops": f_fl / fwd_ms / 1e9 if fwd_ms else None,
            "bwd_ms": bwd_ms, "bwd_tflops": b_fl / bwd_ms / 1e9 if bwd_ms else None, **extra,
        }
        rows.append(row)
        if not args.json:
            print(_fmt_row(row), flush=True)

    if not args.json:
        print(_fmt_header())
    for t in args.seqlens:
        g = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        # SDPA flash, full causal over the same T tokens (k/v expanded to H heads outside timing)
        qs = torch.randn(1, h, t, d, device=dev, dtype=dtype, generator=g).requires_grad_()
        ks = k.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
        vs = v.detach().transpose(0, 1).repeat_interleave(h // hkv, 0)[None].requires_grad_()
        causal_pairs = t * (t + 1) // 2
        sd_f, sd_b = fwd_bwd_ms(sdpa_causal_fn(qs, ks, vs, flash=True), (qs, ks, vs), True)
        record("causal", t, "sdpa_flash", causal_pairs, sd_f, sd_b)
        del qs, ks, vs
        for layout in args.layouts:
            parts = ["both"] + (["output", "base"] if layout == "pretrain" else [])
            for streams in parts:
                qi, qw, cu = make_queries(layout, t, w, streams)
                pairs = unmasked_pairs(qi, qw, cu)
                qi, qw, cu = qi.to(dev), qw.to(dev), cu.to(dev)
                q = torch.randn(qi.numel(), h, d, device=dev, dtype=dtype, generator=g).requires_grad_()
                name = "orthros" if streams == "both" else f"orthros[{streams}]"
                o_f, o_b = fwd_bwd_ms(orthros_fn(q, k, v, qi, qw, cu), (q, k, v), True)
                record(layout, t, name, pairs, o_f, o_b, sdpa_speedup_fwd=sd_f / o_f, sdpa_speedup_bwd=sd_b / o_b)
                if streams == "both" and not args.no_flex:
                    _bench_flex(record, layout, t, pairs, q, k, v, (qi, qw, cu), dev)
                del q
        torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(),
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "config": {"heads": h, "kv_heads": hkv, "head_dim": d, "window": w, "dtype": args.dtype},
        "rows": rows,
        "targets": targets(rows),
    }


def _bench_flex(record, layout: str, t: int, pairs: int, q, k, v, queries, dev) -> None:
    """FlexAttention (compiled) on the same mask as a row of ``gpu_bench``; a failure is recorded
    as the row's error and the benchmark goes on."""
    qi, qw, cu = queries
    try:
        bm = flex_mask(qi, qw, cu, t, dev, compile_mask=True)
        qf = q.detach().transpose(0, 1)[None].requires_grad_()
        kf = k.detach().transpose(0, 1)[None].requires_grad_()
        vf = v.detach().transpose(0, 1)[None].requires_grad_()
        f_f, f_b = fwd_bwd_ms(flex_fn(qf, kf, vf, bm, compiled=True), (qf, kf, vf), True)
        record(layout, t, "flex", pairs, f_f, f_b)
        del qf, kf, vf, bm
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        record(layout, t, "flex", pairs, None, None, error=f"{type(exc).__name__}: {exc}"[:200])


def targets(rows: list[dict]) -> list[dict]:
    """The three kernel targets, per T where the rows exist."""
    out = []
    by = {(r["layout"], r["T"], r["impl"]): r for r in rows}
    for t in sorted({r["T"] for r in rows}):
        sd = by.get(("causal", t, "sdpa_flash"))
        o = by.get(("pretrain", t, "orthros[output]"))
        b = by.get(("pretrain", t, "orthros[base]"))
        p = by.get(("prefill", t, "orthros"))
        if sd and o:
            for ph in ("fwd", "bwd"):
                ratio = o[f"{ph}_tflops"] / sd[f"{ph}_tflops"]
                out.append({"T": t, "target": f"output stream {ph} TFLOP/s vs SDPA flash", "value": ratio,
                            "goal": ">= 0.80", "met": ratio >= 0.80})
        if o and b:
            for ph in ("fwd", "bwd"):
                ideal_ms = flops(b["pairs"], 1, 1)[ph == "bwd"] / flops(o["pairs"], 1, 1)[ph == "bwd"] * o[f"{ph}_ms"]
                ratio = b[f"{ph}_ms"] / ideal_ms
                out.append({"T": t, "target": f"base stream {ph} time / unmasked FLOPs at output throughput",
                            "value": ratio, "goal": "<= 1.3", "met": ratio <= 1.3})
        if sd and p and t >= 131072:
            ratio = sd["fwd_ms"] / p["fwd_ms"]
            out.append({"T": t, "target": "prefill fwd speed-up vs full causal SDPA", "value": ratio,
                        "goal": ">= 10", "met": ratio >= 10})
    return out


def _fmt_header() -> str:
    return f"{'layout':9} {'T':>7} {'impl':17} {'fwd ms':>9} {'TFLOP/s':>8} {'bwd ms':>9} {'TFLOP/s':>8}"


def _fmt_row(r: dict) -> str:
    def f(x, spec):
        return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))

    return (f"{r['layout']:9} {r['T']:>7} {r['impl']:17} {f(r['fwd_ms'], '9.3f')} {f(r['fwd_tflops'], '8.1f')} "
            f"{f(r['bwd_ms'], '9.3f')} {f(r['bwd_tflops'], '8.1f')}" + (f"  {r['error']}" if "error" in r else ""))


# ---------------------------------------------------------------------------------------------
# CPU smoke
# ---------------------------------------------------------------------------------------------


def cpu_smoke(args) -> dict:
    h, hkv, d, w = 4, 2, 32, 16
    blocks = (32, 32)  # small tiles: the interpreter runs them quickly
    checks, rows = [], []
    for layout in LAYOUTS:
        t = 192
        qi, qw, cu = make_queries(layout, t, w)
        cu = torch.tensor([0, 70, t], dtype=torch.int32)  # two packed documents
        g = torch.Generator().manual_seed(0)
        q = torch.randn(qi.numel(), h, d, generator=g).requires_grad_()
        k = torch.randn(t, hkv, d, generator=g).requires_grad_()
        v = torch.randn(t, hkv, d, generator=g).requires_grad_()
        pairs = unmasked_pairs(qi, qw, cu)
        o_f, o_b = fwd_bwd_ms(orthros_fn(q, k, v, qi, qw, cu, blocks=blocks), (q, k, v), False, reps=1)
        ref = functools.partial(attention_reference, q, k, v, qi, qw, cu)
        r_f, r_b = fwd_bwd_ms(lambda ref=ref: ref()[0], (q, k, v), False, reps=1)
        rows.append({"layout": layout, "T": t, "impl": "orthros (interpreter)", "pairs": pairs,
                     "fwd_ms": o_f, "bwd_ms": o_b})
        rows.append({"layout": layout, "T": t, "impl": "reference (torch)", "pairs": pairs,
                     "fwd_ms": r_f, "bwd_ms": r_b})
        # correctness: kernel vs reference (out, lse, grads), and the benchmark's Flex mask
        dout = torch.randn(q.shape, generator=g)
        out, lse = ta.attention_triton(q, k, v, qi, qw, cu, decode=False, blocks=blocks)
        got = [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]
        out2, lse2 = attention_reference(q, k, v, qi, qw, cu)
        want = [out2, lse2, *torch.autograd.grad(out2, (q, k, v), dout)]
        err = max(float((a - b).abs().max()) for a, b in zip(got, want))
        checks.append({"check": f"{layout}: triton vs reference (out, lse, dq, dk, dv)", "max_abs_err": err,
                       "ok": err < 1e-5})
        bm = flex_mask(qi, qw, cu, t, "cpu", block=32)
        flex_out = flex_fn(q.detach().transpose(0, 1)[None], k.detach().transpose(0, 1)[None],
                           v.detach().transpose(0, 1)[None], bm, compiled=False)()
        err = float((flex_out[0].transpose(0, 1) - out2.detach()).abs().max())
        checks.append({"check": f"{layout}: FlexAttention mask vs reference (fwd)", "max_abs_err": err,
                       "ok": err < 1e-5})
    checks.append(_smoke_decode_check(h, hkv, d, w))
    return {
        "device": f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "smoke": {"config": {"heads": h, "kv_heads": hkv, "head_dim": d, "window": w}, "rows": rows,
                  "checks": checks},
        "tile_work": {"blocks": args.blocks, "window": args.window, "rows": tile_work(args)},
    }


def _smoke_decode_check(h: int, hkv: int, d: int, w: int) -> dict:
    """The decode kernel against the reference on ragged cache lengths, base + output query per row."""
    lens = [300, 17, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    last = (cu[1:] - 1).long()
    qi = last.repeat_interleave(2)
    qw = torch.tensor([w, UNBOUNDED]).repeat(len(lens))
    g = torch.Generator().manual_seed(1)
    n_k = int(cu[-1])
    q, k, v = (torch.randn(n, hh, d, generator=g) for n, hh in ((qi.numel(), h), (n_k, hkv), (n_k, hkv)))
    t0 = time.perf_counter()
    out, lse = decode_attention(q, k, v, qi, qw, cu, split=64)
    dec_ms = (time.perf_counter() - t0) * 1e3
    out2, lse2 = attention_reference(q, k, v, qi, qw, cu)
    err = max(float((out - out2).abs().max()), float((lse - lse2).abs().max()))
    return {"check": f"decode (ragged {lens}, split 64): vs reference", "max_abs_err": err, "ok": err < 1e-5,
            "ms": dec_ms}


def tile_work(args) -> list[dict]:
    """Work proportional to the mask at the real sizes (host mirror of the kernel's tile bounds)."""
    work = []
    for t in args.seqlens:
        for layout in LAYOUTS:
            for streams in ("base", "output"):
                qi, qw, cu = make_queries(layout, t, args.window, streams)
                wk = ta.forward_tile_work(qi, qw, cu, t, blocks=args.blocks,
                                          heads_per_program=ta.head_pack(args.heads // args.kv_heads))
                work.append({"layout": layout, "T": t, "stream": streams, "unmasked_pairs": wk["unmasked"],
                             "visited_pairs": wk["visited"], "visited_over_unmasked": wk["visited"] / wk["unmasked"],
                             "visited_over_causal": wk["visited"] / (t * (t + 1) / 2)})
    return work


def print_cpu(res: dict) -> None:
    print(f"# Orthros attention: CPU smoke ({res['device']}, torch {res['torch']}, triton {res['triton']})")
    print("# GPU figures need CUDA; this is correctness + work accounting only.\n")
    print(f"{'layout':9} {'T':>5} {'impl':22} {'fwd ms':>9} {'bwd ms':>9}")
    for r in res["smoke"]["rows"]:
        print(f"{r['layout']:9} {r['T']:>5} {r['impl']:22} {r['fwd_ms']:9.1f} {r['bwd_ms']:9.1f}")
    print()
    for c in res["smoke"]["checks"]:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}: max abs err {c['max_abs_err']:.2e}")
    tw = res["tile_work"]
    blocks = ", ".join(f"{c} {m}x{n}" for c, (m, n) in tw["blocks"].items())
    print(f"\n# forward key tiles visited (BLOCK_MxBLOCK_N: {blocks}; W={tw['window']})")
    print(f"{'layout':9} {'T':>7} {'stream':7} {'unmasked':>14} {'visited':>14} {'vis/unm':>8} {'vis/causal':>10}")
    for r in tw["rows"]:
        print(f"{r['layout']:9} {r['T']:>7} {r['stream']:7} {r['unmasked_pairs']:>14} {r['visited_pairs']:>14} "
              f"{r['visited_over_unmasked']:8.3f} {r['visited_over_causal']:10.5f}")


# ---------------------------------------------------------------------------------------------
# AOT compile for sm_90 (no GPU needed)
# ---------------------------------------------------------------------------------------------


PTXAS_STATS = re.compile(r"(\d+) bytes spill stores")
PTXAS_REGS = re.compile(r"Used (\d+) registers")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _ptxas_stats(ptx: str) -> dict:
    """Registers and spill bytes of one kernel: ptxas -v on the PTX triton produced.

    Triton runs the same ptxas while compiling but keeps its log only on failure, so the PTX is
    assembled once more here with the same flags triton passes for sm_90.
    """
    import subprocess
    import tempfile

    import triton.backends.nvidia.compiler as nv

    ptxas = nv.get_ptxas(90).path
    arch = re.search(r"\.target\s+(\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True, check=True,
        ).stderr
    return {"regs": int(PTXAS_REGS.search(log).group(1)), "spill_bytes": int(PTXAS_STATS.search(log).group(1))}


# ---- work replication of the dots, read from the compiled layouts (TTGIR) -------------------
# A dot's result layout says how its M x N tile is spread over the warps: ``warpsPerCTA`` warps
# per dimension, each covering ``instrShape`` (MMA: 16 rows x instrN columns per warp; an MMA v3
# warp group is 4 warps along M, 64 rows) or ``sizePerThread * threadsPerWarp`` (blocked, FMA
# dots). Warps whose slot lies past the tile's extent in a dimension repeat the warps before
# them: they issue the same product. Replication = warps / warps that own distinct elements.
# Spill counts do not show it; the layouts do (the PTX then holds the same wgmma in each group).
TTGIR_LAYOUT = re.compile(r"^(#[\w.]+) = (#(?:ttg|triton_gpu)\.\w+<\{[^}]*\}>)\s*$", re.M)
TTGIR_DOT = re.compile(r"^\s*%([\w.]+?)(?:_\d+)?(?::\d+)? = (tt\.dot|ttng\.warp_group_dot) (.*)$", re.M)
TTGIR_RESULT = re.compile(r"-> tensor<((?:\d+x)+)[a-z]\w*, (#[\w.]+(?:<\{[^}]*\}>)?)>")
TTGIR_LHS = re.compile(r": (?:tensor|![\w.]*memdesc)<((?:\d+x)+)[a-z]\w*")


def _layout_fields(text: str) -> dict:
    """``#ttg.nvidia_mma<{versionMajor = 3, warpsPerCTA = [8, 1], ...}>`` -> kind + int fields."""
    kind = re.match(r"#(?:ttg|triton_gpu)\.(\w+)<", text).group(1)
    fields: dict = {"kind": kind}
    for key, val in re.findall(r"(\w+) = (\[[\d, ]*\]|\d+)", text):
        fields[key] = [int(x) for x in val.strip("[]").split(",") if x.strip()] if val.startswith("[") else int(val)
    return fields


def layout_replication(layout: dict, shape: list[int]) -> int:
    """How many warps compute each element of a ``shape`` tensor laid out as ``layout``.

    Raises ``ValueError`` for a layout kind this reader does not know (a new triton may add one:
    extend the reader rather than guess).
    """
    warps = layout["warpsPerCTA"]
    if len(warps) != len(shape):
        raise ValueError(f"layout rank {len(warps)} != tensor rank {len(shape)}: {layout}")
    if layout["kind"] == "nvidia_mma":
        per_warp = layout["instrShape"][: len(shape)]  # [M per warp (16), N per instruction, (K)]
    elif layout["kind"] == "blocked":
        per_warp = [a * b for a, b in zip(layout["sizePerThread"], layout["threadsPerWarp"])]
    else:
        raise ValueError(f"unknown dot result layout {layout['kind']!r}: teach layout_replication about it")
    distinct = 1
    for n, w, tile in zip(shape, warps, per_warp):
        distinct *= min(w, max(1, -(-n // tile)))
    return math.prod(warps) // distinct


def dot_replication(ttgir: str) -> list[dict]:
    """Every dot of a compiled kernel (TTGIR text) with its M x N x K, layout and replication."""
    aliases = {name: text for name, text in TTGIR_LAYOUT.findall(ttgir)}
    dots, seen = [], set()
    for name, op, rest in TTGIR_DOT.findall(ttgir):
        res, lhs = TTGIR_RESULT.search(rest), TTGIR_LHS.search(rest)
        if res is None or lhs is None:
            raise ValueError(f"cannot read the types of dot %{name}: {rest[:200]}")
        shape = [int(x) for x in res.group(1).rstrip("x").split("x")]
        k = int(lhs.group(1).rstrip("x").split("x")[-1])
        enc = res.group(2)
        layout = _layout_fields(aliases.get(enc, enc))
        key = (name, tuple(shape), k, enc)
        if key in seen:  # the pipeliner peels copies of a loop's dot: one entry each
            continue
        seen.add(key)
        dots.append({"dot": name, "op": op, "M": shape[0], "N": shape[1], "K": k, "layout": layout["kind"],
                     "version": layout.get("versionMajor"), "warpsPerCTA": layout["warpsPerCTA"],
                     "instrShape": layout.get("instrShape"), "replication": layout_replication(layout, shape)})
    return dots


def _signature(fn, consts: dict, dtype: str) -> tuple[dict, dict]:
    """Argument types and the JIT's alignment attributes for real (aligned) tensors.

    The JIT marks every pointer whose address is a multiple of 16 and every int argument
    divisible by 16 with ``tt.divisibility=16`` (``BaseBackend.get_*_specialization``); torch
    allocations are 16-byte aligned and the strides of [tokens, heads, 64|128] tensors are
    multiples of 16, so those are the kernels a training run builds. Counts (n_q, n_k, ...) are
    left unspecialised (the general case the JIT also compiles).
    """
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name in ta.KERNEL_ARG_TYPES:
            sig[name] = ta.KERNEL_ARG_TYPES[name]
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        elif name.startswith("stride") or name in ("n_q", "n_k", "split", "n_splits"):
            sig[name] = "i32"
        else:
            sig[name] = "*" + dtype
        if sig[name].startswith("*") or name.startswith("stride") or name == "split":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    """``"64x64w4s3,128x64w8s2"`` -> [(BLOCK_M, BLOCK_N, num_warps, num_stages), ...]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", item)
        if m is None:
            raise ValueError(f"config {item!r}: write BLOCK_MxBLOCK_NwWARPSsSTAGES, e.g. 64x64w4s3")
        out.append(tuple(int(g) for g in m.groups()))
    return out


def _with_config(spec: dict, bm: int, bn: int, warps: int, stages: int) -> dict:
    consts = dict(spec["consts"])
    if "BLOCK_M" in consts:  # fwd/dq/dkdv; the decode kernels keep their own tile constants
        consts.update(BLOCK_M=bm, BLOCK_N=bn)
    return {**spec, "consts": consts, "autotune": False, "fixed": False,
            "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}}


def compile_report(head_dims=(64, 128), dtypes=("bfloat16", "float16"), group: int = 4, log=None,
                   kernels: list[str] | None = None, configs: list[tuple[int, int, int, int]] | None = None
                   ) -> list[dict]:
    """AOT-compile every kernel config for sm_90 as the JIT would specialise it; one dict each.

    ``autotune`` is true for the configs the autotuner may pick for that dtype (after its prune);
    the decode kernels have one fixed launch config (``autotune`` false, ``fixed`` true).
    ``kernels`` keeps the kernels whose name starts with one of its entries (``"fwd[band]"``,
    ``"dkdv"``); ``configs`` compiles those instead of the autotune lists (``autotune`` false),
    to try candidates. Each row has ``dot_replication`` (the largest factor of its dots, 1 when
    no warp repeats another's product) and ``dots`` (per dot, read from the TTGIR).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        torch_dtype = getattr(torch, dtype_name)
        for d in head_dims:
            specs = ta.kernel_specs(d, group, torch_dtype) + _decode_specs(d, group, torch_dtype)
            if kernels:
                specs = [s for s in specs if any(s["kernel"].startswith(k) for k in kernels)]
            if configs:
                unique = {s["kernel"]: s for s in specs}.values()  # one spec per kernel, each config once
                specs = [_with_config(s, *c) for s in unique for c in configs]
            for spec in specs:
                fn, consts, cfg = spec["fn"], spec["consts"], spec["config"]
                sig, attrs = _signature(fn, consts, dtype)
                src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
                t0 = time.perf_counter()
                row = {"kernel": spec["kernel"], "config": cfg, "head_dim": d, "dtype": dtype,
                       "autotune": spec["autotune"], "triton": triton.__version__}
                if spec.get("fixed"):
                    row["fixed"] = True
                try:
                    kern = triton.compile(src, target=target,
                                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
                    row.update(_ptxas_stats(kern.asm["ptx"]), shared_bytes=int(kern.metadata.shared))
                    dots = dot_replication(kern.asm["ttgir"])
                    row.update(dot_replication=max((x["replication"] for x in dots), default=1), dots=dots)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                    row.update(regs=None, spill_bytes=None, shared_bytes=None, dot_replication=None,
                               error=f"{type(exc).__name__}: {exc}"[-400:])
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                if log is not None:
                    log(row)
    return rows


def _decode_specs(d: int, group: int, dtype: torch.dtype) -> list[dict]:
    from orthros_train.ops import triton_decode as td

    return td.kernel_specs(d, group, dtype)


def _fmt_compile(r: dict) -> str:
    c = r["config"]
    cfg = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
    tag = "autotune" if r["autotune"] else ("fixed" if r.get("fixed") else "-")
    if r.get("error"):
        return f"| {r['kernel']} | {cfg} | {r['head_dim']} | {r['dtype']} | FAIL | | | | {tag} |"
    rep = ", ".join(f"{x['dot']} x{x['replication']}" for x in r["dots"] if x["replication"] > 1)
    return (f"| {r['kernel']} | {cfg} | {r['head_dim']} | {r['dtype']} | {r['regs']} | {r['spill_bytes']} | "
            f"{r['shared_bytes'] / 1024:.0f} | {r['dot_replication']}{f' ({rep})' if rep else ''} | {tag} |")


def hopper_probe(head_dim: int = 128) -> list[dict]:
    """What triton 3.9 does with Hopper features for the base stream's loop (sm_90, bf16).

    A cut-down band forward (one masked loop, as in ``_attn_fwd_kernel``) whose K/V tiles come
    through TMA tensor descriptors, compiled with and without ``warp_specialize`` on the loop.
    Reports registers/spills/shared and whether the PTX holds TMA copies (``cp.async.bulk.tensor``),
    wgmma and ``setmaxnreg`` (the register split warp specialization relies on).
    """
    band_fwd_tma = _band_fwd_tma_kernel()
    rows = []
    for bm, bn, warps, stages in ((64, 64, 4, 3), (128, 64, 8, 3)):
        for ws in (False, True):
            rows.append(_compile_tma_probe(band_fwd_tma, head_dim, bm, bn, warps, stages, ws))
    return rows


def _band_fwd_tma_kernel():
    """The probe's kernel (defined here: triton is imported only when the probe runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def band_fwd_tma(Q, K_desc, V_desc, Out, PERM, QSTART, QEND, stride_qm, stride_qh, stride_om, stride_oh,
                     n_rows, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        hk = tl.program_id(1)
        row_ok = rows < n_rows
        qi = tl.load(PERM + rows, mask=row_ok, other=0).to(tl.int64)
        qs = tl.load(QSTART + rows, mask=row_ok, other=0)
        qe = tl.load(QEND + rows, mask=row_ok, other=-1)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + qi[:, None] * stride_qm + hk * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lo = (tl.min(tl.where(row_ok, qs, 1 << 30)) // BLOCK_N) * BLOCK_N
        hi = tl.max(tl.where(row_ok, qe, -1)) + 1
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            k = K_desc.load([n0, hk * D])
            v = V_desc.load([n0, hk * D])
            sc = tl.dot(q, tl.trans(k)) * qk_scale
            cols = n0 + offs_n
            sc = tl.where((cols[None, :] >= qs[:, None]) & (cols[None, :] <= qe[:, None]), sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.math.exp2(sc - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + qi[:, None] * stride_om + hk * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])

    return band_fwd_tma


def _compile_tma_probe(band_fwd_tma, head_dim: int, bm: int, bn: int, warps: int, stages: int, ws: bool) -> dict:
    """One config of the probe compiled for sm_90: its ptxas stats and which Hopper features the PTX
    uses, or the compiler's error (a refusal is a finding, not a failure)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {"D": head_dim, "BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": ws}
    desc = f"tensordesc<bf16[{bn}, {head_dim}]>"
    sig = {"Q": "*bf16", "K_desc": desc, "V_desc": desc, "Out": "*bf16", "PERM": "*i32", "QSTART": "*i32",
           "QEND": "*i32", "n_rows": "i32", "qk_scale": "fp32", **dict.fromkeys(consts, "constexpr")}
    sig.update({n: "i32" for n in band_fwd_tma.arg_names if n.startswith("stride")})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(band_fwd_tma.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    row = {"kernel": "band fwd, TMA K/V", "warp_specialize": ws, "head_dim": head_dim, "dtype": "bf16",
           "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}}
    try:
        kern = triton.compile(ASTSource(band_fwd_tma, {n: sig[n] for n in band_fwd_tma.arg_names},
                                        constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
        ptx = kern.asm["ptx"]
        row.update(_ptxas_stats(ptx), shared_bytes=int(kern.metadata.shared),
                   tma="cp.async.bulk.tensor" in ptx, wgmma="wgmma" in ptx, setmaxnreg="setmaxnreg" in ptx)
    except Exception as exc:  # noqa: BLE001 - the compiler refusing is the finding
        row["error"] = f"{type(exc).__name__}: {exc}"[-300:]
    return row


def compile_sm90(args) -> list[dict]:
    head_dims = [args.head_dim] if args.head_dim_given else [64, 128]
    dtypes = [args.dtype] if args.dtype_given else ["bfloat16", "float16", "float32"]
    kernels = [k for k in args.kernels.split(",") if k] if args.kernels else None
    configs = parse_configs(args.configs) if args.configs else None
    if not args.json:
        print("| kernel | config | head_dim | dtype | regs | spill bytes | shared KB | dot replication | |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    log = None if args.json else (lambda r: print(_fmt_compile(r), flush=True))
    return compile_report(head_dims, dtypes, args.heads // args.kv_heads, log=log, kernels=kernels, configs=configs)


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--seqlens", default="4096,16384,65536,131072")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (--compile-sm90: 64 and 128)")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bfloat16 (--compile-sm90: all)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    p.add_argument("--band-blocks", default="64x64", help="BLOCK_MxBLOCK_N of the windowed queries (CPU work count)")
    p.add_argument("--full-blocks", default="128x64", help="BLOCK_MxBLOCK_N of the whole-document queries")
    p.add_argument("--compile-sm90", action="store_true", help="compile the kernels for sm_90 (no GPU needed)")
    p.add_argument("--kernels", default=None,
                   help="--compile-sm90: only kernels whose name starts with one of these (e.g. dkdv,fwd[band])")
    p.add_argument("--configs", default=None,
                   help="--compile-sm90: these configs instead of the autotune lists (e.g. 64x64w4s3,128x64w8s2)")
    p.add_argument("--probe-hopper", action="store_true",
                   help="sm_90 compile of a TMA + warp_specialize variant of the base-stream loop")
    args = p.parse_args(argv)
    args.head_dim_given, args.dtype_given = args.head_dim is not None, args.dtype is not None
    args.head_dim = args.head_dim or 128
    args.dtype = args.dtype or "bfloat16"
    args.seqlens = [int(x) for x in args.seqlens.split(",") if x]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.blocks = {
        cls: tuple(int(x) for x in spec.lower().split("x"))
        for cls, spec in (("band", args.band_blocks), ("full", args.full_blocks))
    }

    if args.probe_hopper:
        print(json.dumps(hopper_probe(args.head_dim), indent=1))
        return 0
    if args.compile_sm90:
        try:
            rows = compile_sm90(args)
        except ValueError as exc:  # a malformed --configs entry
            p.error(str(exc))
        if args.json:
            print(json.dumps(rows, indent=1))
        return 0 if all(not r.get("error") for r in rows) else 1
    if torch.cuda.is_available():
        res = gpu_bench(args)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"\n# {res['device']}, {res['date']}, torch {res['torch']}, triton {res['triton']}, {res['config']}")
            for tgt in res["targets"]:
                print(f"{'MET ' if tgt['met'] else 'MISS'} T={tgt['T']}: {tgt['target']} = {tgt['value']:.2f} "
                      f"(goal {tgt['goal']})")
        return 0
    res = cpu_smoke(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_cpu(res)
    return 0 if all(c["ok"] for c in res["smoke"]["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
