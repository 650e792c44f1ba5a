"""Tensor-by-tensor safetensors reading and writing for checkpoint conversion.

A conversion never holds a whole checkpoint in memory, let alone two: the reader opens every
shard lazily (``safe_open``) and hands out one tensor at a time; the writer fills one output
shard at a time, saves it and lets it go. Peak memory is about one output shard.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orthros_train.common.files import honour_umask
from orthros_train.errors import UserError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
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

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
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


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def open_safetensors(path: Path, fix: str = "") -> Any:
    """``safe_open`` with the file named when it is truncated or not safetensors at all (the
    library's own message names neither the file nor the fix)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        size = path.stat().st_size if path.is_file() else 0
        raise ConversionError(
            f"{path} ({size:,} bytes) is not a readable safetensors file ({err}): it is truncated or corrupt, "
            f"e.g. an interrupted download or copy; fetch or copy it again. {fix}".rstrip()
        ) from err


def check_safetensors_files(directory: str | Path, fix: str = "") -> None:
    """Open the header of every ``*.safetensors`` in ``directory`` (cheap: no tensor is read), so a
    truncated or corrupt file is named before a model is built."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        open_safetensors(path, fix)


class SafetensorsReader:
    """Lazy, read-only view of the tensors of a checkpoint directory.

    Accepts ``model.safetensors``, or shards listed in ``model.safetensors.index.json``, or (for
    directories our own trainer wrote) a single ``*.safetensors`` file. Every listed shard must
    exist and hold the tensors the index says it holds.
    """

    def __init__(self, directory: str | Path, fix: str) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        self._info: dict[str, TensorInfo] = {}
        index_path = self.directory / INDEX_NAME
        if index_path.is_file():
            weight_map = read_json(index_path, fix).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"{index_path} has no 'weight_map': {fix}")
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ConversionError(
                    f"{index_path.name} lists shard(s) missing from {self.directory}: {', '.join(missing)}. "
                    f"Download the missing file(s) again (all shards of the index are needed): {fix}"
                )
        else:
            weight_map = None
            single = self.directory / WEIGHTS_NAME
            candidates = [single] if single.is_file() else sorted(self.directory.glob("*.safetensors"))
            if not candidates:
                bins = sorted(p.name for p in self.directory.glob("*.bin"))
                hint = (
                    f" It has PyTorch pickles ({', '.join(bins[:3])}): re-save them as safetensors with "
                    "`model.save_pretrained(dir, safe_serialization=True)`."
                    if bins
                    else ""
                )
                raise ConversionError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {self.directory}.{hint} {fix}")
            if len(candidates) > 1:
                raise ConversionError(
                    f"{self.directory} holds {len(candidates)} *.safetensors files but no {INDEX_NAME} "
                    f"saying which tensor lives where: restore the index file. {fix}"
                )
            files = candidates
        for path in files:
            handle = open_safetensors(path, fix)
            self._handles[path] = handle
            for name in handle.keys():
                if weight_map is not None and self.directory / weight_map.get(name, "") != path:
                    continue  # the index says this tensor lives elsewhere (or nowhere)
                piece = handle.get_slice(name)
                dtype = _DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise ConversionError(f"tensor {name} in {path} has unsupported dtype {piece.get_dtype()}")
                self._info[name] = TensorInfo(name, path, tuple(piece.get_shape()), dtype)
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self._info))
            if absent:
                raise ConversionError(
                    f"{index_path.name} lists tensors that its shards do not hold (first: "
                    f"{absent[0]} in {weight_map[absent[0]]}): the shard is truncated or from another "
                    f"download; download it again. {fix}"
                )

    @property
    def names(self) -> list[str]:
        return list(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor from disk now (the only copy this module ever holds of it)."""
        return self._handles[self._info[name].file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    """Write tensors shard by shard; ``produce`` builds each one when its shard is written.

    One shard: ``model.safetensors``. Several: ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (the Hugging Face layout).
    """
    from safetensors.torch import save_file

    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for shard, file_name in zip(shards, names):
        state = {}
        for t in shard:
            tensor = produce(t)
            if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
                raise AssertionError(f"{t.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {t}")
            state[t.name] = tensor.contiguous()
            weight_map[t.name] = file_name
            total += t.nbytes
        save_file(state, str(directory / file_name), metadata={"format": "pt"})
        honour_umask(directory / file_name)  # save_file creates 0600 files whatever the umask
        del state
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / f for f in names]


def prepare_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse to write into the source or over an existing checkpoint unless asked to."""
    if src.resolve() == dst.resolve():
        raise ConversionError(f"destination {dst} is the source directory; choose a new directory")
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise ConversionError(
                f"destination {dst} exists and is not empty; choose a new directory or pass --overwrite"
            )
        # Stale shards would be picked up by loaders that glob *.safetensors.
        for stale in [*dst.glob("*.safetensors"), dst / INDEX_NAME, dst / CONFIG_NAME]:
            if stale.is_file():
                stale.unlink()
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConversionError(
            f"cannot create destination {dst} ({err.strerror or err}); choose a writable directory"
        ) from err


def write_destination(
    src: Path,
    dst: Path,
    overwrite: bool,
    plan: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    max_shard_bytes: int,
) -> list[Path]:
    """``prepare_destination`` + ``write_sharded``; a destination this call created is removed
    again when writing fails (a full disk, a corrupt source tensor), so nothing half-written stays."""
    created = not dst.exists() or (dst.is_dir() and not any(dst.iterdir()))
    prepare_destination(src, dst, overwrite)
    try:
        return write_sharded(dst, plan, produce, max_shard_bytes)
    except BaseException as err:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        if isinstance(err, OSError):
            raise ConversionError(f"writing {dst} failed ({err.strerror or err}); nothing was kept") from err
        raise


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer / generation-config files that exist in ``src``; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied
