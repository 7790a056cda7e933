from __future__ import annotations

import logging
from pathlib import Path

import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import BITS, PROMPT, copy_of, logits_stepwise

from moestream.converter import convert
from moestream.formats import Recipe


@pytest.fixture(autouse=True)
def _root_logger():
    """Give back the root logger as it was (the CLIs configure it)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def converted(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "model"
    convert(str(hf_dir), out, bits=BITS, progress=False)
    return out


@pytest.fixture(scope="session")
def recipe() -> Recipe:
    return Recipe.parse(BITS)


@pytest.fixture(scope="session")
def reference(hf_dir: Path, recipe: Recipe):
    from moestream.reference import resident_model

    return resident_model(hf_dir, recipe)


@pytest.fixture(scope="session")
def resident_logits(reference):
    """logits_stepwise of the resident model on PROMPT by step count, computed
    once for every test and engine (greedy: the same logits each time)."""
    done: dict[int, list] = {}

    def of(steps: int) -> list:
        if steps not in done:
            done[steps] = logits_stepwise(reference, PROMPT, steps)
        return done[steps]

    return of


@pytest.fixture
def copy(converted: Path, tmp_path: Path) -> Path:
    """A private copy of the converted model, free to damage."""
    return copy_of(converted, tmp_path)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--screenshot",
        default=None,
        help="Where the page's browser test saves its screenshot (make test-ui: "
        "build/serve-page.png); default: a temporary file.",
    )


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml lists `slow`; `device` is registered here
    config.addinivalue_line(
        "markers", "device: needs an accelerator (a GPU); skipped without one"
    )
    config.addinivalue_line(
        "markers", "ui: in a real browser (make test-ui); skipped without one"
    )
