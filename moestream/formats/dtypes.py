"""The one dtype table: every stored dtype by the name the manifest uses."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class StoredDtype:
    name: str
    itemsize: int
    # numpy has no bfloat16: it is carried as raw 16-bit words
    numpy: type[np.generic]
    mx: mx.Dtype


DTYPES: dict[str, StoredDtype] = {
    d.name: d
    for d in [
        StoredDtype("uint8", 1, np.uint8, mx.uint8),
        StoredDtype("uint32", 4, np.uint32, mx.uint32),
        StoredDtype("float16", 2, np.float16, mx.float16),
        StoredDtype("bfloat16", 2, np.uint16, mx.bfloat16),
        StoredDtype("float32", 4, np.float32, mx.float32),
    ]
}

# mx dtype -> manifest name (what a tensor of that dtype is stored as)
DTYPE_NAMES: dict[mx.Dtype, str] = {d.mx: d.name for d in DTYPES.values()}
# The floating dtypes a model can be converted to or run in.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 carried as raw 16-bit words, widened to float32 exactly."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def max_abs(values: np.ndarray, dtype: str) -> float | None:
    """The largest |value| of stored float `values` (bfloat16 as raw words),
    exactly: Segment.max_abs. None where a value is not finite."""
    v = bf16_to_f32(values) if dtype == "bfloat16" else values.astype(np.float32)
    if not np.isfinite(v).all():
        return None
    return float(np.abs(v).max()) if v.size else 0.0


def gather_max_abs(
    maxima: dict[str, float | None], name: str, values: np.ndarray, dtype: str
) -> None:
    """Fold max_abs(values) into maxima[name], the largest over everything
    gathered under `name` (None once any value was not finite)."""
    m, seen = max_abs(values, dtype), maxima.get(name, 0.0)
    maxima[name] = None if m is None or seen is None else max(m, seen)
