"""The one checker of ``key=value`` settings against a typed dataclass.

A recipe section (``optim``, ``trainer.wandb``, ...) and an ``--override`` of a model's config go
through ``check_types``: an unknown key or a value of the wrong type (an int given a float or a
word, a bool given anything but true/false, a NaN where a finite number is due) fails with one
line naming the full key, the value and the expected type, before the dataclass's own checks
(``__post_init__``) run. The type check is OmegaConf's structured-config validation (the one Hydra
applies to ConfigStore schemas), not a type checker of our own.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from orthros_train.errors import UserError

# Field metadata of a float that may be NaN or infinite: ``field(default=..., metadata=NONFINITE_OK)``.
NONFINITE_OK = {"nonfinite_ok": True}


def _label(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def hint_name(hint: Any) -> str:
    """``int``, ``float or null``, ``list[list[int]]``: how an error names the expected type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) < len(typing.get_args(hint)):  # Optional[...]
        return " or ".join(hint_name(a) for a in args) + " or null"
    origin = typing.get_origin(hint)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(hint_name(a) for a in typing.get_args(hint))}]"
    return "any" if hint is Any else getattr(hint, "__name__", str(hint))


def expected_type(cls: type, key: str) -> str:
    """The declared type of ``key`` (``wandb.mode``, ``seq_len_schedule[0]``) in dataclass ``cls``."""
    hint: Any = cls
    for part in key.split("."):
        name = part.split("[")[0]
        if not is_dataclass(hint):
            break
        hint = typing.get_type_hints(hint).get(name, Any)
    return hint_name(hint)


def lookup(values: Any, key: str) -> Any:
    """The value at ``wandb.mode`` / ``seq_len_schedule[0]`` of a plain dict."""
    for part in key.replace("[", ".").replace("]", "").split("."):
        try:
            values = values[int(part)] if isinstance(values, list) else values[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return "?"
    return values


def refuse_non_booleans(cls: type, values: dict[str, Any], name: str) -> None:
    """OmegaConf takes yes/no/on/off/1/0 for a bool; a setting's booleans are true or false only."""
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        hint = hints.get(key)
        if is_dataclass(hint) and isinstance(value, dict):
            refuse_non_booleans(hint, value, _label(name, key))
        elif bool in (hint, *typing.get_args(hint)) and not isinstance(value, bool):
            if value is None and hint is not bool:  # Optional[bool] takes null
                continue
            raise UserError(f"{_label(name, key)}={value!r}: expected a boolean, true or false")


INT64_MAX = 2**63 - 1


def _non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """The first NaN/inf number inside ``value`` (a number, list or dict), or an integer no 64-bit
    integer holds (what torch and every size takes): its full key and value."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        return key, value
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, item in items:
        found = _non_finite(item, f"{key}{sub}" if str(sub).startswith("[") else f"{key}.{sub}")
        if found:
            return found
    return None


def refuse_non_finite(cls: type, values: dict[str, Any], name: str) -> None:
    """Every number is finite unless its field says otherwise (NONFINITE_OK): NaN slips through
    every range check (``nan > 0`` is false) and inf trains a NaN model. Nested dataclasses
    (``trainer.wandb``) and lists/dicts of numbers are walked too."""
    meta = {f.name: f.metadata for f in fields(cls)} if is_dataclass(cls) else {}
    hints = typing.get_type_hints(cls) if is_dataclass(cls) else {}
    for key, value in values.items():
        if meta.get(key, {}).get("nonfinite_ok"):
            continue
        if is_dataclass(hints.get(key)) and isinstance(value, dict):
            refuse_non_finite(hints[key], value, _label(name, key))
            continue
        found = _non_finite(value, _label(name, key))
        if found and isinstance(found[1], int):
            raise UserError(f"{found[0]}={found[1]}: too large (at most {INT64_MAX})")
        if found:
            raise UserError(f"{found[0]}={found[1]}: must be a finite number (not NaN or inf)")


def check_types(cls: type, values: dict[str, Any] | None, name: str = "", where: str = "in the recipe") -> dict:
    """``values`` checked against dataclass ``cls``: the dataclass's defaults merged with them as a
    plain dict (values converted to the declared types), or a one-line ``UserError``.

    ``name`` prefixes every key in a message (``optim`` -> ``optim.lr``; empty: the bare key);
    ``where`` says where an unknown key was given (``in the recipe``, ``in --override``)."""
    # Imported here: the serving environment installs this package without its dependencies (vLLM
    # pins its own) and imports eval's modules, which import this one; only a check needs OmegaConf.
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    values = dict(values or {})
    refuse_non_booleans(cls, values, name)
    try:
        checked = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(cls), values))
    except ConfigKeyError as exc:
        known = sorted(f.name for f in fields(cls))
        of = f" of {name}" if name else ""
        raise UserError(f"unknown key {_label(name, exc.full_key)} {where}; valid keys{of}: {known}") from exc
    except OmegaConfBaseException as exc:
        key = exc.full_key or _failing_key(cls, values)
        raise UserError(
            f"{_label(name, key)}={lookup(values, key)!r}: expected {expected_type(cls, key)} "
            f"({exc.msg.splitlines()[0]})"
        ) from exc
    assert isinstance(checked, dict)
    refuse_non_finite(cls, checked, name)
    return checked


def _failing_key(cls: type, values: dict[str, Any]) -> str:
    """The key whose value OmegaConf refused when its error names none (a list given for a dict
    field fails the whole merge): the first key that fails alone."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(cls)
    for key, value in values.items():
        try:
            OmegaConf.merge(base, {key: value})
        except OmegaConfBaseException:
            return str(key)
    return ""


def parse_key_values(items: list[str] | None, flag: str = "--override") -> dict[str, Any]:
    """``["sliding_window=256", "attention_backend=reference"]`` -> ``{key: value}``, each value
    parsed as JSON when it parses (``256``, ``true``, ``null``, ``[1, 2]``) and kept as text when not."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"{flag} {item!r} must look like key=value")
        key, value = item.split("=", 1)
        if not key.strip():
            raise UserError(f"{flag} {item!r} must look like key=value (the key is empty)")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out
