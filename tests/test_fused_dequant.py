"""The fused dequantization: the converter records each layer's largest
scale (Segment.max_abs), a relayout of older output records it too, the
manifest refuses a bad record, and the CPU kernel fuses `scale * q + bias`
into one multiply-add exactly where every product is exact (stored
bfloat16 or float16 scales, none so large that a product leaves float32's
range), giving the resident model's logits bit for bit either way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import PROMPT, copy_of, edit_manifest, logits_stepwise

import moestream
from moestream.converter import convert
from moestream.formats import BlobReader, FormatError, Recipe, load_manifest
from moestream.formats.dtypes import bf16_to_f32
from moestream.formats.manifest import Segment
from moestream.reference import resident_model
from moestream.runtime import native
from moestream.runtime.switch import StreamingSwitchGLU

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _largest(out: Path, layer, seg) -> float:
    """The largest |scale| of `seg` over every record of `layer`, as stored."""
    top = 0.0
    with BlobReader(out / layer.file, layer) as reader:
        for e in range(layer.num_experts):
            v = reader.segment(reader.record(e), seg)
            v = bf16_to_f32(v) if seg.dtype == "bfloat16" else v.astype(np.float32)
            top = max(top, float(np.abs(v).max()))
    return top


def test_the_converter_records_each_layers_largest_scale(converted: Path) -> None:
    manifest = load_manifest(converted)
    checked = 0
    for layer in manifest.layers:
        for seg in layer.segments:
            if seg.name.endswith(".scales"):
                assert seg.max_abs == _largest(converted, layer, seg) > 0
                checked += 1
            else:
                assert seg.max_abs is None
    assert checked == 3 * len(manifest.layers)
    raw = json.loads((converted / "manifest.json").read_text())
    keyed = {
        s["name"]
        for layer in raw["layers"]
        for s in layer["segments"]
        if "max_abs" in s
    }
    assert keyed == {"gate_proj.scales", "up_proj.scales", "down_proj.scales"}


def test_a_relayout_records_it_for_older_output(
    converted: Path, tmp_path: Path
) -> None:
    """Output of a converter before the record: convert-moe OLD NEW --layout
    blocked reads every record anyway, and writes what the converter would."""
    old = copy_of(converted, tmp_path)

    def forget(d: dict) -> None:
        for layer in d["layers"]:
            for s in layer["segments"]:
                s.pop("max_abs", None)

    edit_manifest(old, forget)
    assert all(
        s.max_abs is None for layer in load_manifest(old).layers for s in layer.segments
    )
    convert(str(old), tmp_path / "blocked", layout="blocked", progress=False)
    new, want = load_manifest(tmp_path / "blocked"), load_manifest(converted)
    for a, b in zip(new.layers, want.layers, strict=True):
        assert [s.max_abs for s in a.segments] == [s.max_abs for s in b.segments]


@pytest.mark.parametrize(
    "value", [-1.0, "0.5", True, float("nan"), float("inf")], ids=repr
)
def test_a_bad_record_is_refused(copy: Path, value) -> None:
    def bad(d: dict) -> None:
        for s in d["layers"][0]["segments"]:
            if s["name"] == "up_proj.scales":
                s["max_abs"] = value

    edit_manifest(copy, bad)
    with pytest.raises(FormatError, match=r"max_abs|Expected a number") as e:
        load_manifest(copy)
    assert "\n" not in str(e.value)


def _scales(dtype: str, max_abs: float | None) -> Segment:
    return Segment("up_proj.scales", dtype, (16, 2), 0, 32 * 4, max_abs=max_abs)


@pytest.mark.skipif(
    not native.available() or not native.fma_matches_mlx(),
    reason="the native extension, or a CPU with vector FMA, is not here",
)
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_the_rule_of_an_exact_product(bits: int) -> None:
    """Fused only from bfloat16 or float16 records with a recorded largest
    scale whose products with q < 2**bits stay within float32's range."""
    edge = FLOAT32_MAX / (2**bits - 1)
    below = np.float32(edge)  # the largest float32 at or below the edge
    if float(below) * (2**bits - 1) > FLOAT32_MAX:
        below = np.nextafter(below, np.float32(0))
    below = float(below)
    for dtype in ("bfloat16", "float16"):
        assert native.exact_fma(_scales(dtype, 0.5), bits)
        assert native.exact_fma(_scales(dtype, below), bits)
        assert not native.exact_fma(
            _scales(dtype, math.nextafter(edge, math.inf)), bits
        )
        assert not native.exact_fma(_scales(dtype, None), bits)  # older output
    assert not native.exact_fma(_scales("float32", 0.5), bits)
    assert not native.exact_fma(None, bits)


CASES = {  # stored dtype -> whether its records fuse
    "bfloat16": True,
    "float16": True,
    "float32": False,
}
RECIPE = "gate_proj=4,up_proj=3,down_proj=8"
GEOMETRY = {"num_hidden_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 128}


@pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native extension or its exact CPU kernel is not here",
)
@pytest.mark.parametrize("dtype", list(CASES))
def test_the_kernel_fuses_where_the_records_allow(dtype: str, tmp_path: Path) -> None:
    """Blocked slots with misses (filled in the kernel) and the mapped
    backend: fused on bfloat16 and float16 records where this CPU can, and
    the resident model's logits either way; after a scale of one layer is
    recorded past the limit, that layer is not fused and still exact."""
    hf = tiny_qwen3_moe(tmp_path / "hf", dtype=getattr(mx, dtype), **GEOMETRY)
    out = tmp_path / "out"
    convert(str(hf), out, RECIPE, dtype=dtype, progress=False, layout="blocked")
    ref = resident_model(hf, Recipe.parse(RECIPE), dtype, compute_dtype="float32")
    theirs = logits_stepwise(ref, PROMPT, steps=5)
    fuses = CASES[dtype] and native.fma_matches_mlx()

    def run(**options) -> list[list[bool]]:
        model, _ = moestream.load(out, engine="native", **options)
        ours = logits_stepwise(model, PROMPT, steps=5)
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert mx.array_equal(a, b).item(), f"{options}: step {step} differs"
        layers = sorted(
            (m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)),
            key=lambda m: m.layer.layer,
        )
        if options.get("backend") == "mapped":
            return [[p[-1] for p in m._mapped.projections] for m in layers]
        assert all(m.blocked for m in layers)
        return [[spec[2] for spec in m._experts.specs] for m in layers]

    for options in ({"cache_experts": 2}, {"backend": "mapped"}):
        assert run(**options) == [[fuses] * 3] * 2

    def past_the_limit(d: dict) -> None:  # layer 0 up_proj (3 bits): 2**126 * 7 > max
        for s in d["layers"][0]["segments"]:
            if s["name"] == "up_proj.scales":
                s["max_abs"] = 2.0**126

    edit_manifest(out, past_the_limit)
    for options in ({"cache_experts": 2}, {"backend": "mapped"}):
        assert run(**options) == [[fuses, False, fuses], [fuses] * 3]
