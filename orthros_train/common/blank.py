"""Refusals of empty or whitespace-only paths and lists.

An empty string is a valid path to nothing in particular: ``Path("")`` is the current directory,
``model.init_from=''`` reads as "no checkpoint" and trains random weights, ``data.paths=['']``
names no dataset. None of them is what a user typing the key meant, so each is refused naming
the key and the two ways out: a real value, or ``null`` to leave the key unset.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orthros_train.errors import UserError


def is_blank(value: Any) -> bool:
    """Whether ``value`` is a string holding nothing but whitespace (the empty string included)."""
    return isinstance(value, str) and not value.strip()


def refuse_blank(key: str, value: Any, what: str = "a path", unset: str = "null to leave it unset") -> None:
    """``key=''`` (or spaces) refused naming the key: give ``what``, or ``unset``."""
    if is_blank(value):
        raise UserError(f"{key}={value!r} is empty: give {what}, or {key}={unset}")


def refuse_blank_items(key: str, values: Sequence[Any] | None, what: str = "a path") -> None:
    """A list whose entry is empty or whitespace (``data.paths=['']``) refused naming the entry."""
    for i, value in enumerate(values or ()):
        if is_blank(value):
            raise UserError(f"{key}[{i}]={value!r} is empty: every entry must be {what}; drop it from {key}")


def path_arg(text: str) -> Path:
    """argparse ``type=`` of a path argument: an empty or whitespace one is a usage error (argparse
    names the flag), where ``Path("")`` would silently mean the current directory."""
    if is_blank(text):
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a path ('' would mean the current directory)")
    return Path(text)


def text_arg(text: str) -> str:
    """``path_arg`` for arguments kept as text (an input that may also be a hub dataset name)."""
    return str(path_arg(text))
