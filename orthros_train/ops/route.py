"""Which kernel runs a GPU attention call: one table of conditions, first match wins.

``auto`` on CUDA used to send every layout that needs a mask to the Triton kernels, pretraining
included, because the base stream's window is a mask to SDPA. But in pretraining (and in the
dense and sliding baselines) every stream is a whole run of positions over the same keys: the
base stream is exactly a varlen FlashAttention call with ``window_size=(W - 1, 0)`` and the output
stream a causal one, on the same ``cu_seqlens``. Those two calls go to FlashAttention, which is
faster than our kernels on Hopper (FA3 / cuDNN / FA2 reach ~620 / ~540 / ~335 TFLOP/s forward,
our Triton kernel ~350-450), and the Triton kernels keep what only they serve: answer spans
(SFT/RL), prefill, decode, sink tokens, fp32.

``ROUTES`` is the table; ``choose_route`` reads it for one call's ``RouteFacts``. Every row is tested
on CPU (``tests/test_attention_route.py``): the row taken, and for the varlen rows the numerics of
``varlen_streams`` against the reference op with ``varlen_reference`` (the same contract in plain
torch) standing in for the GPU kernel.

Without a FlashAttention varlen that takes a window (the ``split`` row: torch releases whose
``varlen_attn`` lacks ``window_size``, no flash-attn), the causal stream still goes to SDPA's
flash/cuDNN kernels with ``is_causal`` per document and only the windowed stream to Triton.

The FlashAttention implementations, best first: flash-attn 3 (``flash_attn_interface``, Hopper),
flash-attn 2 (``flash_attn``, with ``window_size``), torch's own ``torch.nn.attention.varlen``
where its signature on the installed torch takes ``window_size``. flash-attn is an optional
extra (its wheels are far larger than torch's own route needs); nothing requires it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from orthros_train.ops.keys import UNBOUNDED
from orthros_train.ops.reference import attention_reference

log = logging.getLogger(__name__)

# The implementations whose backward can run without atomics when told (``deterministic=True``).
DETERMINISTIC_VARLEN = ("flash_attn_3", "flash_attn_2")
# Head dims and dtypes every FlashAttention implementation here serves.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256

VarlenFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class RouteFacts:
    """What decides one call's kernel. ``streams``: the queries are one or two whole streams over
    the keys (``stream_windows``, see ``whole_streams``), else ``None``."""

    device_type: str
    need_lse: bool = False
    sink_tokens: int = 0
    dtype: torch.dtype | None = None  # the queries' (None: unknown, no FlashAttention route)
    head_dim: int | None = None
    stream_windows: tuple[int, ...] | None = None
    needs_mask: bool = True  # some SDPA segment would need an explicit mask
    varlen: str | None = None  # the FlashAttention implementation installed (``installed_varlen``)
    triton: bool = True
    # the run asked for reproducible kernels (``trainer.deterministic``): torch's own FlashAttention
    # backward (its varlen and SDPA's) keeps its atomics under use_deterministic_algorithms'
    # warn_only, so only flash-attn (told ``deterministic=True``) and our kernels serve it
    deterministic: bool = False


@dataclass(frozen=True)
class Route:
    name: str  # "varlen" | "sdpa" | "triton" | "reference"
    why: str
    applies: Callable[[RouteFacts], bool]


def _flash_shape(f: RouteFacts) -> bool:
    return f.dtype in FLASH_DTYPES and f.head_dim is not None and f.head_dim <= FLASH_MAX_HEAD_DIM \
        and f.head_dim % 8 == 0


def _causal_and_windowed(f: RouteFacts) -> bool:
    """Whole streams of which some are causal (SDPA serves them) and some windowed."""
    windows = f.stream_windows or ()
    return UNBOUNDED in windows and any(w != UNBOUNDED for w in windows)


ROUTES: tuple[Route, ...] = (
    Route("reference", "the caller merges partial attentions and needs a differentiable LSE off the GPU",
          lambda f: f.device_type != "cuda" and f.need_lse),
    Route("sdpa", "off the GPU torch's SDPA is the fused attention (flash on CPU, masked where windowed)",
          lambda f: f.device_type != "cuda"),
    Route("triton", "a differentiable log-sum-exp for merging partials: our kernels return it",
          lambda f: f.need_lse and f.triton),
    Route("varlen", "whole streams over the same keys (pretraining, the baselines): FlashAttention varlen, "
                    "window_size=(W-1, 0) for the base stream, causal for the output stream",
          lambda f: f.stream_windows is not None and not f.sink_tokens and f.varlen is not None and _flash_shape(f)
          and (not f.deterministic or f.varlen in DETERMINISTIC_VARLEN)),
    Route("triton", "reproducible kernels (trainer.deterministic): our backward adds in a fixed order, torch's "
                    "FlashAttention backward does not",
          lambda f: f.deterministic and f.triton),
    Route("split", "whole streams without a FlashAttention varlen: the causal stream through SDPA's flash/cuDNN "
                   "is_causal per document, the windowed stream through our kernels",
          lambda f: _causal_and_windowed(f) and not f.sink_tokens and f.triton and _flash_shape(f)),
    Route("sdpa", "causal from each document's start or single queries: flash attention through SDPA, no mask",
          lambda f: not f.needs_mask),
    Route("triton", "answer spans, prefill, sink tokens, fp32 or no FlashAttention installed: our kernels",
          lambda f: f.triton),
    Route("sdpa", "triton is not installed: SDPA with masks", lambda f: True),
)


def choose_route(facts: RouteFacts) -> Route:
    """The first row of ``ROUTES`` whose condition holds."""
    return next(route for route in ROUTES if route.applies(facts))


def whole_streams(segments: Sequence, n_k: int, n_q: int) -> tuple[int, ...] | None:
    """The window of each stream when the queries are ``n_q / n_k`` whole streams over the keys in
    order (stream ``s`` is query rows ``[s n_k, (s + 1) n_k)`` with key index ``row - s n_k``, one
    window per stream, every segment a whole document; ``UNBOUNDED``: causal), else ``None``.

    ``segments``: ``sdpa_attention.query_segments`` of the call (host-side already)."""
    if n_k <= 0 or n_q % n_k or n_q // n_k not in (1, 2):
        return None
    windows: list[set[int]] = [set() for _ in range(n_q // n_k)]
    for seg in segments:
        stream = seg.q0 // n_k
        if seg.q1 > (stream + 1) * n_k or seg.first != seg.q0 - stream * n_k or seg.first != seg.doc_start:
            return None
        if not seg.sees_document_start:  # a document no longer than the window is causal under any window
            windows[stream].add(seg.window)
    if any(len(w) > 1 for w in windows):
        return None
    return tuple(min(w, default=UNBOUNDED) for w in windows)


# The compute capabilities each implementation's kernels run on, [from, to): FlashAttention 2 and
# torch's own from Ampere on; flash-attn 3 builds are Hopper's only.
CAPABILITY = {"flash_attn_3": ((9, 0), (10, 0)), "flash_attn_2": ((8, 0), None), "torch": ((8, 0), None)}


def _importable(module: str, function: str) -> VarlenFn | None:
    """``module.function`` if it imports. A wheel built for another torch (undefined symbols), or a
    package of that name without the function, is passed over for the next implementation."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, OSError, AttributeError) as e:
        log.warning("%s is installed but does not load (%s); FlashAttention routing passes it over", module, e)
        return None


def _takes(fn: VarlenFn, *names: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: its keywords are unknown
        return False
    return all(name in params for name in names)


def _capable(name: str) -> bool:
    """This machine's GPU runs ``name``'s kernels (no GPU visible, e.g. a login node's dry run: assumed)."""
    if not torch.cuda.is_available():
        return True
    low, high = CAPABILITY[name]
    capability = torch.cuda.get_device_capability()
    return low <= capability and (high is None or capability < high)


@functools.cache
def installed_varlen() -> str | None:
    """The best FlashAttention varlen implementation with a sliding window on this machine (its
    name), or None. Each is checked on what is installed (its signature, not its version) and
    against the GPU's compute capability. flash-attn must take ``deterministic`` too (2.4 on), so
    that a run asking for reproducible kernels can be served by it."""
    candidates = (
        ("flash_attn_3", "flash_attn_interface", "flash_attn_varlen_func", ("window_size", "deterministic")),
        ("flash_attn_2", "flash_attn", "flash_attn_varlen_func", ("window_size", "deterministic")),
        ("torch", "torch.nn.attention.varlen", "varlen_attn", ("window_size",)),  # older releases lack it
    )
    for name, module, function, keywords in candidates:
        fn = _importable(module, function)
        if fn is not None and _takes(fn, *keywords) and _capable(name):
            return name
    return None


@functools.cache  # called by every layer's attention: resolve the import and signature once
def varlen_function(name: str) -> VarlenFn:
    """``fn(q, k, v, cu_seqlens, max_len, scale, window_size) -> out`` for an implementation name
    of ``installed_varlen`` (``"reference"``: the plain-torch one, any device). Keys and values may
    have fewer heads than the queries (``expand_kv_heads`` first where the implementation needs it)."""
    if name == "reference":
        return varlen_reference
    if name in ("flash_attn_3", "flash_attn_2"):
        module = "flash_attn_interface" if name == "flash_attn_3" else "flash_attn"
        fa = importlib.import_module(module).flash_attn_varlen_func

        def run_flash(q, k, v, cu, max_len, scale, window_size):
            # keywords throughout: flash-attn 3's positional order changed between releases. A run
            # that asked for reproducible kernels (trainer.deterministic) gets dq without atomics.
            out = fa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                     softmax_scale=scale, causal=True, window_size=window_size,
                     deterministic=torch.are_deterministic_algorithms_enabled())  # fmt: skip
            return out[0] if isinstance(out, tuple) else out  # some flash-attn 3 releases also return the LSE
        return run_flash
    from torch.nn.attention.varlen import varlen_attn

    def run_torch(q, k, v, cu, max_len, scale, window_size):
        extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # fewer heads: expand_kv_heads's case
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=window_size, **extra)
    return run_torch


def expand_kv_heads(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Keys and values with the queries' head count where ``name`` cannot group heads itself (a
    torch release whose ``varlen_attn`` has no ``enable_gqa``): once per layer, shared by both streams."""
    if name != "torch" or q.shape[1] == k.shape[1] or _torch_groups_heads():
        return k, v
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


@functools.cache
def _torch_groups_heads() -> bool:
    """The installed torch's ``varlen_attn`` takes fewer key heads than query heads (``enable_gqa``)."""
    from torch.nn.attention.varlen import varlen_attn

    return _takes(varlen_attn, "enable_gqa")


def varlen_reference(q, k, v, cu_seqlens, max_len, scale, window_size) -> torch.Tensor:
    """FlashAttention's varlen contract (``window_size=(left, 0)``, ``left=-1``: causal) in plain
    torch: the CPU stand-in that tests ``varlen_streams`` against the reference op."""
    n = k.shape[0]
    left = window_size[0]
    q_index = torch.arange(n, device=q.device)
    q_window = torch.full_like(q_index, UNBOUNDED if left < 0 else left + 1)
    out, _ = attention_reference(q, k, v, q_index, q_window, cu_seqlens, scale=scale)
    return out


@dataclass(frozen=True)
class VarlenPlan:
    """A whole-streams call's FlashAttention arguments (host-known: no sync in the layers)."""

    implementation: str
    windows: tuple[int, ...]
    max_len: int


def varlen_streams(q, k, v, cu_seqlens, plan: VarlenPlan, scale: float | None = None) -> torch.Tensor:
    """The attention of whole streams: one FlashAttention varlen call per stream on the shared
    keys, outputs in the queries' order."""
    fn = varlen_function(plan.implementation)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = expand_kv_heads(plan.implementation, q, k, v)
    n = k.shape[0]
    cu = cu_seqlens.to(torch.int32)
    outs = []
    for s, window in enumerate(plan.windows):
        left = -1 if window >= UNBOUNDED else window - 1
        outs.append(fn(q[s * n : (s + 1) * n], k, v, cu, plan.max_len, scale, (left, 0)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def describe_routes(device_type: str, dtype: torch.dtype, head_dim: int, attention_type: str,
                    window: int, seq_len: int, sink_tokens: int = 0, deterministic: bool = False) -> dict[str, str]:
    """The route of each kind of layout a run of this model meets, for a dry run's plan and the
    trainer's log: ``{"pretraining": "varlen (flash_attn_2): ...", ...}``."""
    triton = importlib.util.find_spec("triton") is not None
    varlen = installed_varlen() if device_type == "cuda" else None
    base = dict(device_type=device_type, sink_tokens=sink_tokens, dtype=dtype, head_dim=head_dim, varlen=varlen,
                triton=triton, deterministic=deterministic)
    if attention_type == "dense" or window >= seq_len:
        pretrain = RouteFacts(**base, stream_windows=(UNBOUNDED,), needs_mask=False)
    elif attention_type == "sliding":
        pretrain = RouteFacts(**base, stream_windows=(window,))
    else:
        pretrain = RouteFacts(**base, stream_windows=(window, UNBOUNDED))
    layouts = {
        "pretraining": pretrain,
        "answer spans (SFT/RL)": RouteFacts(**base),
        "prefill": RouteFacts(**base),  # a windowed base stream and one output token
        "decode steps": RouteFacts(**base, needs_mask=False),  # one query per sequence
    }

    def say(route: Route) -> str:
        implementation = f" ({varlen})" if route.name == "varlen" else ""
        return f"{route.name}{implementation}: {route.why}"
    routes = {name: say(choose_route(facts)) for name, facts in layouts.items()}
    if device_type == "cuda":  # a dry run on a login node plans with that node's packages
        routes["decided by"] = (f"the packages installed here (torch {torch.__version__}, FlashAttention varlen: "
                                f"{varlen or 'none'}, triton: {'yes' if triton else 'no'}); a node with others may "
                                "route otherwise (the trainer logs the route it takes)")
    return routes


__all__ = ["ROUTES", "Route", "RouteFacts", "VarlenPlan", "choose_route", "describe_routes", "expand_kv_heads",
           "installed_varlen", "varlen_function", "varlen_reference", "varlen_streams", "whole_streams"]
