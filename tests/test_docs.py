"""The README and docs/ name only flags the commands have, and links that resolve."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A command named in a code line or span: the flags after it there are its own.
COMMAND = re.compile(
    r"(?<![\w./-])(run-moe|convert-moe|moestream(?: bench)? [a-z][a-z-]*|moestream)"
    r"(?![\w./'-])"
)
# Flags of other programs the docs quote, checked against this list instead:
# pip, mlx.launch, Docker, mlx-lm's own commands, the scripts under scripts/.
FOREIGN = {
    "force-reinstall", "no-deps", "no-build-isolation",  # pip
    "dist", "durations",  # pytest
    "hosts", "backend", "add-host",  # mlx.launch, docker
    "model", "q-bits", "hf-path", "mlx-path",  # mlx-lm's commands
    "n-cpu-moe", "repack", "poll",  # llama.cpp's llama-bench
    "budget", "cold", "steps", "warmup", "rounds", "recipes", "layout", "layers",
    "bench", "variants",  # scripts/mode_ab.py, profile_step.py, synthetic_hf.py, ...
    "minutes", "out", "no-save-model", "max-gpu-gb",  # scripts/train_router.py
    "case", "cgroup", "limit",  # scripts/cgroup_ab.py
    "prompts", "before", "tier", "groups",  # scripts/gpu_prefill.py, gpu_groups.py
    "from-memory", "blocked",  # scripts/kernel_ops.py
    "pct",  # scripts/kernel_ab.py
    "in-order", "cases",  # scripts/budget_prefill.py
}  # fmt: skip


def _entry_points() -> dict[str, click.Command]:
    from moestream.cli import main as moestream_main
    from moestream.cli.convert import main as convert_main
    from moestream.cli.run import main as run_main

    return {
        "moestream": moestream_main,
        "run-moe": run_main,
        "convert-moe": convert_main,
    }


@cache
def help_flags(command: str) -> frozenset[str]:
    """The flags `command --help` prints (run in-process)."""
    program, *path = command.split()
    entry = _entry_points()[program]
    if path and isinstance(entry, click.Group):
        sub = entry
        for name in path:
            if not isinstance(sub, click.Group) or name not in sub.commands:
                return frozenset()
            sub = sub.commands[name]
        if isinstance(sub, click.Group) and "run" in sub.commands:
            path = [*path, "run"]  # `moestream bench OUT` runs `bench run`
        elif isinstance(sub, click.Group):  # a group's page names its commands' flags
            return frozenset().union(
                *(help_flags(f"{command} {n}") for n in sub.commands)
            )
    result = CliRunner().invoke(entry, [*path, "--help"], prog_name=program)
    assert result.exit_code == 0, (command, result.output)
    return frozenset(m.group(2) for m in FLAG.finditer(result.output))


@cache
def every_flag() -> frozenset[str]:
    def below(command: str, entry: click.Command) -> frozenset[str]:
        flags = help_flags(command)
        for name, sub in getattr(entry, "commands", {}).items():
            flags |= below(f"{command} {name}", sub)
        return flags

    return frozenset().union(*(below(p, e) for p, e in _entry_points().items()))


def _names(match: re.Match[str]) -> list[str]:
    name = match.group(2)
    return [name, f"no-{name}"] if match.group(1) else [name]


def _segments(text: str) -> list[tuple[int, str, bool]]:
    """(line, text, is code) pieces of a page where a command's flags sit:
    each code line (a backslash joins the next), each inline code span, and
    the prose around them."""
    pieces = []
    text = re.sub(
        r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S
    )
    blocks = re.split(r"(\n\s*\n)", text)
    line = 1
    for block in blocks:
        if block.startswith("    ") or block.lstrip().startswith("$ "):
            rows = re.sub(r"\\\n", " ", block).split("\n")
            pieces += [(line + number, row, True) for number, row in enumerate(rows)]
        else:
            for span in re.finditer(r"`([^`]+)`", block):
                at = line + block[: span.start()].count("\n")
                pieces.append((at, re.sub(r"\s+", " ", span.group(1)), True))
            pieces.append((line, re.sub(r"`[^`]+`", " ", block), False))
        line += block.count("\n")
    return pieces


def test_flags_named_in_docs_exist() -> None:
    problems = []
    # docs/history/ records what was run then, in the flags of that day
    for page in [p for p in PAGES if "history" not in p.parts]:
        for number, piece, code in _segments(page.read_text()):
            commands = list(COMMAND.finditer(piece)) if code else []
            for match in FLAG.finditer(piece):
                before = [c for c in commands if c.end() <= match.start()]
                command = before[-1].group(1) if before else None
                own = help_flags(command) if command else frozenset()
                for name in _names(match):
                    if name in own or (not own and name in every_flag() | FOREIGN):
                        continue
                    problems.append(f"{page.name}:{number}: --{name} ({command})")
    assert not problems, "flags no --help lists:\n" + "\n".join(problems)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    problems = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not problems, f"{page.name}: " + "; ".join(problems)


def test_every_doc_is_in_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    missing = [
        p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in index
    ]
    assert not missing, f"docs/README.md does not link {missing}"


PATH = re.compile(r"`((?:moestream|tests|scripts|csrc|examples)/[^`\s]*)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_files_exist(page: Path) -> None:
    """Every source path a page names is there (or is said to be in git history)."""
    text = page.read_text()
    missing = [
        m.group(1)
        for m in PATH.finditer(text)
        if not list(ROOT.glob(m.group(1)))
        and "git history" not in " ".join(text[m.end() : m.end() + 80].split())
    ]
    assert not missing, f"{page.name} names files that are not there: {missing}"


def test_architecture_picture_is_drawn_from_the_code() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "arch_graph", ROOT / "scripts" / "arch_graph.py"
    )
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    nodes, arrows = graph.edges()
    assert (
        "runtime/backend" in nodes and ("runtime/loader", "runtime/backend") in arrows
    )
    assert not any(b == "cli" for _, b in arrows)  # nothing imports the commands
    drawn = (ROOT / "docs" / "architecture.svg").read_text()
    assert drawn == graph.svg(nodes, arrows), (
        "docs/architecture.svg is stale: python scripts/arch_graph.py"
    )
