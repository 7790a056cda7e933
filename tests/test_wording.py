"""Every user-facing error message (an f-string raised anywhere in moestream,
or echoed by a command) through a plural/number check: a number followed by a
counted noun goes through `units.count`, so 1 reads "1 slot", not "1 slots"."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from moestream.formats import FormatError, load_manifest
from moestream.units import count

ROOT = Path(__file__).parent.parent / "moestream"
NOUNS = {
    "problems", "experts", "slots", "layers", "sequences", "records", "ranks",
    "files", "processes", "tensors", "checksums", "predictions", "blocks",
}  # fmt: skip
# (file, noun, the number's source text): the number is never 1 there, or no
# number at all; each with its reason.
NEVER_ONE = {
    ("bench/commands.py", "experts", "experts"),  # a model's experts per layer
    ("bench/commands.py", "layers", "ids.shape[0]"),  # a model's MoE layers
    ("bench/routes.py", "experts", "trace.num_experts"),  # a trace's, >= top-k >= 1
    ("bench/routes.py", "predictions", "n"),  # only when n > what the trace holds
    ("converter/layouts.py", "blocks", "bi"),  # a block shape, not a count
    ("converter/pack.py", "experts", "src.config['model_type']"),  # a name
    ("families.py", "layers", "n"),  # only when n > MAX_LAYERS
    ("pipeline.py", "processes", "len(costs)"),  # "between 1 and N": a range
    ("runtime/memory.py", "sequences", "plan.concurrency"),  # concurrency > 1
    ("runtime/memory.py", "experts", "least"),  # concurrency x top-k > 1
    ("runtime/switch.py", "tensors", "sorted(params)"),  # a list, not a number
}
# Where the number can be 1: the runtime's engines, changed in other work now.
TO_FIX: set[tuple[str, str, str]] = set()  # none left
WORD = re.compile(r"^ ([a-z]+)\b")


def messages(tree: ast.AST):
    """The f-strings raised, and those given to click.echo."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield from (n for n in ast.walk(node.exc) if isinstance(n, ast.JoinedStr))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "click.echo":
            for arg in node.args:
                yield from (n for n in ast.walk(arg) if isinstance(n, ast.JoinedStr))


def counted_nouns(message: ast.JoinedStr):
    """(number's source, noun) for each `{number} noun` of a message."""
    parts = message.values
    for value, text in itertools.pairwise(parts):
        if isinstance(value, ast.FormattedValue) and isinstance(text, ast.Constant):
            found = WORD.match(str(text.value))
            if found and found.group(1) in NOUNS:
                yield ast.unparse(value.value), found.group(1)


def test_count_agrees_with_its_noun() -> None:
    assert count(1, "slot") == "1 slot"
    assert count(0, "slot") == "0 slots"
    assert count(2, "process", "processes") == "2 processes"


def test_every_counted_noun_in_a_message_agrees_with_its_number() -> None:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for message in messages(ast.parse(path.read_text())):
            for number, noun in counted_nouns(message):
                found.add((name, noun, number))
    assert found - NEVER_ONE - TO_FIX == set()  # give these to units.count
    assert found >= NEVER_ONE | TO_FIX  # none of the listed is stale


@pytest.mark.parametrize("text", ["{}", '{"format": "other"}'])
def test_a_manifest_that_is_not_one_names_its_path(tmp_path: Path, text: str) -> None:
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(FormatError) as e:
        load_manifest(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'manifest.json'}: not a moestream")
