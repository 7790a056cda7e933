"""Byte sizes as users write and read them."""

from __future__ import annotations

import math
import resource
import sys

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: int | str) -> int:
    """`8G`, `512M`, `1.5G`, `1073741824` -> bytes (binary units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        text = str(size).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in SIZE_UNITS else ""
        try:
            n = int(float(text[: len(text) - len(unit)]) * SIZE_UNITS[unit])
        except (ValueError, OverflowError):  # "inf" overflows int()
            raise ValueError(
                f"Cannot read size {size!r}; write a number with K, M, G or T, e.g. 8G."
            ) from None
    if n <= 0:
        raise ValueError(f"Size {size!r} must be positive.")
    return n


def human_bytes(n: int, up: bool = False) -> str:
    """1536 -> '1.5K'; with `up`, round up so the figure is never too small."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{math.ceil(value * 10) / 10 if up else value:.1f}{unit}"
    return f"{n}B"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 slot`, `2 slots`: a number and its noun, agreeing."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
