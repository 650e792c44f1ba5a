"""The one ``key=value`` checker against typed dataclasses (``orthros_train.common.overrides``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from orthros_train.common.overrides import NONFINITE_OK, check_types, parse_key_values
from orthros_train.errors import UserError


@dataclass
class Inner:
    enabled: bool = False
    mode: str = "online"


@dataclass
class Section:
    steps: int = 3
    lr: float = 1e-3
    window: int | None = None
    flag: bool = True
    spike: float = field(default=math.inf, metadata=NONFINITE_OK)
    schedule: list[int] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)


def test_values_are_checked_and_converted():
    checked = check_types(Section, {"steps": 5, "lr": 1, "window": None, "inner": {"enabled": True}}, "s")
    assert checked["steps"] == 5 and checked["lr"] == 1.0 and isinstance(checked["lr"], float)
    assert checked["inner"] == {"enabled": True, "mode": "online"} and checked["spike"] == math.inf


@pytest.mark.parametrize("values, message", [
    ({"steps": 5.5}, "s.steps=5.5: expected int ("),
    ({"steps": "five"}, "s.steps='five': expected int ("),
    ({"window": "x"}, "s.window='x': expected int or null ("),
    ({"flag": 1}, "s.flag=1: expected a boolean, true or false"),
    ({"inner": {"enabled": "yes"}}, "s.inner.enabled='yes': expected a boolean, true or false"),
    ({"schedule": [1, "a"]}, "s.schedule[1]='a': expected list[int] ("),
    ({"lr": math.nan}, "s.lr=nan: must be a finite number (not NaN or inf)"),
    ({"stepz": 1}, "unknown key s.stepz in the recipe; valid keys of s: ['flag', 'inner', 'lr',"),
])  # fmt: skip
def test_refusals_name_the_key_the_value_and_the_type(values, message):
    with pytest.raises(UserError) as err:
        check_types(Section, values, "s")
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_bare_keys_and_where_they_came_from():
    with pytest.raises(UserError, match=r"^unknown key stepz in --override; valid keys: \["):
        check_types(Section, {"stepz": 1}, where="in --override")
    with pytest.raises(UserError, match=r"^steps='x': expected int"):
        check_types(Section, {"steps": "x"})


def test_key_values_parse_as_json_when_they_can():
    assert parse_key_values(["a=1", "b=x", "c=null", "d=[1, 2]", " e =true", "f=a=b"]) == {
        "a": 1, "b": "x", "c": None, "d": [1, 2], "e": True, "f": "a=b",
    }  # fmt: skip
    with pytest.raises(UserError, match="--set 'a' must look like key=value"):
        parse_key_values(["a"], "--set")


def test_both_users_share_it():
    from orthros_train.eval.common import parse_overrides
    from orthros_train.train.config import OptimConfig, typed_section

    assert parse_overrides(["sliding_window=256", "attention_backend=reference"]) == {
        "sliding_window": 256, "attention_backend": "reference",
    }  # fmt: skip
    with pytest.raises(UserError, match=r"^sliding_window='abc': expected int"):
        parse_overrides(["sliding_window=abc"])
    with pytest.raises(UserError, match=r"^optim.lr='fast': expected float"):
        typed_section(OptimConfig, {"lr": "fast"}, "optim")
