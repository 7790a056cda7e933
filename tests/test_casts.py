"""Stored floats into slots of another float dtype: both engines convert bit for
bit as MLX's astype does (every 16-bit pattern; float32 at every rounding
boundary), NaNs included, and the models they run stay exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.formats.blob import NUMPY_DTYPES
from moestream.runtime import native
from moestream.runtime.store import cast_into

WORDS = {2: np.uint16, 4: np.uint32}
needs_native = pytest.mark.skipif(
    not native.available(), reason="moestream's native engine is not built"
)


def patterns(stored: str) -> np.ndarray:
    """Every 16-bit pattern; for float32 every high half with the low halves
    at and around each rounding point (bfloat16: bit 15, float16: bit 12),
    and a million random words."""
    if stored != "float32":
        return np.arange(1 << 16, dtype=np.uint16)
    lows = [0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001]
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    grid = (high[:, None] | np.array([*lows, 0xFFFF], np.uint32)).reshape(-1)
    rng = np.random.default_rng(0)
    return np.concatenate([grid, rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])


def mlx_astype(bits: np.ndarray, stored: str, dtype: mx.Dtype) -> np.ndarray:
    a = mx.array(bits).view(getattr(mx, stored)).astype(dtype)
    return np.array(a.view(mx.uint16 if dtype.size == 2 else mx.uint32))


@pytest.mark.parametrize("stored, dtype", list(native.CASTS), ids=str)
def test_python_cast_is_mlx_astype(stored: str, dtype: mx.Dtype) -> None:
    bits = patterns(stored)
    raw = bits if stored == "bfloat16" else bits.view(NUMPY_DTYPES[stored])
    out = np.empty(bits.size, WORDS[dtype.size])
    cast_into(raw, stored, dtype, out)
    assert np.array_equal(out, mlx_astype(bits, stored, dtype))


@needs_native
@pytest.mark.parametrize("stored, dtype", list(native.CASTS), ids=str)
def test_native_cast_is_mlx_astype(stored: str, dtype: mx.Dtype) -> None:
    bits = patterns(stored)
    out = native._native.cast(bits.tobytes(), native.CASTS[(stored, dtype)])
    ours = np.frombuffer(out, WORDS[dtype.size])
    want = mlx_astype(bits, stored, dtype)
    assert ours.size == bits.size
    wrong = np.nonzero(ours != want)[0]
    assert wrong.size == 0, [
        (hex(bits[i]), hex(ours[i]), hex(want[i])) for i in wrong[:5]
    ]


def test_the_casts_cover_every_float_pair() -> None:
    floats = ["float32", "float16", "bfloat16"]
    pairs = {(a, getattr(mx, b)) for a in floats for b in floats if a != b}
    assert set(native.CASTS) == pairs


@pytest.fixture(scope="module")
def stored_as(hf_dir, tmp_path_factory):
    """The tiny model converted with each stored float dtype (cached)."""
    from moestream.converter import convert

    made = {}

    def get(dtype: str):
        if dtype not in made:
            out = tmp_path_factory.mktemp(dtype) / "model"
            convert(str(hf_dir), out, dtype=dtype, progress=False)
            made[dtype] = out
        return made[dtype]

    return get


# (stored, compute): each conversion a record's floats take into its slots.
CONVERSIONS = [
    ("bfloat16", "float16"),
    ("float16", "bfloat16"),
    ("float32", "float16"),
    ("float32", "bfloat16"),
]


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("stored, compute", CONVERSIONS)
def test_converted_slots_are_exact(hf_dir, stored_as, engine, stored, compute):
    """Slots in another float dtype than the records': logits equal mlx-lm's
    resident model cast to it, prefill and decode, for both engines."""
    from moestream.formats import Recipe
    from moestream.reference import resident_model

    if engine == "native" and not native.available():
        pytest.skip("moestream's native engine is not built")
    path = stored_as(stored)
    model, _ = moestream.load(path, cache_experts=3, dtype=compute, engine=engine)
    ref = resident_model(hf_dir, Recipe(), dtype=stored, compute_dtype=compute)
    prompt = PROMPT[:, :9]  # 8-40x slower on a CPU than float32
    ours, theirs = logits_stepwise(model, prompt, 3), logits_stepwise(ref, prompt, 3)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == getattr(mx, compute)
        assert mx.array_equal(a, b).item()
    assert moestream.stats(model).misses > 0
