"""Small helpers shared by the eval commands: argument parsing, JSON output, environment facts."""

from __future__ import annotations

import argparse
import json
import platform
import re
from pathlib import Path
from typing import Any

import torch

from orthros_train.common.files import write_atomic
from orthros_train.common.overrides import check_types, parse_key_values
from orthros_train.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_token_count(text: str) -> int:
    """``"4k"`` -> 4096, ``"1m"`` -> 1048576, ``"300"`` -> 300."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"not a token count: {text!r} (use e.g. 512, 4k, 1m)")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * {"": 1, "k": 1024, "m": 1024 * 1024}[unit])


def _bounded(parse, low: int, what: str):
    """An argparse ``type``: ``parse`` the text, then refuse values below ``low`` (argparse turns the
    error into "argument --x: ..." and exit status 2, before any model loads)."""

    def check(text: str) -> int:
        try:
            value = parse(text)
        except UserError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value

    check.__name__ = parse.__name__  # argparse names the type in its messages
    return check


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"not an integer: {text!r}") from None


positive_int = _bounded(_int, 1, "a positive integer (>= 1)")
nonnegative_int = _bounded(_int, 0, "an integer >= 0")
positive_size = _bounded(lambda t: parse_token_count(t), 1, "a positive token count (e.g. 512, 4k)")
nonnegative_size = _bounded(lambda t: parse_token_count(t), 0, "a token count >= 0 (e.g. 0, 512, 4k)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number")
    return value


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
        lo, hi = parse_token_count(lo_s), parse_token_count(hi_s)
        if lo < 1 or hi < lo:
            raise UserError(f"bad length range {text!r}: need 1 <= low <= high")
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    lengths = sorted({parse_token_count(p) for p in text.split(",") if p.strip()})
    if not lengths or lengths[0] < 1:
        raise UserError(f"bad lengths {text!r}: need one or more token counts >= 1 (e.g. 1k,4k or 1k..16k)")
    return lengths


def parse_depths(text: str | list | tuple) -> list[float]:
    """Needle depths in percent: ``"0,25,50,75,100"`` or ``"0..100:11"`` (11 evenly spaced)."""
    fix = "use e.g. 0,50,100 or 0..100:11 (percent, 0..100)"
    try:
        if isinstance(text, (list, tuple)):
            depths = [float(x) for x in text]
        elif ".." in str(text):
            span, _, count = str(text).strip().partition(":")
            lo_s, hi_s = span.split("..", 1)
            lo, hi, n = float(lo_s), float(hi_s), int(count or 11)
            if n < 1:
                raise UserError(f"bad depths {text!r}: the count after ':' must be >= 1; {fix}")
            depths = [lo] if n < 2 else [round(lo + (hi - lo) * i / (n - 1), 4) for i in range(n)]
        else:
            depths = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError as err:  # float()/int() of a word
        raise UserError(f"bad depths {text!r} ({err}); {fix}") from None
    if not depths:
        raise UserError(f"bad depths {text!r}: no depth given; {fix}")
    for d in depths:
        if not 0 <= d <= 100:  # also catches NaN
            raise UserError(f"depth {d} outside 0..100 (percent); {fix}")
    return depths


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["sliding_window=256", "attention_backend=reference"]`` -> typed dict (JSON values when they
    parse), checked against ``OrthrosConfig`` by ``common.overrides.check_types``:
    ``sliding_window=abc`` is named here, not a TypeError deep in the model's constructor."""
    from orthros_train.model.config import OrthrosConfig

    values = parse_key_values(items, "--override")
    checked = check_types(OrthrosConfig, values, where="in --override")
    return {key: checked[key] for key in values}


def write_json(data: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


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
