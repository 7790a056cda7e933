"""Functions stay short: under 60 lines in moestream/, under 45 in runtime/."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"


def _too_long() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        limit = 45 if name.startswith("runtime/") else 60
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{name}:{node.lineno} {node.name}: {lines} > {limit}")
    return found


def test_no_long_functions() -> None:
    assert not _too_long(), "functions too long:\n" + "\n".join(_too_long())
