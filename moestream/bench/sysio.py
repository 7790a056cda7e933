"""What the kernel says about a benchmark process: storage reads, free memory."""

from __future__ import annotations

import os
import time
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


def read_in_order(path: Path) -> None:
    """`path` dropped from the page cache and read again in order, as a copy
    of it leaves it: the page cache may then hold it in large folios, which
    one fault maps whole."""
    drop_cache(path)
    with path.open("rb") as f:
        while f.read(1 << 17):
            pass


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, Cached, ...)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        out[name] = int(value[0]) * (1024 if len(value) > 1 else 1)
    return out


def direct_read_gbps(path: Path, block: int, total: int, threads: int = 1) -> float:
    """GB/s of O_DIRECT reads of `block` bytes at random aligned offsets of
    `path` (no page cache on either side), `threads` reads in flight."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    size = Path(path).stat().st_size
    block = max(4096, block // 4096 * 4096)
    count = max(threads, total // block)
    rng = random.Random(0)
    offsets = [rng.randrange(0, (size - block) // 4096) * 4096 for _ in range(count)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned

    def worker(i: int) -> None:
        for off in offsets[i::threads]:
            os.preadv(fd, [bufs[i]], off)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return count * block / 1e9 / (time.perf_counter() - start)
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
