"""No function longer than the limit: 80 lines in the library, 60 in the study, the benchmarks, the
data tools and the launchers (scripts whose long functions hide what they do).

A function's length runs from its ``def`` line to its last line inclusive (``end_lineno - lineno
+ 1``), docstring and comments included; nested functions count in their parent too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("orthros_train", "bench", "data_tools", "launch")
LIBRARY_LIMIT = 80
WORKSHOP_LIMIT = 60
WORKSHOP = ("orthros_train/study/", "bench/", "data_tools/", "launch/")

def limit_of(path: str) -> int:
    return WORKSHOP_LIMIT if path.startswith(WORKSHOP) else LIBRARY_LIMIT


def long_functions() -> list[tuple[str, int, str, int, int]]:
    """``(path, line, name, lines, limit)`` of every function over its limit."""
    found = []
    for root in ROOTS:
        for file in sorted((REPO / root).rglob("*.py")):
            path = file.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(file.read_text(), filename=path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit_of(path):
                        found.append((path, node.lineno, node.name, lines, limit_of(path)))
    return found


def test_no_function_over_its_length_limit():
    too_long = long_functions()
    assert not too_long, "functions over the length limit (split them into named steps):\n" + "\n".join(
        f"{path}:{line} {name} {lines} lines (limit {limit})" for path, line, name, lines, limit in too_long
    )

