"""A refused serving configuration reaches the top of ``vllm serve`` wrapped in pydantic's
ValidationError; the plugin's hook prints its message alone. Runs without vLLM (pydantic is in the
main environment through DeepSpeed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fixtures import REPO

from orthros_train.serve.refusal import OrthrosServeError, served_refusal

pydantic = pytest.importorskip("pydantic")

REFUSAL = "base_window in config.json must be a positive integer (the base stream's window W), got 0: re-export"


def validation_error() -> BaseException:
    """What vLLM's VllmConfig (a pydantic dataclass whose __post_init__ runs the config hook) raises."""

    @pydantic.dataclasses.dataclass
    class Config:
        window: int

        def __post_init__(self) -> None:
            raise OrthrosServeError(REFUSAL)

    try:
        Config(window=0)
    except Exception as exc:  # noqa: BLE001 - the test wants whatever pydantic raises
        return exc
    raise AssertionError("pydantic did not raise")


def test_the_refusal_is_found_inside_pydantic_and_exception_chains() -> None:
    raised = validation_error()
    # pydantic wraps a ValueError raised in validation; a refusal (a UserError, not a ValueError)
    # passes through as itself. Either way the hook finds it.
    assert type(raised).__name__ in ("ValidationError", "OrthrosServeError")
    assert str(served_refusal(raised)) == REFUSAL
    try:
        try:
            raise OrthrosServeError("inner")
        except OrthrosServeError as inner:
            raise RuntimeError("engine core failed") from inner
    except RuntimeError as outer:
        assert str(served_refusal(outer)) == "inner"
    assert served_refusal(ValueError("a bug in torch")) is None and served_refusal(None) is None


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from orthros_train.serve.refusal import one_line_refusals
import test_serve_refusal as t
one_line_refusals()
one_line_refusals()  # installed once however often the plugin runs
raise t.validation_error() if sys.argv[1] == "refused" else ValueError("a bug, not the user's")
"""


@pytest.mark.parametrize("case", ["refused", "bug"])
def test_vllm_serve_prints_a_refusal_as_one_line_and_a_bug_with_its_traceback(case: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(REPO / "tests")), case],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1
    if case == "refused":
        assert done.stderr.strip().splitlines() == [f"-c: {REFUSAL}"], done.stderr
    else:
        assert "Traceback" in done.stderr and "a bug, not the user's" in done.stderr
