"""The layers of the code base import only downwards, and no modules import each other in a cycle.

Every ``import`` in ``orthros_train/`` and ``data_tools/`` counts, also the lazy ones inside
functions: a lazy import still makes the lower layer depend on the upper one. The table is the
one docs/architecture.md explains.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fixtures import REPO

# layer -> the layers it may import (besides itself); ops and phase are the bottom. "package" is
# orthros_train/__init__.py and the modules beside it (process-wide setup such as the warnings
# filter) and "common" is orthros_train/common/, the floor of files, locks and formats: every layer
# may import both (FLOOR); package imports no layer, common only package.
FLOOR = {"package", "common"}
ALLOWED: dict[str, set[str]] = {
    "package": set(),
    "common": {"package"},
    "ops": set(),
    "phase": {"ops"},  # the key rule (ops/keys.py) decides which base tokens are global
    "model": {"ops", "phase"},
    "parallel": {"model", "ops", "phase"},
    "data": {"phase"},
    "infer": {"model", "ops", "phase"},
    "convert": {"model", "ops", "phase"},
    "eval": {"model", "ops", "phase", "infer", "data", "convert"},
    "train": {"model", "ops", "phase", "parallel", "data", "infer"},
    "study": {"model", "ops", "phase", "parallel", "data", "infer", "convert", "eval", "train"},
    "data_tools": {"data", "phase", "infer"},
    "serve": {"model", "ops", "phase", "convert"},
}


def modules() -> dict[str, Path]:
    found = {}
    for top in ("orthros_train", "data_tools"):
        for path in (REPO / top).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts ``pkg.mod`` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{alias.name}" for alias in node.names}
    return {m for m in out if m in known and m != name}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "data_tools":
        return "data_tools"
    if len(parts) > 1 and (REPO / "orthros_train" / parts[1]).is_dir():
        return parts[1]
    return "package"


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for source, targets in sorted(graph.items()):
        a = layer(source)
        for target in sorted(targets):
            b = layer(target)
            if a == b or (b in FLOOR and not (a, b) == ("package", "common")):
                continue
            if a not in ALLOWED:
                problems.append(f"{source}: layer {a!r} is not in the layer table of tests/test_layering.py")
            elif b not in ALLOWED[a]:
                problems.append(f"{source} imports {target}: {a} may import only {sorted(ALLOWED[a]) or 'nothing'}")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_layer_is_in_the_table():
    layers = {layer(m) for m in modules()}
    assert layers <= set(ALLOWED), sorted(layers - set(ALLOWED))


def test_no_upward_imports():
    assert layering_violations(import_graph()) == []


def test_no_import_cycles():
    assert import_cycles(import_graph()) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"orthros_train.data.sources": {"data_tools.pretokenize"}}, "data may import only ['phase']"),
        ({"orthros_train.parallel.engine": {"orthros_train.train.config"}}, "parallel may import only"),
        ({"orthros_train.model.orthros": {"orthros_train.parallel.model"}}, "model may import only"),
        ({"orthros_train.third_party_warnings": {"orthros_train.train.cli"}}, "package may import only nothing"),
        ({"orthros_train.third_party_warnings": {"orthros_train.common.files"}}, "package may import only nothing"),
        ({"orthros_train.common.lock": {"orthros_train.train.run_dir"}}, "common may import only ['package']"),
    ],
)
def test_the_check_catches_an_upward_import(graph, expected):
    problems = layering_violations(graph)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_check_catches_a_cycle(tmp_path):
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]
    # ...and the parser sees a lazy import inside a function.
    (tmp_path / "m.py").write_text("def f():\n    from orthros_train.train import config\n")
    known = {"orthros_train.train.config": tmp_path, "orthros_train.train": tmp_path}
    assert imported("orthros_train.ops.m", tmp_path / "m.py", known) == set(known)
