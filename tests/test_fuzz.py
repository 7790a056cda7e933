"""Property-based hostile inputs: mutated manifests and blob headers.

Whatever the mutation, the readers either refuse with the project's one-line
FormatError, or accept something that really is valid: a model that loads,
passes `verify`, and computes exactly what the intact model computes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moestream
from moestream.formats import BlobReader, FormatError, load_manifest
from moestream.formats.blob import HEADER, HEADER_CRC
from moestream.formats.verify import verify

# The fast suite's share; `pytest -m slow tests/test_fuzz.py` runs FUZZ_SLOW.
FUZZ_FAST, FUZZ_SLOW = 300, 5000
PROMPT = mx.array([[(11 * i + 5) % 300 for i in range(24)]])
FUZZ_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: CI failures reproduce
)

HOSTILE_STRINGS = [
    "",
    ".",
    "..",
    "../x",
    "../../etc/passwd",
    "/etc/passwd",
    "experts/../../x",
    "experts",
    "experts/layer-000.blob",
    "experts/layer-002.blob",
    "dense.safetensors",
    "manifest.json",
    "config.json",
    "a\x00b",
    "int4",
    "float64",
    "uint32",
    "bfloat16",
    "affine",
    "mxfp4",
    "crc32",
    "md5",
    "moestream",
    "00000000",
    "gate_proj.weight",
    "up_proj.scales",
    "x" * 5000,
]
EDGE_INTS = [0, 1, -1, 2, 3, 63, 64, 4096, 16383, 16384, 16385, 32768]
EDGE_INTS += [2**31 - 1, 2**31, 2**32, 2**32 + 16384, 2**46, 2**63, 2**64, 10**30]
EDGE_INTS += [-16384, -(2**63)]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(HOSTILE_STRINGS),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=3),
    ),
    max_leaves=8,
)


def node_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += node_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += node_paths(v, (*prefix, i))
    return out


@st.composite
def mutation(draw, paths: list[tuple]):
    path = draw(st.sampled_from(paths))
    kind = draw(st.sampled_from(["replace", "replace", "delete", "shift", "dup"]))
    if kind == "shift":  # near-miss integers: off by one, one alignment, one page
        return path, kind, draw(st.sampled_from([-16384, -64, -1, 1, 64, 16384, 2**32]))
    if kind == "replace":
        return path, kind, draw(json_values)
    return path, kind, None


def apply(d: dict, path: tuple, kind: str, value: Any) -> None:
    parent = d
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if kind == "delete":
        del parent[key]
    elif kind == "replace":
        parent[key] = value
    elif kind == "shift":
        if isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += value
    elif kind == "dup" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))


@pytest.fixture(scope="module")
def fuzz_dir(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(converted, out)
    return out


@pytest.fixture(scope="module")
def intact(fuzz_dir: Path):
    manifest = load_manifest(fuzz_dir)
    model, _ = moestream.load(fuzz_dir, cache_experts=3)
    logits = model(PROMPT)
    mx.eval(logits)
    return json.loads((fuzz_dir / "manifest.json").read_text()), manifest, logits


def one_line(e: BaseException) -> bool:
    return "\n" not in str(e) and len(str(e)) < 10_000


def metadata_only_change(m, original) -> bool:
    """Free-form fields the runtime never reads (provenance)."""
    return (
        dataclasses.replace(m, source=original.source, created_by=original.created_by)
        == original
    )


def check_manifest_property(directory: Path, intact) -> str:
    """Refused in one line, or really valid; returns which, for statistics."""
    _, original, logits = intact
    try:
        m = load_manifest(directory)
    except FormatError as e:
        assert one_line(e), str(e)
        return "refused"
    verify(directory)  # never raises for an existing directory, whatever it holds
    if metadata_only_change(m, original):
        return "same"
    try:
        model, _ = moestream.load(directory, cache_experts=3)
        ours = model(PROMPT)
        mx.eval(ours)
    except (ValueError, OSError) as e:  # what the CLIs print as one line
        assert one_line(e), str(e)
        return "refused at load"
    assert mx.array_equal(ours, logits).item(), "accepted a manifest and computed wrong"
    return "harmless"


def fuzz_manifest(fuzz_dir: Path, intact, mutations: list) -> str:
    raw = copy.deepcopy(intact[0])
    for path, kind, value in mutations:
        # an earlier mutation may have removed or retyped this path
        with contextlib.suppress(KeyError, IndexError, TypeError):
            apply(raw, path, kind, value)
    path = fuzz_dir / "manifest.json"
    try:
        path.write_text(json.dumps(raw, allow_nan=True))
        return check_manifest_property(fuzz_dir, intact)
    finally:
        path.write_text(json.dumps(intact[0]))


def manifest_mutations(intact_raw: dict):
    return st.lists(mutation(node_paths(intact_raw)), min_size=1, max_size=3)


def test_fuzz_manifest(fuzz_dir: Path, intact) -> None:
    outcomes: dict[str, int] = {}

    @settings(max_examples=FUZZ_FAST, **FUZZ_SETTINGS)
    @given(manifest_mutations(intact[0]))
    def prop(mutations):
        r = fuzz_manifest(fuzz_dir, intact, mutations)
        outcomes[r] = outcomes.get(r, 0) + 1

    prop()
    assert sum(outcomes.values()) == FUZZ_FAST
    assert outcomes.get("refused", 0) > FUZZ_FAST // 2, outcomes
    print("manifest fuzz outcomes:", outcomes)


@pytest.mark.slow
def test_fuzz_manifest_slow(fuzz_dir: Path, intact) -> None:
    @settings(max_examples=FUZZ_SLOW, **{**FUZZ_SETTINGS, "derandomize": False})
    @given(manifest_mutations(intact[0]))
    def prop(mutations):
        fuzz_manifest(fuzz_dir, intact, mutations)

    prop()


# ------------------------------------------------------------------ blob headers

FIELDS = ["magic", "version", "layer", "num_experts", "page", "stride", "offset", "rec"]
FIELD_MAX = [None, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**64 - 1, 2**64 - 1]
FIELD_MAX += [2**64 - 1]


@st.composite
def header_mutation(draw):
    """Either a field rewritten with a valid header crc, or raw bytes flipped."""
    if draw(st.booleans()):
        i = draw(st.integers(1, len(FIELDS) - 1))
        value = draw(
            st.one_of(st.integers(0, FIELD_MAX[i]), st.sampled_from([0, 1, 16384, 2]))
        )
        return "field", i, value
    pos = draw(st.integers(0, HEADER.size + HEADER_CRC.size - 1))
    return "byte", pos, draw(st.integers(1, 255))


def mutate_header(data: bytes, how) -> bytes:
    kind, a, b = how
    head = bytearray(data[: HEADER.size + HEADER_CRC.size])
    if kind == "byte":
        head[a] ^= b
    else:
        fields = list(HEADER.unpack_from(head))
        fields[a] = b
        packed = HEADER.pack(*fields)
        head = bytearray(packed + struct.pack("<I", zlib.crc32(packed)))
    return bytes(head) + data[len(head) :]


def test_fuzz_blob_header(fuzz_dir: Path) -> None:
    layer = load_manifest(fuzz_dir).layers[0]
    blob = fuzz_dir / layer.file
    original = blob.read_bytes()
    counts = {"refused": 0, "same": 0}

    @settings(max_examples=FUZZ_FAST, **FUZZ_SETTINGS)
    @given(header_mutation())
    def prop(how):
        data = mutate_header(original, how)
        blob.write_bytes(data)
        try:
            if data == original:
                counts["same"] += 1
                return
            with pytest.raises(FormatError) as e:
                BlobReader(blob, layer)
            assert one_line(e.value)
            problems = verify(fuzz_dir).problems
            assert problems == [
                f"{layer.file} (layer 0): header does not match manifest.json"
            ]
            counts["refused"] += 1
        finally:
            blob.write_bytes(original)

    prop()
    assert counts["refused"] > FUZZ_FAST * 0.9, counts


# ------------------------------------------------------------ source configs

CONFIG_FAST, CONFIG_SLOW = 100, 2000


@pytest.fixture(scope="module")
def fuzz_source(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("fuzzsrc") / "src"
    shutil.copytree(hf_dir, src)
    return src


def fuzz_config(src: Path, original: dict, key: str, value: Any) -> str:
    """convert-moe on a config with one hostile field: converts, or one line."""
    from moestream.converter import convert

    out = src.parent / "out"
    (src / "config.json").write_text(json.dumps({**original, key: value}))
    try:
        convert(str(src), out, progress=False)
        return "converted"
    except (ValueError, OSError) as e:  # what the CLI prints as one line
        assert one_line(e), str(e)
        return "refused"
    finally:
        (src / "config.json").write_text(json.dumps(original))
        for d in (out, out.with_name("out.partial")):
            shutil.rmtree(d, ignore_errors=True)


def config_mutations(config: dict):
    return st.tuples(st.sampled_from(sorted(config)), json_scalars)


def test_fuzz_source_config(fuzz_source: Path) -> None:
    original = json.loads((fuzz_source / "config.json").read_text())
    outcomes: dict[str, int] = {}

    @settings(max_examples=CONFIG_FAST, **FUZZ_SETTINGS)
    @given(config_mutations(original))
    def prop(mutation):
        r = fuzz_config(fuzz_source, original, *mutation)
        outcomes[r] = outcomes.get(r, 0) + 1

    prop()
    assert outcomes.get("refused", 0) > CONFIG_FAST // 4, outcomes
    print("config fuzz outcomes:", outcomes)


@pytest.mark.slow
def test_fuzz_source_config_slow(fuzz_source: Path) -> None:
    original = json.loads((fuzz_source / "config.json").read_text())

    @settings(max_examples=CONFIG_SLOW, **{**FUZZ_SETTINGS, "derandomize": False})
    @given(config_mutations(original))
    def prop(mutation):
        fuzz_config(fuzz_source, original, *mutation)

    prop()
