"""The remote code an export carries: the package's own modules, copied with their imports rewritten.

``orthros-convert to-hf`` writes ``configuration_orthros.py`` and ``modeling_orthros.py`` (the thin
Hugging Face wrapper beside this file) and every package module they import, directly or not
(``model/orthros.py``, ``ops/keys.py``, ``ops/sdpa_attention.py``, ``phase/builders.py``, ...).
Nothing is written by hand twice: each shipped file is its package file with one kind of change,
its imports of the package:

* ``from orthros_train.ops.keys import KeyRule`` becomes ``from .orthros_ops_keys import KeyRule``.
  transformers' dynamic-module loader (``dynamic_module_utils.get_relative_import_files``) follows
  only relative imports of files lying beside the entry file, so the package's tree is flattened
  into one folder: ``orthros_train.<a>.<b>`` is ``orthros_<a>_<b>.py``;
* an import, inside a function, of a module the export cannot carry (the Triton kernels, which
  import ``triton`` when loaded) becomes ``raise ImportError(...)`` naming it, on the same lines.
  transformers checks that every package a shipped file imports is installed (``check_imports``),
  so such an import may not stay; the export never reaches those lines (it runs the torch path:
  ``attention_backend=sdpa``, ``fused_tokenwise=off``). A module that needs such a package when it
  is *loaded* cannot be shipped, and ``ShippingError`` says which import chain asks for it.

The line numbers of every shipped file are those of its package file, so a traceback from an
export points at the package's lines. ``tests/test_remote_code.py`` recomputes the copies and holds
the shipped folder to them.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import orthros_train

PACKAGE = "orthros_train"
PACKAGE_DIR = Path(orthros_train.__file__).resolve().parent
REMOTE_CODE_PACKAGE = f"{PACKAGE}.convert.remote_code"
# The files transformers loads by name (config.json's auto_map): the closure starts from them.
ENTRY_MODULES = (f"{REMOTE_CODE_PACKAGE}.configuration_orthros", f"{REMOTE_CODE_PACKAGE}.modeling_orthros")
# What a shipped file may import besides the standard library and its own folder: what loading
# an export with transformers installs anyway.
THIRD_PARTY = frozenset({"torch", "transformers", "safetensors"})


class ShippingError(Exception):
    """A package module the remote code needs cannot be shipped (a bug of ours, found by the tests)."""


@dataclass(frozen=True)
class _Import:
    node: ast.Import | ast.ImportFrom
    targets: tuple[str, ...]  # the modules it loads: package modules by full name, others by top level
    lazy: bool  # inside a function body: runs only when that function does


def exported_name(module: str) -> str:
    """The file a package module is shipped as: ``orthros_train.ops.keys`` -> ``orthros_ops_keys.py``;
    the wrapper's own modules keep their names (config.json's auto_map names them)."""
    if module.startswith(REMOTE_CODE_PACKAGE + "."):
        return module.rpartition(".")[2] + ".py"
    if not module.startswith(PACKAGE + "."):
        raise ShippingError(f"{module} is not a module of {PACKAGE}")
    return "orthros_" + module[len(PACKAGE) + 1 :].replace(".", "_") + ".py"


def module_path(module: str) -> Path | None:
    """The source file of a package module (None: not a module of the package)."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    parts = module.split(".")[1:]
    base = PACKAGE_DIR.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _imports(tree: ast.Module) -> list[_Import]:
    """Every import statement of a module, with whether it sits inside a function."""
    found: list[_Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.append(_Import(child, tuple(a.name for a in child.names), lazy))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    raise ShippingError(f"line {child.lineno}: relative import; the package imports absolutely")
                found.append(_Import(child, (child.module or "",), lazy))
            visit(child, inner)

    visit(tree, False)
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def _external(name: str) -> bool:
    """A non-package import that transformers' check would require to be installed, and that loading
    an export does not install (``triton``, ``numpy``, ``megatron``, ...)."""
    top = _top(name)
    return top != PACKAGE and top not in sys.stdlib_module_names and top not in THIRD_PARTY and top != "__future__"


@functools.cache
def _parsed(module: str) -> tuple[str, tuple[_Import, ...]]:
    path = module_path(module)
    if path is None:
        raise ShippingError(f"{module} is imported but is not a module of {PACKAGE}")
    source = path.read_text()
    try:
        return source, tuple(_imports(ast.parse(source, str(path))))
    except ShippingError as err:
        raise ShippingError(f"{path}: {err}") from None


@functools.cache
def unshippable(module: str) -> str | None:
    """Why ``module`` cannot be loaded in an export (the import chain that needs a package an
    export lacks), or None when it can."""
    for imp in _parsed(module)[1]:
        if imp.lazy:
            continue
        for target in imp.targets:
            if _external(target):
                return f"{module} imports {_top(target)}"
            if _top(target) == PACKAGE:
                why = unshippable(target)
                if why is not None:
                    return f"{module} imports {target}: {why}"
    return None


@functools.cache
def shipped_modules() -> tuple[str, ...]:
    """Every package module the remote code loads, the entry modules first (sorted after them)."""
    seen: set[str] = set()
    todo = list(ENTRY_MODULES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        why = unshippable(module)
        if why is not None:
            raise ShippingError(f"the exported remote code needs {module}, which cannot be shipped: {why}")
        seen.add(module)
        for imp in _parsed(module)[1]:
            for target in imp.targets:
                if _top(target) == PACKAGE and not (imp.lazy and unshippable(target)):
                    todo.append(target)
    rest = sorted(seen - set(ENTRY_MODULES))
    return (*ENTRY_MODULES, *rest)


def _replace_span(lines: list[str], node: ast.stmt, text: str) -> None:
    """Put ``text`` where ``node`` stood, keeping the line count (``text`` is one line)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    head = lines[first][: node.col_offset]
    tail = lines[last][node.end_col_offset :]
    lines[first : last + 1] = [head + text + tail] + [""] * (last - first)


def _rewritten(module: str, imp: _Import) -> str | None:
    """The text that replaces one import statement of ``module`` (None: kept as it is)."""
    node = imp.node
    internal = [t for t in imp.targets if _top(t) == PACKAGE]
    external = [t for t in imp.targets if _external(t)]
    if not internal and not external:
        return None
    if imp.lazy and (external or any(unshippable(t) for t in internal)):
        what = ", ".join(external or internal)
        return (
            f'raise ImportError("{what} is not shipped with an exported Orthros model: the export runs the '
            'model\'s torch path (attention_backend=sdpa, fused_tokenwise=off)")'
        )
    if external:
        raise ShippingError(f"{module} line {node.lineno} imports {external} when loaded: it cannot be shipped")
    if isinstance(node, ast.Import):
        raise ShippingError(
            f"{module} line {node.lineno}: `import {internal[0]}` has no relative form transformers' loader follows; "
            f"write `from {internal[0]} import ...`"
        )
    for alias in node.names:
        if module_path(f"{node.module}.{alias.name}") is not None:
            raise ShippingError(
                f"{module} line {node.lineno}: `from {node.module} import {alias.name}` imports a module, which "
                f"has no relative form transformers' loader follows; write `from {node.module}.{alias.name} import ...`"
            )
    statement = ast.get_source_segment(_parsed(module)[0], node) or ""
    relative = "." + exported_name(node.module)[: -len(".py")]
    return re.sub(r"^from\s+[\w.]+", f"from {relative}", statement, count=1)


@functools.cache
def shipped_source(module: str) -> str:
    """The text ``module`` is shipped as: its package source with the imports rewritten."""
    source, imports = _parsed(module)
    lines = source.split("\n")
    # bottom-up, so the positions of the statements above stay valid
    for imp in sorted(imports, key=lambda i: (i.node.lineno, i.node.col_offset), reverse=True):
        text = _rewritten(module, imp)
        if text is None:
            continue
        if "\n" in text:  # a multi-line `from x import (...)`: only its first line changes
            first, *_ = text.split("\n", 1)
            old_first = lines[imp.node.lineno - 1]
            lines[imp.node.lineno - 1] = old_first[: imp.node.col_offset] + first
            continue
        _replace_span(lines, imp.node, text)
    shipped = "\n".join(lines)
    ast.parse(shipped, exported_name(module))  # the rewrite kept it Python
    return shipped


def shipped_files() -> dict[str, str]:
    """``{file name: text}`` of the remote code an export carries."""
    return {exported_name(m): shipped_source(m) for m in shipped_modules()}


def write_remote_code(dst: Path) -> list[str]:
    """Write the remote code into the export folder ``dst``; returns the file names."""
    files = shipped_files()
    for name, text in files.items():
        (dst / name).write_text(text)
    return sorted(files)
