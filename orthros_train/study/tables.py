"""Markdown tables and cells shared by the study reports (``report.py``, ``conversion_report.py``).

A table is a list of ``Column``s (title, alignment, how a row becomes the cell's text) applied to
rows; a cell is a number in a format, a percentage, or ``mean ± spread``. A value that was not
measured (``None``) is ``MISSING`` in every cell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MISSING = "-"  # the cell of a value that was not measured, in every table and sentence of the reports
LEFT, RIGHT = "---", "---:"  # markdown alignment rows: text columns left, numbers right


def num(x: float | None, spec: str = ".3f") -> str:
    """``x`` in the format ``spec``."""
    return MISSING if x is None else format(x, spec)


def spread(mean: float | None, std: float | None = None, pct: bool = False) -> str:
    """``mean ± std`` (the mean alone where ``std`` is None); accuracies (``pct``) in percent points, one % last."""
    if mean is None:
        return MISSING
    scale, unit, spec = (100, "%", ".1f") if pct else (1, "", ".3f")
    text = f"{scale * mean:{spec}}"
    if std is not None:
        text += f" ± {scale * std:{spec}}"
    return text + unit


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal."""
    return spread(x, pct=True)


@dataclass(frozen=True)
class Column:
    """One column: its title, its alignment row, and the cell of a row."""

    title: str
    cell: Callable[[Any], str]
    align: str = RIGHT


def markdown_table(columns: Sequence[Column], rows: Iterable[Any]) -> list[str]:
    """The header, the alignment row and one line per row."""
    lines = ["| " + " | ".join(c.title for c in columns) + " |", "| " + " | ".join(c.align for c in columns) + " |"]
    return lines + ["| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows]


def bucket_table(first: str, columns: Mapping[str, list[dict[str, Any]]], cell: Callable[[dict[str, Any]], str],
                 count: str, count_label: str) -> list[str]:
    """Distance or position buckets: one row a bucket, one column a model (``columns``: name -> its buckets,
    ``cell`` formats a bucket), the bucket's ``count`` last."""
    models = list(columns.items())
    label = Column(first, lambda j: _bucket_label(models[0][1][j]), LEFT)
    per_model = [Column(name, lambda j, b=buckets: cell(b[j])) for name, buckets in models]
    last = Column(count_label, lambda j: str(models[0][1][j][count]))
    return markdown_table([label, *per_model, last], range(len(models[0][1])))


def _bucket_label(b: dict[str, Any]) -> str:
    return f"{b['label']}{' (beyond W)' if b['beyond_window'] else ''}"


def block(lines: Sequence[str]) -> str:
    """Report lines as one block of text (a section of the report is such a block, joined by newlines)."""
    return "\n".join(lines)
