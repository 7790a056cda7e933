"""The blocked layout of a 2-D tensor: the CPU kernel's, on disk and in slots.

A `[rows, cols]` tensor blocked by `lanes` rows holds `lanes` rows at a time,
element c of those rows side by side: element (r, c) sits at flat index
`((r // lanes) * cols + c) * lanes + r % lanes`. Expert records store it with
`BLOCK_ROWS` lanes where the manifest's segment says `"layout": "blocked"`
(format v2); the CPU kernel's blocked slots hold the same bytes.
"""

from __future__ import annotations

import numpy as np

# Rows per block, on disk and in blocked slots, on every ISA (AVX2's 8-lane
# vectors read a block as two halves).
BLOCK_ROWS = 16


def blocked(a: np.ndarray, lanes: int = BLOCK_ROWS) -> np.ndarray:
    """`a` `[..., rows, cols]` blocked by `lanes` rows (rows a multiple of
    `lanes`): `[..., rows / lanes, cols, lanes]` in memory, in `a`'s shape."""
    *lead, rows, cols = a.shape
    b = a.reshape(*lead, rows // lanes, lanes, cols).swapaxes(-1, -2)
    return np.ascontiguousarray(b).reshape(a.shape)


def unblocked(a: np.ndarray, lanes: int = BLOCK_ROWS) -> np.ndarray:
    """`blocked`'s inverse: the rows of a blocked `[..., rows, cols]` array."""
    *lead, rows, cols = a.shape
    b = a.reshape(*lead, rows // lanes, cols, lanes).swapaxes(-1, -2)
    return np.ascontiguousarray(b).reshape(a.shape)
