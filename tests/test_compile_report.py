"""Ahead-of-time sm_90 compile of every kernel config (no GPU needed): 0 spills, fits shared memory.

``bench/attention.py --compile-sm90 --json`` compiles each config the autotuners may pick the way
the JIT specialises it for aligned tensors and runs triton's ptxas for registers and spills.
It needs the real compiler, so it runs in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
H100_SHARED_BYTES = 227 * 1024
KEYS = {"kernel", "config", "head_dim", "dtype", "regs", "spill_bytes", "shared_bytes", "autotune"}


def _ptxas_available() -> bool:
    try:
        import triton.backends.nvidia.compiler as nv

        return os.path.exists(nv.get_ptxas(90).path)
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this triton build
        return False


def _report(head_dim: int, dtype: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "bench" / "attention.py"), "--compile-sm90", "--json",
           "--head-dim", str(head_dim), "--dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas is not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_autotune_configs_have_no_spills_on_sm90(head_dim, dtype):
    rows = _report(head_dim, dtype)
    assert rows and all(KEYS <= set(r) for r in rows)
    assert {r["kernel"].split("[")[0] for r in rows} == {"fwd", "dq", "dkdv", "decode_split", "decode_combine"}
    launched = [r for r in rows if r["autotune"] or r.get("fixed")]
    bad = [r for r in launched if r.get("error") or r["spill_bytes"] or r["shared_bytes"] > H100_SHARED_BYTES]
    assert not bad, json.dumps(bad, indent=1)
