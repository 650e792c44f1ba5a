"""The teacher of a distillation run (``train/distill.py``) as data: its config (the checkpoint's,
run dense), what a dry run plans for, its identity (a content hash a checkpoint records and a
resume checks) and the refusals that need no model: a missing checkpoint, another vocabulary or
tokenizer, a teacher changed since the checkpoint. No torch model is built here, so the memory
model and the dry run can use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.model.config import OrthrosConfig
from orthros_train.options import AttentionType, DistillAlign

log = logging.getLogger(__name__)

# Teachers up to this size are hashed whole; larger ones by their headers, sizes and sampled blocks.
FULL_HASH_BYTES = 256 << 20
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 1 << 20


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def teacher_identity(path: str | Path) -> dict[str, Any]:
    """What a checkpoint records of the teacher: its path and a content hash of its config and
    weights. Small teachers are hashed whole; an 8B one (16 GB) by the safetensors headers (names,
    dtypes, shapes, offsets), the file sizes and ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BYTES``
    spread over each file: seconds instead of minutes, and a retrained or swapped checkpoint
    changes the sampled bytes."""
    path = Path(path)
    files = _weight_files(path)
    total = sum(f.stat().st_size for f in files)
    method = "full" if total <= FULL_HASH_BYTES else "sampled"
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            if method == "full":
                for block in iter(lambda: fh.read(SAMPLE_BYTES), b""):
                    digest.update(block)
                continue
            header = int.from_bytes(fh.read(8), "little")  # safetensors: u64 header length, JSON header
            digest.update(fh.read(header))
            for i in range(SAMPLE_BLOCKS):
                fh.seek(i * max(size - SAMPLE_BYTES, 0) // max(SAMPLE_BLOCKS - 1, 1))
                digest.update(fh.read(SAMPLE_BYTES))
    return {"path": str(path), "sha256": digest.hexdigest(), "method": method, "bytes": total}


def check_teacher_unchanged(recorded: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to resume a distillation run whose teacher's weights or config changed since
    ``checkpoint`` was written (the loss would silently change mid-run)."""
    if not recorded:
        log.info("checkpoint %s records no distillation teacher (written without distillation): "
                 "distilling from %s from here", checkpoint, current["path"], extra=RANK_ZERO)
        return
    if recorded.get("sha256") != current["sha256"]:
        raise UserError(
            f"distill.teacher={current['path']} has changed since checkpoint {checkpoint} was written (content "
            f"hash {recorded.get('sha256', '?')[:12]} recorded at {recorded.get('path')}, {current['sha256'][:12]} "
            "now): the distillation target would change mid-run; restore that teacher, or start a new run "
            "(another trainer.run_dir, model.init_from=<the checkpoint's model/>)"
        )


def teacher_config(path: str | Path, student: OrthrosConfig) -> OrthrosConfig:
    """The teacher's config: its checkpoint's ``config.json`` run as the dense model (full
    attention, no output stream, no sinks), on the student's attention backend. Refuses a
    missing checkpoint or another vocabulary."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        where = "it does not exist" if not path.exists() else f"{config} is missing"
        raise UserError(
            f"distill.teacher={path} is not an Orthros checkpoint directory ({where}): point distill.teacher (or "
            "model.init_from, its default) at the output of orthros-convert from-hf or a checkpoint's model/ or "
            "final/ directory"
        )
    try:
        fields = json.loads(config.read_text())
        cfg = OrthrosConfig.from_dict(
            {**fields, "attention_type": AttentionType.dense, "sink_tokens": 0,
             "attention_backend": student.attention_backend}
        )  # fmt: skip
    except (UnicodeDecodeError, json.JSONDecodeError, UserError, TypeError, AttributeError) as exc:
        # TypeError/AttributeError: JSON that is not an object of config fields
        raise UserError(
            f"distill.teacher={path}: {config} is not an Orthros model config ({exc}); restore it, or point "
            "distill.teacher (or model.init_from) at another checkpoint directory"
        ) from exc
    if cfg.vocab_size != student.vocab_size:
        raise UserError(
            f"the teacher's vocab_size is {cfg.vocab_size} (distill.teacher={path}) but the student's is "
            f"{student.vocab_size} (model.vocab_size): KL needs one vocabulary; use a teacher with the student's "
            "tokenizer (the converted checkpoint itself)"
        )
    return cfg


def check_alignment(teacher: OrthrosConfig, cfg: Any) -> None:
    """``distill.align`` compares the student's base-stream hidden states with the teacher's, layer
    by layer: another hidden size or depth cannot be compared (refused before any model is built,
    naming both shapes, not a tensor-size error at the first step)."""
    if cfg.distill.align == DistillAlign.none:
        return
    student = cfg.model
    differ = [f"{key} {getattr(teacher, key)} (the student's model.{key}={getattr(student, key)})"
              for key in ("hidden_size", "num_hidden_layers") if getattr(teacher, key) != getattr(student, key)]
    if differ:
        raise UserError(
            f"distill.align={cfg.distill.align} compares hidden states layer by layer, but the teacher "
            f"(distill.teacher={cfg.distill.teacher}) has {', '.join(differ)}; use a teacher of the student's shape "
            "(the converted checkpoint itself), or distill.align=none to distil the logits only"
        )


def check_teacher(cfg: Any) -> None:
    """Refuse a distillation run whose teacher is missing, holds no weights or has another
    vocabulary, before the run writes anything (the tokenizer is compared once the data is built)."""
    if not cfg.distill.enabled:
        return
    path = Path(cfg.distill.teacher)
    check_alignment(teacher_config(path, cfg.model), cfg)
    if not _weight_files(path):
        raise UserError(
            f"distill.teacher={path} holds a config.json but no *.safetensors weights: point it at a complete "
            "checkpoint directory (the output of orthros-convert from-hf, or a checkpoint's model/ or final/)"
        )


def planned_teacher_config(cfg: Any) -> tuple[OrthrosConfig, str]:
    """The teacher a dry run plans for (no checkpoint needs to exist yet): the checkpoint's config
    when ``distill.teacher`` holds one (another vocabulary is refused as in a run), else the dense
    twin of the student, which is what a converted checkpoint is. Returns (config, where from)."""
    path = Path(cfg.distill.teacher)
    if (path / "config.json").is_file():
        teacher = teacher_config(path, cfg.model)
        check_alignment(teacher, cfg)
        return teacher, f"{path / 'config.json'}"
    twin = replace(cfg.model, attention_type=AttentionType.dense, sink_tokens=0)
    return twin, f"the student's shape (no {path / 'config.json'} yet)"


def check_teacher_tokenizer(path: str | Path, tokenizer: Any, student_tokenizer_key: str) -> None:
    """Refuse a teacher whose tokenizer (saved beside its weights) maps text to other ids than the
    student's data: the KL would compare distributions over different tokens."""
    path = Path(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        log.warning("distill.teacher=%s carries no tokenizer: its vocabulary is assumed to be the student's",
                    path, extra=RANK_ZERO)
        return
    from orthros_train.common.tokenizer import load_tokenizer

    theirs = load_tokenizer(path)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"the teacher's tokenizer (distill.teacher={path}, {len(theirs)} tokens) differs from the student's "
            f"({student_tokenizer_key}, {len(tokenizer)} tokens): KL needs one vocabulary; tokenize the data with "
            "the teacher's tokenizer or distil from a teacher made with the student's"
        )


__all__ = [
    "check_alignment",
    "check_teacher",
    "check_teacher_tokenizer",
    "check_teacher_unchanged",
    "planned_teacher_config",
    "teacher_config",
    "teacher_identity",
]
