"""The extension builds against the MLX the runtime runs with."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mlx(requirements: list[str]) -> str:
    """The Linux MLX requirement's version range."""
    (spec,) = [r for r in requirements if r.startswith("mlx[cpu]")]
    return spec.split(";")[0].removeprefix("mlx[cpu]").strip()


def test_build_and_runtime_take_the_same_mlx() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = _mlx(project["project"]["dependencies"])
    assert _mlx(project["build-system"]["requires"]) == runtime
    makefile = (ROOT / "Makefile").read_text()
    assert re.findall(r'"mlx\[cpu\]([^"]*)"', makefile) == [runtime]
