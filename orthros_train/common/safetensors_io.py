"""Safetensors on disk: one lazy reader of a file or a folder of shards, one streaming sharded writer.

``SafetensorsReader`` opens every file's header (no tensor is read) and hands out one tensor at a
time, so resharding or converting an 8B checkpoint holds one tensor, not the model. It reads
``model.safetensors``, the shards an index (``model.safetensors.index.json``, or another index
name such as the optimizer's ``index.json``) lists, the one ``*.safetensors`` of a folder, or a
file given by path.

``ShardedSafetensorsWriter`` takes tensors as they arrive and closes a shard once the next tensor
would push it past the size bound; peak memory is about one shard. Shards are written under hidden
temporary names and renamed to their final names by ``finish``, which writes the index last, so a
folder never shows a half-written shard under a name a loader would read. Files get the mode the
umask asks for (safetensors itself creates them 0600).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orthros_train.common.files import honour_umask, replace_durably, temp_name, write_atomic
from orthros_train.errors import UserError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PT_METADATA = {"format": "pt"}

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFileError(UserError):
    """A safetensors file, shard or index that cannot be read; the message names the file and the fix."""


class NoSafetensorsError(SafetensorsFileError):
    """The path does not exist or holds no ``*.safetensors`` file at all."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _fix(fix: str) -> str:
    return f" {fix}" if fix else ""


def open_safetensors(path: str | Path, fix: str = "") -> Any:
    """``safe_open`` with the file, its size and the fix named when it is truncated, not safetensors
    at all or unreadable (the library's own message, e.g. "incomplete metadata, file not fully
    covered", names neither)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        size = path.stat().st_size if path.is_file() else 0
        reason = " ".join(str(err).split())
        raise SafetensorsFileError(
            f"{path} ({size:,} bytes) is not a readable safetensors file ({reason}): it is truncated or corrupt, "
            f"e.g. an interrupted download, copy or save; fetch or copy it again.{_fix(fix)}"
        ) from err


def check_safetensors_files(directory: str | Path, fix: str = "") -> None:
    """Open the header of every ``*.safetensors`` in ``directory`` (cheap: no tensor is read), so a
    truncated or corrupt file is named before a model is built."""
    for path in sorted(Path(directory).glob("*.safetensors")):
        if path.is_file():
            open_safetensors(path, fix)


def read_index(path: Path, fix: str = "") -> dict[str, Any]:
    """An index file's JSON with a non-empty ``weight_map`` (tensor -> shard file name)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SafetensorsFileError(
            f"{path} is not a readable index ({' '.join(str(err).split())}): fetch or copy it again.{_fix(fix)}"
        ) from err
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(f, str) and f.strip() for f in weight_map.values()
    ):
        raise SafetensorsFileError(
            f"{path} has no 'weight_map' of tensor names to shard files: fetch or copy it again.{_fix(fix)}"
        )
    return body


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """Lazy, read-only ``name -> tensor`` view of a safetensors file or folder.

    A folder is read through its index (``index_name``) when it has one: every shard it lists must
    exist and hold the tensors it says; files it does not list are ignored. Without an index it
    reads ``model.safetensors``, else its only ``*.safetensors``; several shards without an index
    are refused (which tensor lives where is unknown, and a stale shard would be read too).
    ``fix`` ends every error message (what the user should do or point at instead).
    """

    def __init__(self, path: str | Path, fix: str = "", index_name: str = INDEX_NAME) -> None:
        path = Path(path)
        self.path = path
        self._handles: dict[Path, Any] = {}
        self._info: dict[str, TensorInfo] = {}
        weight_map: dict[str, str] | None = None
        if path.is_file():
            files = [path]
        elif not path.is_dir():
            raise NoSafetensorsError(f"{path} does not exist: no safetensors weights to read.{_fix(fix)}")
        elif (path / index_name).is_file():
            index_path = path / index_name
            weight_map = read_index(index_path, fix)["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise SafetensorsFileError(
                    f"{index_path} lists shard(s) missing from {path}: {', '.join(missing)}. Download or copy the "
                    f"missing file(s) again (all shards of the index are needed).{_fix(fix)}"
                )
        else:
            single = path / WEIGHTS_NAME
            files = [single] if single.is_file() else sorted(f for f in path.glob("*.safetensors") if f.is_file())
            if not files:
                bins = sorted(p.name for p in path.glob("*.bin"))
                hint = (
                    f" It has PyTorch pickles ({', '.join(bins[:3])}): re-save them as safetensors with "
                    "`model.save_pretrained(dir, safe_serialization=True)`."
                    if bins
                    else ""
                )
                raise NoSafetensorsError(
                    f"no *.safetensors weights ({WEIGHTS_NAME} or {index_name}) in {path}.{hint}{_fix(fix)}"
                )
            if len(files) > 1:
                raise SafetensorsFileError(
                    f"{path} holds {len(files)} *.safetensors files but no {index_name} saying which tensor "
                    f"lives where: restore the index file.{_fix(fix)}"
                )
        for file in files:
            handle = open_safetensors(file, fix)
            self._handles[file] = handle
            for name in handle.keys():
                if weight_map is not None and path / weight_map.get(name, "") != file:
                    continue  # the index says this tensor lives elsewhere (or nowhere)
                piece = handle.get_slice(name)
                dtype = _DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise SafetensorsFileError(
                        f"tensor {name} in {file} has dtype {piece.get_dtype()}, which is not supported here "
                        f"({', '.join(_DTYPES)}).{_fix(fix)}"
                    )
                self._info[name] = TensorInfo(name, file, tuple(piece.get_shape()), dtype)
        if weight_map is not None:
            absent = [n for n in weight_map if n not in self._info]
            if absent:
                raise SafetensorsFileError(
                    f"{path / index_name} lists tensors that its shards do not hold (first: {absent[0]} in "
                    f"{weight_map[absent[0]]}): the shard is truncated or from another download; download or "
                    f"copy it again.{_fix(fix)}"
                )

    @property
    def names(self) -> list[str]:
        return list(self._info)

    @property
    def files(self) -> list[Path]:
        return list(self._handles)

    def info(self, name: str) -> TensorInfo:
        """Shape, dtype and file of ``name`` without reading it."""
        return self._info[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        """Read one tensor from disk now (``get(name)`` is Mapping's: None for a missing name)."""
        if name not in self._info:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        return self._handles[self._info[name].file].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._info

    def __iter__(self) -> Iterator[str]:
        return iter(self._info)

    def __len__(self) -> int:
        return len(self._info)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    honour_umask(path)  # save_file creates 0600 files whatever the umask


def _temporary(path: Path) -> Path:
    """A hidden name beside ``path``, private to this host and process (``common.files`` rule)."""
    return path.with_name(f"{temp_name(path)}tmp")


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = PT_METADATA
) -> Path:
    """One safetensors file, written under a temporary name and renamed into place (a reader sees
    the old file or the new one, never part of one); its mode follows the umask."""
    path = Path(path)
    tmp = _temporary(path)
    try:
        _save(tensors, tmp, metadata)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardedSafetensorsWriter:
    """Tensors arriving one at a time (``add``), grouped into safetensors shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own); ``finish`` names the shards and
    writes the index.

    Names: one shard is ``single_name`` when given (``model.safetensors``, no index); otherwise
    shard ``i`` of ``n`` is ``<stem>-0000i-of-0000n.safetensors`` (the Hugging Face layout) or, with
    ``of_total=False``, ``<stem>-0000i.safetensors``, and ``index_name`` holds
    ``{**index_fields, "metadata": {"total_size": ...}, "weight_map": {tensor: file}}``. Shard
    boundaries depend on tensor sizes only.

    Until ``finish`` shards live under hidden temporary names; ``abort`` (or leaving a ``with``
    block by an exception) removes them. A distributed save subclasses the four hooks: which shards
    this process writes (``writes_shard``), the copy it keeps of a tensor (``keep``), where a write
    runs (``submit``) and whether it writes the index (``writes_index``).
    """

    def __init__(
        self,
        directory: str | Path,
        max_shard_bytes: int,
        stem: str = "model",
        of_total: bool = True,
        single_name: str | None = WEIGHTS_NAME,
        index_name: str = INDEX_NAME,
        metadata: dict[str, str] | None = PT_METADATA,
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.directory, self.max_shard_bytes = Path(directory), max_shard_bytes
        self.stem, self.of_total, self.single_name = stem, of_total, single_name
        self.index_name, self.metadata = index_name, metadata
        self.shard_of: dict[str, int] = {}  # tensor -> shard number (1-based)
        self.total_bytes = 0
        self.finished: list[Path] = []
        self._shard = 1
        self._shard_bytes = 0
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._written: list[Path] = []  # temporary files this process has queued

    # -- hooks -----------------------------------------------------------------------------------
    def writes_shard(self, shard: int) -> bool:
        """Whether this process writes shard ``shard`` (1-based)."""
        return True

    def keep(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The copy of ``tensor`` held until its shard is written."""
        return tensor.detach().to("cpu").contiguous()

    def submit(self, write: Callable[[], None], release: int = 0, path: Path | None = None) -> None:
        """Run ``write`` (which writes ``path``; ``release``: the bytes of the tensors it holds)."""
        write()

    def rename(self, source: Path, target: Path) -> None:
        """Give a written shard its final name (fsynced first: the name never shows a partial file)."""
        replace_durably(source, target, durable=False)

    def writes_index(self) -> bool:
        return True

    # -- streaming -------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.shard_of:
            raise ValueError(f"tensor {name!r} was added twice")
        nbytes = tensor_bytes(tensor)
        if self._shard_bytes and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._close()
        self.shard_of[name] = self._shard
        self._shard_bytes += nbytes
        self.total_bytes += nbytes
        if self.writes_shard(self._shard):
            self._current[name] = self.keep(name, tensor)
            self._current_bytes += nbytes

    @property
    def shards(self) -> int:
        """Shards this save has (or will have, once ``finish`` closes the last)."""
        return max(self.shard_of.values(), default=0)

    def _temporary_path(self, shard: int) -> Path:
        return _temporary(self.directory / f"{self.stem}-{shard:05d}.safetensors")

    def _close(self) -> None:
        if self.writes_shard(self._shard) and self._current:
            tensors, nbytes, metadata = self._current, self._current_bytes, self.metadata
            path, directory = self._temporary_path(self._shard), self.directory

            def write() -> None:
                directory.mkdir(parents=True, exist_ok=True)
                _save(tensors, path, metadata)

            self._written.append(path)
            self.submit(write, release=nbytes, path=path)
        self._current, self._current_bytes = {}, 0
        self._shard += 1
        self._shard_bytes = 0

    def shard_name(self, shard: int, shards: int) -> str:
        if shards == 1 and self.single_name is not None:
            return self.single_name
        if self.of_total:
            return f"{self.stem}-{shard:05d}-of-{shards:05d}.safetensors"
        return f"{self.stem}-{shard:05d}.safetensors"

    def finish(self, index_fields: dict[str, Any] | None = None) -> list[Path]:
        """Close the last shard, rename this process's shards to their final names and write the
        index (none for a single shard with ``single_name``). Returns every shard's final path."""
        shards = self.shards
        if self._shard_bytes:
            self._close()
        names = {i: self.shard_name(i, shards) for i in range(1, shards + 1)}
        for i in range(1, shards + 1):
            if self.writes_shard(i):
                source, target = self._temporary_path(i), self.directory / names[i]
                self.submit(lambda s=source, t=target: self.rename(s, t))  # after the write: submits run in order
        self._written.clear()
        self.finished = [self.directory / names[i] for i in range(1, shards + 1)]
        if (shards == 1 and self.single_name is not None) or not self.writes_index():
            return self.finished
        weight_map = {name: names[i] for name, i in self.shard_of.items()}
        body = {**(index_fields or {}), "metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        path = self.directory / self.index_name

        def write_index() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(body, indent=2) + "\n")

        self.submit(write_index)
        return self.finished

    def abort(self) -> None:
        """Remove the temporary shards this process wrote (a failed save leaves nothing behind)."""
        for path in self._written:
            path.unlink(missing_ok=True)
        self._written.clear()
        self._current, self._current_bytes = {}, 0

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
