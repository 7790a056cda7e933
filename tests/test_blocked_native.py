"""Records converted with `--layout blocked` on the native engine: the mapped
backend's kernel reads them in place (blocked reads, scales in their stored
float dtype), blocked slots take them as stored, and slots MLX's ops read
(another compute dtype, the kernel off) get them turned back into rows. Each
gives the resident model's logits bit for bit, on several bit widths, group
sizes and stored float dtypes, cold and with misses."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.bench.models import Scale, write_synthetic
from moestream.bench.sysio import drop_cache
from moestream.converter import convert
from moestream.formats import BlobReader, Recipe, load_manifest
from moestream.formats.dtypes import max_abs
from moestream.reference import resident_model
from moestream.runtime import RuntimeConfig, native
from moestream.runtime.loader import execution_for

pytestmark = pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native extension or its exact CPU kernel is not here",
)

# moe_intermediate_size 192: twelve blocks of 16 rows, past a task of 64
GEOMETRY = {"num_hidden_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 192}
CASES = {
    "4-4-8-g64-bf16": ("gate_proj=4,up_proj=4,down_proj=8", 64, mx.bfloat16),
    "2-3-5-g32-f16": ("gate_proj=2,up_proj=3,down_proj=5", 32, mx.float16),
    "6-8-4-g64-f32": ("gate_proj=6,up_proj=8,down_proj=4", 64, mx.float32),
}
# How each run loads the model: the mapped backend, every expert in blocked
# slots, two slots (misses), bfloat16 compute and the kernel off (row-major
# slots filled from blocked records).
LOADS = {
    "mapped": {"backend": "mapped"},
    "all-slots": {"cache_experts": 8},
    "two-slots": {"cache_experts": 2},
    "bfloat16": {"cache_experts": 3, "dtype": "bfloat16"},
    "mlx-ops": {"cache_experts": 3, "cpu_kernel": False},
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A blocked conversion of one case, its source and recipe, and the
    resident logits by compute dtype (built once)."""
    bits, group_size, dtype = CASES[request.param]
    root = tmp_path_factory.mktemp("blocked")
    hf = tiny_qwen3_moe(root / "hf", dtype=dtype, **GEOMETRY)
    name = str(dtype).removeprefix("mlx.core.")
    out = root / "out"
    convert(
        str(hf), out, bits, group_size, dtype=name, progress=False, layout="blocked"
    )
    recipe = Recipe.parse(bits, group_size=group_size)
    logits: dict[str, list[mx.array]] = {}

    def resident(compute: str) -> list[mx.array]:
        if compute not in logits:
            ref = resident_model(hf, recipe, name, compute_dtype=compute)
            logits[compute] = logits_stepwise(ref, PROMPT, steps=6)
        return logits[compute]

    return out, resident


def test_the_conversion_is_blocked(case):
    out, _ = case
    layers = load_manifest(out).layers
    assert {s.layout for layer in layers for s in layer.segments} == {"blocked"}
    plan = execution_for(out, RuntimeConfig(backend="mapped"))
    assert plan.blocked_records and not any("as rows" in w for w in plan.parts())


@pytest.mark.parametrize("load", list(LOADS))
def test_blocked_records_give_the_resident_models_logits(case, load):
    out, resident = case
    options = LOADS[load]
    model, _ = moestream.load(out, engine="native", **options)
    for layer in load_manifest(out).layers:  # cold: every record read
        drop_cache(out / layer.file)
    ours = logits_stepwise(model, PROMPT, steps=6)  # a prefill of many pairs first
    theirs = resident(options.get("dtype", "float32"))
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"{load}: step {step} differs"
    if load == "mapped":  # the blocked reads, not a fallback
        layers = [m for _, m in model.named_modules() if hasattr(m, "_mapped")]
        assert layers and all(all(p[-2] for p in m._mapped.projections) for m in layers)
    elif options["cache_experts"] < 8:  # every slot is filled at load
        assert moestream.stats(model).misses > 0


def test_gpu_slots_refuse_blocked_records(case):
    """The native engine cannot turn a record on its way to a GPU's slots:
    the cache refuses to bind them (the loader says so first, in one line)."""
    out, _ = case
    layer = load_manifest(out).layers[0]
    slots = [mx.zeros((2, *s.shape), getattr(mx, s.dtype)) for s in layer.segments]
    segments = [
        (s.offset, s.nbytes, 0, s.shape[0], s.nbytes // s.shape[0], False, True)
        for s in layer.segments
    ]
    cache = native._native.ExpertCache(
        path=str(out / layer.file),
        layer=layer.layer,
        data_offset=layer.data_offset,
        stride=layer.stride,
        record_nbytes=layer.record_nbytes,
        num_experts=layer.num_experts,
        capacity=2,
        segments=segments,
        checksums=[],
        verify=False,
        policy="lrfu",
        decay=0.5,
        max_pairs=2,
    )
    mx.eval(slots)
    with pytest.raises(ValueError, match="needs CPU slots"):
        cache.bind(slots, True)


def test_make_model_blocked_holds_the_same_weights(tmp_path: Path):
    """`bench make-model --layout blocked`: the rows model's values, each
    segment stored blocked, each projection's largest scale recorded as the
    converter records it, and the same tokens on the mapped backend."""
    tiny = Scale(2, 8, 2, 128, 64, heads=4, kv_heads=2, head_dim=32, vocab=512)
    rows = write_synthetic(tmp_path / "rows", tiny)
    blocked = write_synthetic(tmp_path / "blocked", tiny, layout="blocked")
    assert blocked.version == 2 and rows.version == 1
    for a, b in zip(rows.layers, blocked.layers, strict=True):
        assert all(s.blocked for s in b.segments)
        with (
            BlobReader(tmp_path / "rows" / a.file, a) as ra,
            BlobReader(tmp_path / "blocked" / b.file, b) as rb,
        ):
            largest: dict[str, float] = {}
            for e in range(a.num_experts):
                x, y = ra.record(e), rb.record(e)
                assert x != y  # stored otherwise
                for sa, sb in zip(a.segments, b.segments, strict=True):
                    assert np.array_equal(ra.segment(x, sa), rb.segment(y, sb))
                    m = max_abs(ra.segment(x, sa), sa.dtype)
                    largest[sa.name] = max(m, largest.get(sa.name, 0.0))
        for sa, sb in zip(a.segments, b.segments, strict=True):
            if sa.name.endswith(".scales"):
                assert sa.max_abs == sb.max_abs == largest[sa.name] > 0
            else:
                assert sa.max_abs is None and sb.max_abs is None
    prompt = mx.array([[5, 9, 200, 31, 7, 77, 400, 3]])
    logits = [
        moestream.load(tmp_path / name, backend="mapped")[0](prompt)
        for name in ("rows", "blocked")
    ]
    assert mx.array_equal(*logits).item()
