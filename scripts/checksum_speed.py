"""Checksum throughput on this machine, and `moestream verify` speed on a model.

    python scripts/checksum_speed.py [OUT]

Prints GB/s of zlib.crc32 (the format's checksum) and alternatives on 2 MB
buffers (about one expert record of a 30B-class model), then, given a
converted OUT, the time `verify` takes over its blobs (warm page cache).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import zlib
from pathlib import Path

from moestream.formats.verify import verify

SIZE = 2 << 20
ROUNDS = 200


def rate(fn, buf: bytes) -> float:
    fn(buf)
    t = time.perf_counter()
    for _ in range(ROUNDS):
        fn(buf)
    return SIZE * ROUNDS / (time.perf_counter() - t) / 1e9


def main() -> None:
    buf = os.urandom(SIZE)
    candidates = {
        "zlib.crc32": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
        "hashlib.sha1": lambda b: hashlib.sha1(b).digest(),
        "hashlib.md5": lambda b: hashlib.md5(b).digest(),
    }
    try:
        import xxhash

        candidates["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    for name, fn in candidates.items():
        print(f"{name:18s} {rate(fn, buf):6.2f} GB/s on 2 MB buffers")
    if len(sys.argv) > 1:
        for state in ("cold", "warm"):
            if state == "cold":  # drop the blobs from the page cache first
                for blob in Path(sys.argv[1]).glob("experts/*.blob"):
                    fd = os.open(blob, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            t = time.perf_counter()
            report = verify(sys.argv[1])
            dt = time.perf_counter() - t
            gb = report.bytes_read / 1e9
            print(
                f"verify {sys.argv[1]}: {gb:.2f} GB of blobs in {dt:.2f} s "
                f"({gb / dt:.2f} GB/s, {state}), {len(report.problems)} problems"
            )


if __name__ == "__main__":
    main()
