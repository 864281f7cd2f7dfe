"""The package stays in small pieces: no module over 400 lines, no function over 60.

A longer function is allowed only where a comment on its ``def`` line, or on the line just
above it, starts with ``# long:`` and says why.

The line cap is for modules of logic, where length means too many concepts in one place. Data
modules are exempt: the config package (one dataclass per setting group, each field with its
comment) and any module that only declares data (imports, constants, and classes that are
dataclasses, msgspec structs or enums, with no function outside them). Squeezing those under a
cap would only cut the comments that document each field.
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


#: Packages whose modules are data (settings), exempt from the module line cap.
DATA_PACKAGES = ("config",)
_DATA_BASES = {"Struct", "Enum", "IntEnum", "StrEnum", "NamedTuple", "TypedDict"}


def _is_data_module(path: Path, tree: ast.Module) -> bool:
    """Whether ``path`` only declares data: in a data package, or with top-level statements that
    are imports, assignments, docstrings and data classes (dataclasses, structs, enums)."""
    if path.relative_to(PACKAGE).parts[0] in DATA_PACKAGES:
        return True
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.Expr)):
            continue
        if isinstance(node, ast.ClassDef) and _is_data_class(node):
            continue
        return False
    return True


def _is_data_class(node: ast.ClassDef) -> bool:
    def name(e: ast.expr) -> str:
        e = e.func if isinstance(e, ast.Call) else e
        return e.attr if isinstance(e, ast.Attribute) else e.id if isinstance(e, ast.Name) else ""

    return (any(name(d) == "dataclass" for d in node.decorator_list)
            or any(name(b) in _DATA_BASES for b in node.bases))


def test_no_module_over_the_line_limit():
    too_long = {}
    for path in _sources():
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES and not _is_data_module(path, _parse(text)):
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


def test_data_modules_are_told_from_logic():
    """The exemption covers declarations only: a module with a top-level function is logic."""
    data = _parse('"""doc"""\nfrom dataclasses import dataclass\nX = 1\n\n@dataclass\nclass A:\n    x: int = 0\n')
    logic = _parse("from dataclasses import dataclass\n\n@dataclass\nclass A:\n    x: int = 0\n\ndef f():\n    pass\n")
    plain = _parse("class B:\n    pass\n")
    where = PACKAGE / "protocol.py"
    assert _is_data_module(where, data) and not _is_data_module(where, logic) and not _is_data_module(where, plain)
    assert _is_data_module(PACKAGE / "config" / "peer.py", logic)
