"""The output stream's attention over vLLM's GPU paged KV cache, as a Triton kernel.

In vLLM every Orthros layer runs two attention calls on one paged cache: the base stream through
vLLM's own sliding-window ``Attention`` (which writes the K/V), then the output stream, one query
per request against every cached key of that request. This module is the second call for GPU
backends whose cache is laid out as FlashAttention's:

    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    block_table             [num_reqs, max_blocks_per_req] int32 (physical block of each logical one)
    seq_lens                [num_reqs] int32, keys of each request including this step's tokens
    query_start_loc         [num_reqs + 1] int32, this step's tokens per request (row offsets)

With ``row_request`` the rows are output tokens rather than requests (several per request under
speculative decoding, prompt logprobs or a captured graph): each row names its request and its own
key count (causal from the request's end), and padding rows have none.

It is the paged variant of ``ops/triton_decode.py``: one program per (request, kv head, split)
computes a partial softmax for all query heads of its GQA group, walking logical key positions
and reading each key through the block table; the same combine kernel merges the partials.

Graph-safe by construction: the grid depends only on ``num_reqs`` and the fixed ``num_splits``
(never on a sequence length read from the device), each program reads its request's length on
the device, and a request with no tokens this step (Model Runner V2 pads ``query_start_loc`` by
repeating its last entry) is masked: its output row is zero and no key is read. So the wrapper
does no host sync and CUDA graphs can be captured around it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from orthros_train.ops.triton_decode import (
    COMBINE_BLOCK_S,
    COMBINE_WARPS,
    INTERPRET,
    LOG2E,
    _decode_combine_kernel,
    online_softmax_step,
    store_split_partial,
)

DEFAULT_SPLITS = 16  # programs per (request, kv head): fills an H100/H200 at batch >= 1 on long prompts


# Integer arguments whose value changes with the deployment (cache block size, block-table width,
# split count, window, sinks) are not specialised on: one compiled kernel per model serves every
# value, so the kernels compiled at model load (``compile_paged_kernels``) are the ones every later
# launch uses, and none is ever compiled inside a CUDA-graph capture.
@triton.jit(do_not_specialize=["stride_btr", "n_splits", "block_size", "window", "sinks"])
def _paged_split_kernel(
    Q, KC, VC, BT, SEQ, QSL, RR, OP, LP,
    stride_qm, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_btr, stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph,
    n_splits, block_size, window, sinks, qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    if ROWS:
        # One program per query row: the request whose blocks it reads, and its own key count
        # (several rows of one request see causal prefixes; padding rows see 0 keys).
        req = tl.load(RR + r).to(tl.int64)
        seq_len = tl.load(SEQ + r)
    else:
        req = r
        # A padded request (no tokens this step) reads nothing: its key range is empty.
        n_new = tl.load(QSL + r + 1) - tl.load(QSL + r)
        seq_len = tl.where(n_new > 0, tl.load(SEQ + r), 0)
    # The row's keys: its window [win_lo, seq_len) and the request's first sink keys that the window
    # does not reach, [0, n_sink). They are walked as one virtual range [0, n_virt) (sinks first),
    # mapped to key positions per column, so a single softmax covers both (no partials to merge).
    # Without a window (window >= seq_len) win_lo = 0, n_sink = 0: the identity.
    win_lo = tl.maximum(seq_len - window, 0)
    n_sink = tl.minimum(win_lo, sinks)
    n_virt = n_sink + seq_len - win_lo
    # Splits of whole key tiles, sized on the device from this row's key count.
    per_split = tl.cdiv(tl.cdiv(n_virt, BLOCK_N), n_splits) * BLOCK_N
    lo = s * per_split
    hi = tl.minimum(n_virt, lo + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    heads = hk * GROUP + offs_g
    q = tl.load(Q + r * stride_qm + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        virt = n0 + offs_n
        c_ok = virt < hi
        cols = tl.where(virt < n_sink, virt, virt + (win_lo - n_sink))
        block = tl.load(BT + req * stride_btr + cols // block_size, mask=c_ok, other=0).to(tl.int64)
        slot = (cols % block_size).to(tl.int64)
        k_rows = block * stride_kb + slot * stride_ks + hk * stride_kh
        v_rows = block * stride_vb + slot * stride_vs + hk * stride_vh
        kt = tl.load(KC + k_rows[None, :] + offs_d[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(VC + v_rows[:, None] + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = online_softmax_step(q, kt, v, c_ok, m_i, l_i, acc, qk_scale, PRECISION)

    # A row with no keys at all gets one finite zero partial, so the combine stays finite.
    empty_lse = tl.where((s == 0) & (seq_len == 0), 0.0, float("-inf"))
    store_split_partial(OP, LP, r, s, heads, g_ok, d_ok, offs_d, m_i, l_i, acc, empty_lse,
                        stride_opm, stride_oph, stride_ops, stride_lpm, stride_lph)


SPLIT_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
UNBOUNDED = 2**31 - 1  # "no window": every key of the row (int32-safe)
BASE_SPLITS = 2  # a base row sees at most W + S keys: two splits fill the grid without empty programs


def _check_paged_inputs(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, row_request, window,
                        sink_tokens) -> None:
    """The shape checks of ``paged_output_attention`` (values are not read: that would sync)."""
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the paged output-stream kernel needs CUDA tensors or TRITON_INTERPRET=1")
    if q.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"q must be [R, Hq, D] and key/value caches [blocks, block_size, Hkv, D] of one shape, got q "
            f"{tuple(q.shape)}, k {tuple(key_cache.shape)}, v {tuple(value_cache.shape)}"
        )
    n_req, h_q, d = q.shape
    _, _, h_kv, d_k = key_cache.shape
    if d_k != d or h_q % h_kv:
        raise ValueError(f"head_dim {d} vs cache {d_k}, query heads {h_q} vs kv heads {h_kv}: need equal head_dim "
                         "and query heads a multiple of kv heads")
    if window is not None and (window < 1 or sink_tokens < 0):
        raise ValueError(f"window must be >= 1 and sink_tokens >= 0, got {window}, {sink_tokens}")
    if row_request is not None:
        if block_table.dim() != 2 or row_request.shape != (n_req,) or seq_lens.shape[0] < n_req:
            raise ValueError(
                f"row_request [M] / seq_lens [M] must cover the M={n_req} query rows and block_table be "
                f"[R, blocks], got {tuple(row_request.shape)}, {tuple(seq_lens.shape)}, {tuple(block_table.shape)}"
            )
    elif block_table.dim() != 2 or block_table.shape[0] < n_req or seq_lens.shape[0] < n_req \
            or query_start_loc is None or query_start_loc.shape[0] < n_req + 1:
        raise ValueError(
            f"block_table [R, blocks] / seq_lens [R] / query_start_loc [R+1] must cover R={n_req} requests, got "
            f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}, "
            f"{None if query_start_loc is None else tuple(query_start_loc.shape)}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("the caches and the block table must be contiguous in their last dimension")


def paged_output_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float | None = None,
    num_splits: int = DEFAULT_SPLITS,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    row_request: torch.Tensor | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Attention of one query per request over all of its cached keys: ``out [R, Hq, D]``.

    ``q [R, Hq, D]`` holds request r's output-stream query (the token at position
    ``seq_lens[r] - 1``); ``query_start_loc`` only marks requests without tokens this step,
    whose rows come back zero. Shapes are checked; values are not (that would sync the host).

    With ``row_request [M]`` the rows are query tokens, several per request where a request
    has several (speculative verification, prompt logprobs, every row of a captured graph, the
    base stream): row ``i`` reads the blocks of request ``row_request[i]`` and its first
    ``seq_lens[i]`` keys (``OutputRows.row_requests`` gives both; 0 keys: a padding row, zero),
    and ``query_start_loc`` is not read.

    ``window``/``sink_tokens`` (the base stream): a row with ``n`` keys sees only its last
    ``window`` keys ``[n - window, n)`` plus the request's first ``sink_tokens`` keys that the window
    does not reach (``OrthrosConfig.sink_tokens``; each key once). ``None``: every key.
    """
    _check_paged_inputs(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, row_request, window,
                        sink_tokens)
    n_req, h_q, d = q.shape
    _, block_size, h_kv, _ = key_cache.shape
    rows = row_request is not None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    group = h_q // h_kv
    if out is None:
        out = torch.empty_like(q)
    if n_req == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_n = block_n or (16 if INTERPRET else SPLIT_LAUNCH["BLOCK_N"])
    block_d = max(16, triton.next_power_of_2(d))
    part_o = torch.empty((n_req, h_q, num_splits, d), dtype=torch.float32, device=q.device)
    part_l = torch.empty((n_req, h_q, num_splits), dtype=torch.float32, device=q.device)
    lse = torch.empty((h_q, n_req), dtype=torch.float32, device=q.device)
    _paged_split_kernel[(n_req, h_kv, num_splits)](
        q, key_cache, value_cache, block_table, seq_lens, row_request if rows else query_start_loc,
        row_request if rows else query_start_loc, part_o, part_l,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        num_splits, block_size, UNBOUNDED if window is None else int(window),
        0 if window is None else int(sink_tokens), scale * LOG2E,
        GROUP=group, D=d, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, UPCAST=INTERPRET or q.dtype == torch.float32, PRECISION="ieee",
        ROWS=rows, num_warps=SPLIT_LAUNCH["num_warps"], num_stages=1 if INTERPRET else SPLIT_LAUNCH["num_stages"],
    )
    _decode_combine_kernel[(n_req, h_q)](
        part_o, part_l, out, lse, n_req, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        out.stride(0), out.stride(1),
        D=d, BLOCK_S=min(COMBINE_BLOCK_S, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        num_warps=COMBINE_WARPS,
    )
    return out


def paged_window_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_request: torch.Tensor,
    row_keys: torch.Tensor,
    window: int,
    sink_tokens: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The base stream over the paged cache: row ``i`` (of request ``row_request[i]``, with
    ``row_keys[i]`` keys up to and including its own) attends its window and the request's sink
    tokens (``paged_output_attention`` with a window)."""
    return paged_output_attention(q, key_cache, value_cache, block_table, row_keys, None, scale=scale,
                                  num_splits=BASE_SPLITS, out=out, row_request=row_request, window=window,
                                  sink_tokens=sink_tokens)


def paged_global_rows(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    row_request: torch.Tensor,
    tail_keys: torch.Tensor,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The global tail over the paged cache: row ``i`` with ``tail_keys[i] > 0`` (a global base row,
    ``tail_rows.tail_row_keys``) attends all of its request's first ``tail_keys[i]`` keys, written
    over ``out [M, Hq, D]`` (the windowed result); rows with 0 keep ``out`` (the kernel reads no key
    for them). One launch over every row, no host sync: a captured graph replays it."""
    full = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    paged_output_attention(q, key_cache, value_cache, block_table, tail_keys, None, scale=scale, out=full,
                           row_request=row_request)
    out.copy_(torch.where((tail_keys > 0)[:, None, None], full, out))
    return out


# Kernels compiled by ``compile_paged_kernels``: (device, dtype, query heads, kv heads, head_dim).
_COMPILED: set[tuple] = set()


def kernel_key(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple:
    """What selects a compiled variant of the kernels besides sizes they are not specialised on
    (``cuda`` and ``cuda:<current>`` are one device)."""
    device = torch.device(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return (device.type, index, dtype, num_heads, num_kv_heads, head_dim)


def is_compiled(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_dim: int) -> bool:
    """Whether ``compile_paged_kernels`` ran for this device and shape."""
    return kernel_key(device, dtype, num_heads, num_kv_heads, head_dim) in _COMPILED


def compile_paged_kernels(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int = 16, base_stream: bool = False) -> None:
    """Compile (by launching them on a small dummy cache) every variant of the kernels a served
    model launches: per-request and per-row mode, and the combine kernel at the row counts Triton
    specialises on (1, a multiple of 16, any other). Called when the model is loaded, so no launch
    inside a CUDA-graph capture compiles (a capture cannot load a module; compiling there fails or
    stalls the capture). ``base_stream``: the base stream's windowed call too (sink tokens).

    The dummy cache has the layout the model reads (``kv_layout.split_paged_cache``: strides in
    multiples of ``2 * head_dim``, as every vLLM cache layout has them), so the stride
    specialisations match the real cache; block size, block-table width, windows and split counts
    are not specialised on.
    """
    blocks, width = 4, 4
    kv = torch.zeros(blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype, device=device)
    key_cache, value_cache = kv.transpose(1, 2).split(head_dim, dim=-1)
    table = torch.zeros(16, width, dtype=torch.int32, device=device)
    for m in (1, 16, 3):
        q = torch.zeros(m, num_heads, head_dim, dtype=dtype, device=device)
        seq = torch.ones(m, dtype=torch.int32, device=device)
        qsl = torch.arange(m + 1, dtype=torch.int32, device=device)
        request = torch.zeros(m, dtype=torch.int32, device=device)
        paged_output_attention(q, key_cache, value_cache, table, seq, qsl)
        paged_output_attention(q, key_cache, value_cache, table, seq, None, row_request=request)
        if base_stream:
            paged_window_attention(q, key_cache, value_cache, table, request, seq, window=2, sink_tokens=1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _COMPILED.add(kernel_key(device, dtype, num_heads, num_kv_heads, head_dim))


def paged_output_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float | None = None,
    row_request: torch.Tensor | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """The same contract in plain torch: gather each row's keys through its block table."""
    n_req, h_q, d = q.shape
    block_size, h_kv = key_cache.shape[1], key_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros_like(q)
    for r in range(n_req):
        n = int(seq_lens[r])
        if row_request is None and int(query_start_loc[r + 1]) == int(query_start_loc[r]) or n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        if window is not None:
            lo = max(n - window, 0)
            pos = torch.cat([pos[: min(lo, sink_tokens)], pos[lo:]])
        table = block_table[r if row_request is None else int(row_request[r])]
        blocks = table[pos // block_size].long()
        k = key_cache[blocks, pos % block_size].float()  # [n, Hkv, D]
        v = value_cache[blocks, pos % block_size].float()
        k = k.repeat_interleave(h_q // h_kv, dim=1)
        v = v.repeat_interleave(h_q // h_kv, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out
