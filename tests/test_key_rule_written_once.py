"""The rule "which keys a query sees" is written once, in ``orthros_train/ops/keys.py``.

A scan of the package's source: the rule's functions are defined there and nowhere else, the
validation of the window, sinks and tail lives there, and the modules that turn a window into key
positions themselves are exactly the executors that run the rule natively (kernels and fused
paths that cannot call Python per key) — each tested against ``keys.allowed_keys``. The next
option of the rule changes ``keys.py`` and only those executors.
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orthros_train"
RULE = PACKAGE / "ops" / "keys.py"

# The rule's vocabulary: defined in keys.py only.
RULE_FUNCTIONS = {
    "KeyRule", "allowed_keys", "answer_tail_flags", "check_sink_tokens", "document_starts", "key_ranges",
    "missed_sinks", "prompt_tail_flags", "sink_queries", "visible_keys",
}
# Executors that compute a window's key positions themselves, and the tests that hold each to the
# rule's mask. Adding a module here needs a test against ``allowed_keys``/``attention_naive``.
NATIVE_EXECUTORS = {
    "ops/sdpa_attention.py": "tests/test_sdpa_attention.py, tests/test_sink_tokens.py, tests/test_global_tail.py",
    "ops/triton_attention.py": "tests/test_triton_attention.py, tests/test_global_tail.py",
    "ops/route.py": "tests/test_attention_route.py (FlashAttention's window_size=(W-1, 0))",
    "serve/paged_attention.py": "tests/test_serve_paged_kernel.py",
    "serve/model.py": "tests/serve/test_sink_serving.py",
}
# The rule's arithmetic: a window turned into the first key it reaches (``q - w + 1``), a distance
# compared with a window (``q - j < w``), a key compared with the sink bound (``j < start + S``).
WINDOW_ARITHMETIC = re.compile(
    r"-\s*(?:q_)?(?:w|win|window|windows)\b(?:\s*\[[^]]*\])?(?:\s*\.\s*\w+\s*\(\s*\))*\s*\+\s*1\b"
    r"|-\s*[\w.\[\]]+\s*<\s*(?:q_)?(?:w|win|window|windows)\b"
    r"|<\s*(?:[\w.\[\]]+\s*\+\s*)?(?:sinks|sink_tokens)\b"
)


# Python 3.12 splits f-strings into tokens of their own: their text is a string too.
FSTRING_PARTS = {getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                 if hasattr(tokenize, name)}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Each line's code tokens (strings, docstrings and comments dropped), joined by spaces."""
    lines: dict[int, list[str]] = {}
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING, tokenize.NL, tokenize.NEWLINE,
                            tokenize.INDENT, tokenize.DEDENT) or tok.type in FSTRING_PARTS:
                continue
            lines.setdefault(tok.start[0], []).append(tok.string)
    return sorted((i, " ".join(parts)) for i, parts in lines.items())


def test_the_rule_is_defined_in_keys_py_only():
    for path in _modules():
        if path == RULE:
            continue
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & RULE_FUNCTIONS, (path, defined & RULE_FUNCTIONS)


def test_window_arithmetic_lives_in_the_rule_and_the_native_executors():
    found: dict[str, list[str]] = {}
    for path in _modules():
        rel = str(path.relative_to(PACKAGE))
        hits = [f"{i}: {code.strip()}" for i, code in _code_lines(path) if WINDOW_ARITHMETIC.search(code)]
        if hits and path != RULE:
            found[rel] = hits
    outside = {rel: hits for rel, hits in found.items() if rel not in NATIVE_EXECUTORS}
    assert not outside, f"the key rule restated outside ops/keys.py (call keys.py instead): {outside}"
    # the scan sees the rule where it is written (so it would see it elsewhere too)
    assert any(WINDOW_ARITHMETIC.search(code) for _, code in _code_lines(RULE))
    assert set(found) <= set(NATIVE_EXECUTORS) and found, found


def test_the_validation_of_window_sinks_and_tail_is_keys_py():
    """No other module compares sink_tokens with the window or checks the tail's sign itself."""
    compare = re.compile(r"sink\w*\s*>=?\s*\w*window|window\w*\s*<=?\s*\w*sink|base_global_tail\s*<\s*0")
    for path in _modules():
        if path == RULE:
            continue
        hits = [code for _, code in _code_lines(path) if compare.search(code)]
        assert not hits, (path, hits)


def test_the_rule_module_states_every_part():
    text = RULE.read_text()
    for part in ("window", "sink tokens", "global tail", "allowed_keys"):
        assert part in text
