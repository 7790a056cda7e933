"""What the kernel says about a benchmark process: storage reads, free memory."""

from __future__ import annotations

import os
from pathlib import Path


def read_bytes() -> int:
    """Bytes this process and its reaped children had read from storage
    (/proc/self/io read_bytes: page-cache hits, for reads and mmap alike,
    count nothing); 0 where the platform has no /proc."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return 0
    fields = dict(line.split(": ") for line in text.splitlines())
    return int(fields["read_bytes"])


def drop_cache(path: Path) -> None:
    """Evict `path` from the page cache (POSIX_FADV_DONTNEED: only clean pages
    that no process maps go)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, Cached, ...)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        out[name] = int(value[0]) * (1024 if len(value) > 1 else 1)
    return out
