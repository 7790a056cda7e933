"""Functions stay short: under 60 lines in moestream/, under 45 in runtime/."""

from __future__ import annotations

import ast
import re
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


# The plan (runtime/backend.py) asks which device this is and which backend
# runs; the native side asks what the extension was built with. Everything
# else reads the plan (ExecutionPlan) or calls backend.on_gpu().
DEVICE_OR_MODE = re.compile(
    r"default_device\(|\bmx\.(cpu|gpu)\b|built_with_cuda\(|cuda_available\(|"
    r"runs_here\(|engine_used|\.prefetches\b|\.rows_whole\b"
)
ASKS_ALLOWED = {"runtime/backend.py", "runtime/native.py"}


def _asks() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in ASKS_ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DEVICE_OR_MODE.search(code) and not code.lstrip().startswith(
                ('f"', '"')
            ):
                found.append(f"{name}:{n}: {line.strip()}")
    return found


def test_only_the_plan_asks_which_device_or_backend() -> None:
    assert not _asks(), "device or mode checks outside the plan:\n" + "\n".join(_asks())


def test_the_user_sees_few_settings() -> None:
    import click
    from click.testing import CliRunner

    from moestream.cli.run import main as run_main
    from moestream.runtime.config import USER_FIELDS

    assert len(USER_FIELDS) <= 8, USER_FIELDS
    options = [
        p for p in run_main.params if isinstance(p, click.Option) and not p.hidden
    ]
    assert len(options) + 1 <= 25, [p.name for p in options]  # + --help
    shown = CliRunner().invoke(run_main, ["--help"]).output
    assert sum(line.startswith("  -") for line in shown.splitlines()) <= 25
