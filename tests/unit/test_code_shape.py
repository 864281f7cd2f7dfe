"""The package stays in small pieces: no module over 400 lines, no function over 60.

A longer function is allowed only where a comment on its ``def`` line, or on the line just
above it, starts with ``# long:`` and says why.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import p2pserve

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
PACKAGE = Path(p2pserve.__file__).parent


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "data" not in p.relative_to(PACKAGE).parts)


def _excused(lines: list[str], node: ast.AST) -> bool:
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    around = lines[max(first - 2, 0): node.lineno]
    return any("# long:" in line for line in around)


def _parse(text: str) -> ast.AST:
    """``ast.parse``, shielded from CPython 3.11's shared AST recursion counter: a collection that
    runs another thread's Python code (finalizers of tasks that earlier tests left) in the middle
    of a parse raised ``SystemError: AST constructor recursion depth mismatch`` in a CI dry run.
    Collections are held off during the parse, and a parse that still trips is tried again."""
    for attempt in range(3):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return ast.parse(text)
        except SystemError:
            if attempt == 2:
                raise
        finally:
            if enabled:
                gc.enable()
    raise AssertionError("unreachable")


def test_no_module_over_the_line_limit():
    too_long = {}
    for path in _sources():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            too_long[str(path.relative_to(PACKAGE))] = n
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_no_function_over_the_line_limit_without_a_reason():
    too_long = {}
    for path in _sources():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(_parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and not _excused(lines, node):
                    too_long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines with no '# long:' reason: {too_long}"
