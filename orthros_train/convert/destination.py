"""Where a conversion writes: the destination folder, published whole, keeping what is not ours.

Both directions (``from-hf``, ``to-hf``) write their output into a private folder beside the
destination and swap it in only once it is complete (``common.publish``): a crash, a kill -9 or a
full disk half-way leaves the previous model in the destination untouched (or, after the swap, the
whole new one), never a folder with no model or a mix of two.

``--overwrite`` replaces only what an earlier conversion wrote. Each conversion records the names
it wrote in ``.orthros-convert.json`` (``MANIFEST``); a destination without one (written before the
record existed) counts the files a conversion writes by name: ``config.json``, the weights and their
index, the shards the index names, the tokenizer and generation files, the remote code. Everything
else in the destination (the user's notes, an adapter's ``*.safetensors``, sub-folders) is carried
into the new folder untouched. A destination that is a symbolic link, or holds a link to a folder,
is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from orthros_train.common.publish import (
    FolderTakenError,
    begin,
    carry_over,
    check_no_symlinks,
    discard,
    swap_into_place,
)
from orthros_train.common.safetensors_io import INDEX_NAME, WEIGHTS_NAME
from orthros_train.convert import checkpoint_io, remote_code
from orthros_train.convert.checkpoint_io import CONFIG_NAME, SIDE_FILES, ConversionError, PlannedTensor

MANIFEST = ".orthros-convert.json"
# Names a conversion writes whatever the model: shards as transformers names them, leftovers of an
# interrupted write by older versions (hidden ``*.tmp``).
OUR_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|\..*\.tmp")

T = TypeVar("T")


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse to write into the source, through a symbolic link, or over an existing folder
    without ``--overwrite``; nothing is written."""
    if dst.exists() and src.resolve() == dst.resolve():
        raise ConversionError(f"destination {dst} is the source directory; choose a new directory")
    check_no_symlinks(dst)  # an UnsafeFolderError (a UserError): one line
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ConversionError(f"destination {dst} exists and is not empty; choose a new directory or pass --overwrite")


def written_before(dst: Path) -> set[str]:
    """The names in ``dst`` that an earlier conversion wrote: its manifest's, or for a destination
    without a readable manifest, the names a conversion writes."""
    try:
        recorded = json.loads((dst / MANIFEST).read_text())["files"]
        if isinstance(recorded, list) and all(isinstance(n, str) for n in recorded):
            return {n for n in recorded if n and "/" not in n and n not in (".", "..")} | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    names = {CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, MANIFEST, *SIDE_FILES, *remote_code.REMOTE_CODE_FILES}
    try:
        weight_map = json.loads((dst / INDEX_NAME).read_text()).get("weight_map") or {}
        names |= {f for f in weight_map.values() if isinstance(f, str) and "/" not in f}
    except (OSError, ValueError, AttributeError):
        pass
    return names | {n for n in os.listdir(dst) if OUR_PATTERN.fullmatch(n)}


def not_ours(dst: Path, overwrite: bool) -> list[str]:
    """Entries of an existing ``dst`` that the new folder must carry over (``--overwrite``)."""
    if not (overwrite and dst.is_dir()):
        return []
    return sorted(set(os.listdir(dst)) - written_before(dst))


def _failure(dst: Path, existed: bool, err: BaseException) -> ConversionError:
    reason = getattr(err, "strerror", None) or " ".join(str(err).split()) or type(err).__name__
    kept = f"the previous model in {dst} is intact" if existed else "nothing was kept"
    fix = "free space (or raise the file size limit) and run it again"
    return ConversionError(f"writing {dst} failed ({reason}); {kept}; {fix}")


def write_destination(
    src: Path,
    dst: Path,
    overwrite: bool,
    plan: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    max_shard_bytes: int,
    finish: Callable[[Path], T],
    command: str,
) -> tuple[list[Path], T]:
    """Write the weights (``plan``, tensor by tensor) and then ``finish(folder)`` (config, side
    files) into a private folder and publish it as ``dst``; returns the weight files under their
    ``dst`` names and what ``finish`` returned. A failure (a full disk: OSError or safetensors'
    SafetensorError) is a ``ConversionError`` saying the previous model is intact."""
    from safetensors import SafetensorError

    check_destination(src, dst, overwrite)
    existed = dst.is_dir() and any(dst.iterdir())
    carry = not_ours(dst, overwrite)
    try:
        built = begin(dst)
    except OSError as err:
        raise ConversionError(
            f"cannot create destination {dst} ({err.strerror or err}); choose a writable directory"
        ) from err
    try:
        files = checkpoint_io.write_sharded(built, plan, produce, max_shard_bytes)
        result = finish(built)
        _write_manifest(built, command)
        carry_over(dst, built, carry)
        # A destination that was new must still be: a second conversion into the same new folder
        # that finished first is not replaced without --overwrite (both would report success).
        swap_into_place(built, dst, replace=existed)
    except BaseException as err:
        discard(built)
        if isinstance(err, FolderTakenError):
            raise ConversionError(
                f"destination {dst} was written by another process while this conversion ran (a second conversion "
                f"into the same folder?); this one's output was not kept: check what {dst} holds, and pass "
                "--overwrite to replace it"
            ) from err
        if isinstance(err, (OSError, SafetensorError)):
            raise _failure(dst, existed, err) from err
        raise
    return [dst / f.name for f in files], result


def _write_manifest(built: Path, command: str) -> None:
    """Record what this conversion wrote (everything in ``built`` before the carry-over)."""
    names = sorted({*os.listdir(built), MANIFEST})
    (built / MANIFEST).write_text(json.dumps({"command": f"orthros-convert {command}", "files": names}, indent=1))
