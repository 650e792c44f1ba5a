"""The study reports' table helpers (orthros_train/study/tables.py): cells, columns, buckets."""

from __future__ import annotations

from orthros_train.study.tables import LEFT, MISSING, Column, bucket_table, markdown_table, num, pct, spread


def test_cells_format_numbers_percentages_and_spreads() -> None:
    assert num(1.23456) == "1.235" and num(2.5, ".0f") == "2" and num(None) == MISSING
    assert pct(0.125) == "12.5%" and pct(None) == MISSING
    assert spread(1.5, 0.25) == "1.500 ± 0.250" and spread(1.5) == "1.500"
    assert spread(0.5, 0.05, pct=True) == "50.0 ± 5.0%" and spread(None, 0.1) == MISSING


def test_markdown_table_from_columns_and_rows() -> None:
    rows = [{"name": "a", "loss": 1.0}, {"name": "b", "loss": None}]
    lines = markdown_table([Column("model", lambda r: r["name"], LEFT), Column("loss", lambda r: num(r["loss"]))],
                           rows)
    assert lines == ["| model | loss |", "| --- | ---: |", "| a | 1.000 |", f"| b | {MISSING} |"]


def test_bucket_table_one_row_a_bucket_one_column_a_model() -> None:
    buckets = [{"label": "0-8", "beyond_window": False, "queries": 4, "accuracy": 1.0},
               {"label": "8-16", "beyond_window": True, "queries": 3, "accuracy": None}]
    other = [dict(b, accuracy=0.5) for b in buckets]
    lines = bucket_table("distance", {"x": buckets, "y": other}, lambda b: pct(b["accuracy"]), "queries", "n")
    assert lines == ["| distance | x | y | n |", "| --- | ---: | ---: | ---: |", "| 0-8 | 100.0% | 50.0% | 4 |",
                     f"| 8-16 (beyond W) | {MISSING} | 50.0% | 3 |"]
