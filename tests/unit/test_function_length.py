"""No function of ``lightning_moe`` is longer than 60 lines, counted from its ``def`` line to its
last line (docstring included, decorators not). Methods and nested functions count on their own.
The code is read with ``ast``; nothing of the package is imported.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_moe"
MAX_LINES = 60


def long_functions(source: str, where: str, max_lines: int = MAX_LINES) -> list[str]:
    """``where:line name (N lines)`` for every function of ``source`` longer than ``max_lines``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > max_lines:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def _function_of(num_lines: int) -> str:
    body = "\n".join(f"    x{i} = {i}" for i in range(num_lines - 2))
    return f"class Holder:\n    @staticmethod\n    def f():\n        '''doc'''\n{textwrap.indent(body, '    ')}\n"


def test_the_counter_counts_from_def_to_last_line_docstring_included() -> None:
    assert long_functions(_function_of(MAX_LINES), "m.py") == []
    assert long_functions(_function_of(MAX_LINES + 1), "m.py") == [f"m.py:3 f ({MAX_LINES + 1} lines)"]


def test_no_function_of_the_package_is_longer_than_60_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no modules under {PACKAGE}"
    offenders = []
    for path in modules:
        offenders += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not offenders, f"functions longer than {MAX_LINES} lines (split them):\n" + "\n".join(offenders)
