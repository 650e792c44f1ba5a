"""Small helpers shared by the eval commands: argument parsing, JSON output, environment facts."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

import torch

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_size(text: str) -> int:
    """``"4k"`` -> 4096, ``"1m"`` -> 1048576, ``"300"`` -> 300."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a token count: {text!r} (use e.g. 512, 4k, 1m)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * {"": 1, "k": 1024, "m": 1024 * 1024}[unit])


def parse_lengths(text: str | list | tuple) -> list[int]:
    """``"1k..64k"`` (powers of two between), ``"1k,4k,16k"``, or a list of those."""
    if isinstance(text, (list, tuple)):
        out: list[int] = []
        for item in text:
            out.extend(parse_lengths(item))
        return sorted(set(out))
    text = str(text).strip()
    if ".." in text:
        lo_s, hi_s = text.split("..", 1)
        lo, hi = parse_size(lo_s), parse_size(hi_s)
        if lo < 1 or hi < lo:
            raise ValueError(f"bad length range {text!r}: need 1 <= low <= high")
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    return sorted({parse_size(p) for p in text.split(",") if p.strip()})


def parse_depths(text: str | list | tuple) -> list[float]:
    """Needle depths in percent: ``"0,25,50,75,100"`` or ``"0..100:11"`` (11 evenly spaced)."""
    if isinstance(text, (list, tuple)):
        return [float(x) for x in text]
    text = str(text).strip()
    if ".." in text:
        span, _, count = text.partition(":")
        lo_s, hi_s = span.split("..", 1)
        lo, hi, n = float(lo_s), float(hi_s), int(count or 11)
        if n < 2:
            return [lo]
        return [round(lo + (hi - lo) * i / (n - 1), 4) for i in range(n)]
    depths = [float(p) for p in text.split(",") if p.strip()]
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"depth {d} outside 0..100 (percent)")
    return depths


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["sliding_window=256", "attention_backend=reference"]`` -> typed dict (JSON values when they parse)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def write_json(data: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def environment(device: torch.device) -> dict[str, Any]:
    """Where a measurement ran (goes into every JSON so numbers keep their context)."""
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
