"""Triton's on-disk autotune entries of the attention kernels: one per (kernel, stream class,
length bucket), so a resumed process reads the tiles its own launch was tuned with and every
length bucket is tuned for its own shape.

With ``TRITON_CACHE_AUTOTUNING=1`` triton 3.6's ``Autotuner.run`` builds a tuning key (the values
of the arguments named in ``key``, then every tensor argument's dtype) and
``Autotuner.check_disk_cache`` names the entry ``sha256("-".join([triton_key(), backend hash,
fn.cache_key, env vars, str(key)] + [str(c) for c in pruned configs]))``. The first two and the
environment are the same for every launch of a process, ``fn.cache_key`` the same for every
launch of one kernel; the rest is computed here exactly as triton does, from the launches the
library really makes (``attention_forward`` / ``attention_backward`` with the GPU config lists,
their kernel launches recorded instead of run, tensors on the meta device).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections import defaultdict

import pytest
import torch
from fixtures import REPO
from triton.runtime.autotuner import Autotuner

from orthros_train.ops import triton_attention as ta

sys.path.insert(0, str(REPO / "bench"))
import attention as attn_bench  # noqa: E402 - bench/attention.py: the phase layouts

SHAPES = {  # the 1.3B recipe's attention and an 8B-class GQA one
    "1.3B": {"heads": 32, "kv_heads": 32, "head_dim": 64},
    "8B": {"heads": 32, "kv_heads": 8, "head_dim": 128},
}
LENGTHS = (1024, 4096, 16384, 32768, 131072)
WINDOW = 128


def test_triton_names_entries_the_way_this_test_computes_them():
    """The installed triton's naming is the one computed below: a release that changes it fails
    here rather than letting the collision test pass on a stale copy."""
    run = inspect.getsource(Autotuner.run)
    disk = inspect.getsource(Autotuner.check_disk_cache)
    assert "key = [_args[key] for key in self.keys if key in _args]" in run
    assert "key.append(str(arg.dtype))" in run
    assert "fn.cache_key" in disk and "str(tuning_key)," in disk and "[str(c) for c in configs]" in disk


def _entry_name(tuner, args: tuple, kwargs: dict) -> str | None:
    """Triton 3.6's entry name for this launch (None: the tuner has one config and tunes nothing)."""
    if len(tuner.configs) <= 1:
        return None
    nargs = dict(zip(tuner.arg_names, args))
    named = {k: v for k, v in {**nargs, **kwargs}.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    tuner.nargs = nargs
    configs = tuner.prune_configs(kwargs)
    tuner.nargs = None
    parts = ["<triton_key>", "<backend>", f"<cache_key of {tuner.base_fn.__name__}>", "<env>", str(tuple(key))]
    return hashlib.sha256("-".join(parts + [str(c) for c in configs]).encode()).hexdigest()


def _launches(monkeypatch, shape: dict, t: int, layout: str, deterministic: bool) -> list[tuple[str, str, int, str]]:
    """(kernel, class, bucket, entry name) of every autotuned launch of one forward + backward."""
    base_key = {name: [k for k in t_.key if k not in ("tune_class", "tune_bucket")] for name, t_ in
                (("fwd", ta._FWD), ("dq", ta._BWD_DQ), ("dkdv", ta._BWD_DKDV))}
    tuners = {name: ta._Autotuners(name, t_.fn, base_key[name], **t_.kw)
              for name, t_ in (("fwd", ta._FWD), ("dq", ta._BWD_DQ), ("dkdv", ta._BWD_DKDV))}
    monkeypatch.setattr(ta, "_FWD", tuners["fwd"])
    monkeypatch.setattr(ta, "_BWD_DQ", tuners["dq"])
    monkeypatch.setattr(ta, "_BWD_DKDV", tuners["dkdv"])
    seen = []

    def record(kernel, grid_fn, args, meta, blocks=None):
        name = next(n for n, t_ in tuners.items() if kernel in t_.values())
        cls, bucket = next(k for k, v in tuners[name].items() if v is kernel)
        seen.append((name, cls, bucket, _entry_name(kernel, args, {**meta, **kernel.tune_args})))

    monkeypatch.setattr(ta, "_launch", record)
    qi, qw, cu = attn_bench.make_queries(layout, t, WINDOW)  # on the CPU: exact rows per class
    meta = torch.device("meta")
    q = torch.empty(qi.numel(), shape["heads"], shape["head_dim"], dtype=torch.bfloat16, device=meta)
    k, v = (torch.empty(t, shape["kv_heads"], shape["head_dim"], dtype=torch.bfloat16, device=meta) for _ in "kv")
    out, lse = ta.attention_forward(q, k, v, qi, qw, cu, 1.0)
    ta.attention_backward(torch.empty_like(out), None, q, k, v, out, lse, qi, qw, cu, 1.0, deterministic)
    return seen


@pytest.fixture
def gpu_lists(monkeypatch, request):
    """The GPU autotune lists and prune (not the interpreter's one config), of triton 3.6 or 3.9."""
    monkeypatch.setattr(ta, "INTERPRET", False)
    monkeypatch.setattr(ta, "TRITON_BEFORE_3_9", request.param)
    monkeypatch.setattr(ta, "_check_device", lambda q: None)
    monkeypatch.setattr(ta, "backward_delta", lambda dout, out, dlse: torch.empty(out.shape[1], out.shape[0],
                                                                               device=out.device))
    return request.param


@pytest.mark.parametrize("gpu_lists", [True, False], ids=["triton<3.9", "triton>=3.9"], indirect=True)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_kernel_class_and_bucket_has_its_own_entry(monkeypatch, gpu_lists, shape):
    owners: dict[str, set] = defaultdict(set)
    tuned = set()
    for t in LENGTHS:
        for layout in ("pretrain", "sft", "prefill"):
            for deterministic in (True, False):
                for kernel, cls, bucket, name in _launches(monkeypatch, SHAPES[shape], t, layout, deterministic):
                    variant = kernel if kernel != "dkdv" or deterministic else "dkdv atomic"
                    tuned.add((variant, cls, bucket))
                    if name is not None:
                        owners[name].add((variant, cls, bucket))
    shared = {name: sorted(who) for name, who in owners.items() if len(who) > 1}
    assert not shared, f"autotuners sharing an on-disk entry: {sorted(shared.values())}"
    # every kernel and class ran at every length bucket of the sweep, each with its own entry
    buckets = {ta.length_bucket(t, t) for t in LENGTHS}
    assert {(k, c) for k, c, _ in tuned} >= {(k, c) for k in ("fwd", "dq", "dkdv") for c in ta.CLASSES}
    assert {b for _, _, b in tuned} >= buckets  # dk/dv buckets count both streams' rows


@pytest.mark.parametrize("gpu_lists", [True], indirect=True)
def test_without_the_class_and_bucket_in_the_key_the_entries_collide(monkeypatch, gpu_lists):
    """What the key arguments prevent: the same launches named without them share entries."""
    monkeypatch.setattr(ta, "TUNE_ARGS", ())
    owners: dict[str, set] = defaultdict(set)
    for t in (4096, 131072):
        for kernel, cls, bucket, name in _launches(monkeypatch, SHAPES["1.3B"], t, "pretrain", True):
            owners[name].add((kernel, cls, bucket))
    assert max(len(who) for who in owners.values()) > 1


def test_d64_dkdv_is_not_pinned_to_16_query_steps_before_triton_3_9():
    """The < 3.9 dk/dv override (16-query steps) applies above head_dim 64, where it was measured
    to be needed; at 64 the autotuner may pick 32-query steps (the sm_90 compile report's rows)."""
    for name in ("dkdv", "dkdv_atomic"):
        for cls in ta.CLASSES:
            narrow = ta.gpu_config_table(False, wide=False, before_3_9=True)[name][cls]
            wide = ta.gpu_config_table(False, wide=True, before_3_9=True)[name][cls]
            assert max(bm for bm, *_ in narrow) >= 32 and {bm for bm, *_ in wide} == {16}
    assert ta.gpu_config_table(False, wide=True, before_3_9=False) is ta._GPU_CONFIGS
