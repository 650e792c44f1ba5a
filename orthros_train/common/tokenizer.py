"""The one tokenizer loader: a folder a tokenizer was saved to (a checkpoint's, a converted
model's, a data build's) or a ``tokenizer.json`` file.

``AutoTokenizer`` also reads the folder's ``config.json``, and transformers' RoPE checks refuse an
Orthros config with YaRN scaling; the tokenizer's own files are all a fast tokenizer needs, so the
loader falls back to ``PreTrainedTokenizerFast`` on them (keeping ``tokenizer_config.json``'s
special tokens when it can). Every refusal is a one-line ``TokenizerError`` naming the path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from orthros_train.errors import UserError

# Any one of these in a folder makes it a tokenizer folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class TokenizerError(UserError):
    """A tokenizer path that does not exist, holds no tokenizer or cannot be loaded."""


def has_tokenizer(path: str | Path) -> bool:
    """Whether ``path`` is a ``tokenizer.json`` file or a folder holding tokenizer files."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_file():
        return path.suffix == ".json"
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path, required: bool = True, pad_with_eos: bool = False) -> Any:
    """A ``transformers`` tokenizer from ``path`` (a folder or a ``tokenizer.json`` file).

    ``required=False``: None when ``path`` holds no tokenizer (missing, or a folder without
    tokenizer files) instead of an error. ``pad_with_eos``: a tokenizer without a pad token pads
    with its EOS token (batched generation and scoring need one; data builds leave the tokenizer
    as saved, since its special tokens are part of the data cache's key)."""
    text = os.path.expanduser(str(path))
    if not text.strip():
        if not required:
            return None
        raise TokenizerError("the tokenizer path is empty: give a local directory or a tokenizer.json file")
    folder = Path(text)
    if folder.is_file() and text.endswith(".json"):
        from transformers import PreTrainedTokenizerFast

        try:
            return _padded(PreTrainedTokenizerFast(tokenizer_file=text), pad_with_eos)
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            reason = " ".join(str(e).split())
            raise TokenizerError(
                f"{text}: not a tokenizer.json a fast tokenizer can read ({type(e).__name__}: {reason}); point at "
                "the tokenizer.json (or the folder) a tokenizer was saved to"
            ) from e
    if folder.is_file():
        if not required:
            return None
        raise TokenizerError(
            f"{text} is a file but not a tokenizer.json: give the folder a tokenizer was saved to "
            "(tokenizer.save_pretrained) or its tokenizer.json file"
        )
    if not folder.exists():
        if not required:
            return None
        raise TokenizerError(f"{text}: no such tokenizer (give a local directory or a tokenizer.json file)")
    if not has_tokenizer(folder):
        if not required:
            return None
        # transformers would answer with advice to install sentencepiece or tiktoken
        raise TokenizerError(
            f"{text}: the folder holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): point at the "
            "folder a tokenizer was saved to (tokenizer.save_pretrained), e.g. a checkpoint's model/ folder, or "
            "convert the checkpoint with its tokenizer"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        try:
            # never the folder's own code (an export's auto_map), and no "run custom code?" prompt
            tok = AutoTokenizer.from_pretrained(text, trust_remote_code=False)
        except (ValueError, OSError, KeyError, AttributeError):
            # AttributeError: transformers' RoPE checks on an Orthros config.json with YaRN scaling.
            if not (folder / "tokenizer.json").is_file():
                raise
            try:
                tok = PreTrainedTokenizerFast.from_pretrained(  # keeps tokenizer_config's special tokens
                    text, trust_remote_code=False
                )
            except (ValueError, OSError, KeyError):
                tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    except Exception as e:  # transformers raises many types for a bad folder; name it
        broken = _broken_json_file(folder)
        if broken:
            raise TokenizerError(
                f"{broken[0]}: {broken[1]}, so the tokenizer in {text} cannot load; the file is truncated or "
                "corrupt: copy it again from where the tokenizer came from, or save the tokenizer again "
                "(tokenizer.save_pretrained)"
            ) from e
        reason = " ".join(str(e).split())
        raise TokenizerError(
            f"{text}: cannot load a tokenizer ({type(e).__name__}: {reason}); point at a folder a tokenizer was "
            "saved to (tokenizer.save_pretrained), or save it there again"
        ) from e
    return _padded(tok, pad_with_eos)


def _broken_json_file(folder: Path) -> tuple[Path, str] | None:
    """The first of a tokenizer folder's JSON files that does not parse, with why: the file to
    name when a load fails (the tokenizers library says "EOF while parsing" without a file name)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            return path, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            return path, f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"  # json's own wording
        except OSError as exc:
            return path, f"cannot be read ({exc.strerror or exc})"
    return None


def _padded(tok: Any, pad_with_eos: bool) -> Any:
    if pad_with_eos and tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def check_loadable(*folders: str | Path | None) -> None:
    """Load the tokenizer of every folder that holds one, so a truncated or corrupt tokenizer is a
    ``TokenizerError`` naming its file before a command copies it onward (an export that would
    fail only when someone loads it)."""
    for folder in folders:
        if folder is not None and has_tokenizer(folder):
            load_tokenizer(folder)
