"""Tensor-by-tensor checkpoint conversion on top of ``common.safetensors_io``.

A conversion never holds a whole checkpoint in memory, let alone two: the reader opens every
shard lazily and hands out one tensor at a time; the writer fills one output shard at a time,
saves it and lets it go. Peak memory is about one output shard.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from orthros_train.common.safetensors_io import (
    SafetensorsFileError,
    SafetensorsReader,
    ShardedSafetensorsWriter,
)
from orthros_train.errors import UserError

CONFIG_NAME = "config.json"
# Everything a tokenizer or a generation default can live in; copied along with the weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(UserError):
    """A checkpoint or config that cannot be converted; the message names the file and the fix."""


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``None``/``"auto"`` keep each tensor's own dtype; otherwise one of :data:`DTYPE_NAMES`."""
    if name is None or name == "auto":
        return None
    if name not in DTYPE_NAMES:
        raise ConversionError(f"unknown dtype {name!r}; use one of {['auto', *DTYPE_NAMES]}")
    return DTYPE_NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_byte_size(size: str | int) -> int:
    """``"4GB"``, ``"500MB"``, ``"2GiB"`` or a byte count; anything else (or <= 0) is refused."""
    fix = "use a positive size such as 4GB, 500MB, 2GiB or a byte count (--max-shard-size)"
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ConversionError(f"max shard size {size!r} is not a size: {fix}")
    if isinstance(size, int):
        value = size
    else:
        text = size.strip().upper().replace(" ", "")
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        number, factor = text, 1
        for unit, f in units.items():
            if text.endswith(unit):
                number, factor = text[: -len(unit)], f
                break
        try:
            value = int(float(number) * factor)
        except (ValueError, OverflowError):
            raise ConversionError(f"max shard size {size!r} is not a size: {fix}") from None
    if value <= 0:
        raise ConversionError(f"max shard size {size!r} is not positive: {fix}")
    return value


def read_json(path: Path, fix: str) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path} not found: {fix}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err}): {fix}") from err


def read_source(directory: str | Path, fix: str) -> SafetensorsReader:
    """The lazy reader of a source checkpoint; what it cannot read is a ``ConversionError`` naming
    the file and ``fix``."""
    try:
        return SafetensorsReader(directory, fix)
    except SafetensorsFileError as err:
        raise ConversionError(str(err)) from err


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_sharded(
    directory: Path,
    tensors: Iterable[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    max_shard_bytes: int,
) -> list[Path]:
    """Write tensors shard by shard as ``produce`` builds each one (``ShardedSafetensorsWriter``).

    One shard: ``model.safetensors``. Several: ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (the Hugging Face layout).
    """
    with ShardedSafetensorsWriter(directory, max_shard_bytes) as writer:
        for t in tensors:
            tensor = produce(t)
            if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
                raise AssertionError(f"{t.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {t}")
            writer.add(t.name, tensor)
            del tensor
        return writer.finish()


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer / generation-config files that exist in ``src``; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied
