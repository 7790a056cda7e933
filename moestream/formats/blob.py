"""Per-layer expert blob: a header page, then one aligned record per expert.

    [header page: PAGE_SIZE bytes][expert 0 record, padded to stride][expert 1]...

Expert `e` starts at `data_offset + e * stride`; its segments sit at the
offsets the manifest's segment table gives. Records are zero-padded, so the
same experts always give the same bytes.
"""

from __future__ import annotations

import os
import struct
import weakref
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..units import count
from .dtypes import DTYPES
from .layout import blocked, unblocked
from .manifest import PAGE_SIZE, ExpertLayer, FormatError, Segment

MAGIC = b"MOEBLOB\x00"
BLOB_VERSION = 1
# magic, version, layer, num_experts, page size, stride, data_offset,
# record_nbytes, then a crc32 of everything before it.
HEADER = struct.Struct("<8sIIIIQQQ")
HEADER_CRC = struct.Struct("<I")

NUMPY_DTYPES = {name: d.numpy for name, d in DTYPES.items()}


def checksum(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def pack_header(layer: ExpertLayer) -> bytes:
    """The whole header page: `header_bytes` zero-padded to `data_offset`."""
    head = header_bytes(layer)
    return head + b"\x00" * (layer.data_offset - len(head))


def header_bytes(layer: ExpertLayer) -> bytes:
    """The header fields and their crc32, without the page's zero padding."""
    head = HEADER.pack(
        MAGIC,
        BLOB_VERSION,
        layer.layer,
        layer.num_experts,
        PAGE_SIZE,
        layer.stride,
        layer.data_offset,
        layer.record_nbytes,
    )
    return head + HEADER_CRC.pack(zlib.crc32(head))


def pack_record(
    segments: tuple[Segment, ...], record_nbytes: int, arrays: dict[str, np.ndarray]
) -> bytes:
    """Lay out one expert's tensors (numpy `[rows, cols]` as MLX holds them,
    raw bytes per segment dtype), each blocked where its segment says so."""
    buf = bytearray(record_nbytes)
    if set(arrays) != {s.name for s in segments}:
        raise ValueError(
            f"Record tensors {sorted(arrays)} do not match the segment table "
            f"{sorted(s.name for s in segments)}."
        )
    for s in segments:
        a = np.ascontiguousarray(arrays[s.name])
        if a.nbytes != s.nbytes:
            raise ValueError(
                f"Segment {s.name}: {a.nbytes} bytes, expected {s.nbytes}."
            )
        if s.blocked:
            a = blocked(a.reshape(s.shape))
        buf[s.offset : s.offset + s.nbytes] = a.tobytes()
    return bytes(buf)


def write_blob(path: Path, layer: ExpertLayer, records: Iterable[bytes]) -> list[str]:
    """Write the header and every record to `path` (temp name, then rename).

    Returns the checksum of each record, in expert order.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        sums = _write_records(tmp, layer, records)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. disk full: no partial blob stays behind
        raise
    os.replace(tmp, path)
    return sums


def _write_records(
    tmp: Path, layer: ExpertLayer, records: Iterable[bytes]
) -> list[str]:
    sums: list[str] = []
    with open(tmp, "wb") as f:
        f.write(pack_header(layer))
        for record in records:
            if len(record) != layer.record_nbytes:
                raise ValueError(
                    f"Record of {len(record)} bytes, expected {layer.record_nbytes}."
                )
            sums.append(checksum(record))
            f.write(record)
            f.write(b"\x00" * (layer.stride - len(record)))
        f.flush()
        os.fsync(f.fileno())
    if len(sums) != layer.num_experts:
        raise ValueError(
            f"Wrote {count(len(sums), 'record')}, expected {layer.num_experts}."
        )
    return sums


class BlobReader:
    """One layer's blob, opened read-only and checked against the manifest.

    Records are read with pread/preadv into caller-owned memory: one aligned
    read per expert, no page-cache pages mapped into the process (an mmap'd
    read would count against the memory budget as resident pages).
    """

    def __init__(self, path: Path, layer: ExpertLayer):
        self.path = Path(path)
        self.layer = layer
        if not self.path.is_file():
            raise FormatError(
                f"Expert blob {self.path} for layer {layer.layer} is missing; "
                "convert again."
            )
        self._fd = os.open(self.path, os.O_RDONLY)
        # closed with the reader even when nobody calls close(): a process that
        # loads models repeatedly must not run out of file descriptors
        self._closer = weakref.finalize(self, os.close, self._fd)
        try:
            self._check_size_and_header()
        except BaseException:
            self.close()
            raise

    def reopen(self) -> None:
        """Open the path again (a blob replaced by a good copy is read from
        then on), once its size and header check; else keep the file open."""
        fd = os.open(self.path, os.O_RDONLY)
        old, self._fd = self._fd, fd
        try:
            self._check_size_and_header()
            os.dup2(fd, old)  # the number stays: the finalizer closes it
        finally:
            self._fd = old
            os.close(fd)

    def _check_size_and_header(self) -> None:
        size = os.fstat(self._fd).st_size
        if size != self.layer.file_nbytes:
            state = "truncated" if size < self.layer.file_nbytes else "extended"
            raise FormatError(
                f"Expert blob {self.path} is {state} ({size} bytes, manifest says "
                f"{self.layer.file_nbytes}); convert again."
            )
        raw = os.pread(self._fd, HEADER.size + HEADER_CRC.size, 0)
        head = HEADER.unpack(raw[: HEADER.size])
        (crc,) = HEADER_CRC.unpack(raw[HEADER.size :])
        expected = HEADER.unpack(header_bytes(self.layer)[: HEADER.size])
        if head[0] != MAGIC:
            raise FormatError(f"{self.path} is not a moestream expert blob.")
        if crc != zlib.crc32(raw[: HEADER.size]) or head != expected:
            raise FormatError(
                f"Header of {self.path} does not match manifest.json (layer, "
                "expert count or stride differ); convert again."
            )

    def offset(self, expert: int) -> int:
        if not 0 <= expert < self.layer.num_experts:
            raise IndexError(
                f"Expert {expert} out of range in layer {self.layer.layer}"
            )
        return self.layer.data_offset + expert * self.layer.stride

    def readv(self, expert: int, buffers: list[memoryview]) -> None:
        """Read the record of `expert` into `buffers`, which must cover it exactly."""
        n = os.preadv(self._fd, buffers, self.offset(expert))
        if n != self.layer.record_nbytes:
            raise OSError(
                f"short read of expert {expert} ({n} of {self.layer.record_nbytes} "
                f"bytes): {self.path} changed on disk"
            )

    def willneed(self, expert: int) -> bool:
        """Start reading `expert`'s record into the page cache; False where the
        platform has no posix_fadvise."""
        if not hasattr(os, "posix_fadvise"):
            return False
        size = self.layer.record_nbytes
        os.posix_fadvise(self._fd, self.offset(expert), size, os.POSIX_FADV_WILLNEED)
        return True

    def drop_cache(self) -> None:
        """Evict this blob from the page cache (cold-start benchmarks)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def record(self, expert: int) -> bytes:
        buf = bytearray(self.layer.record_nbytes)
        self.readv(expert, [memoryview(buf)])
        return bytes(buf)

    def verify(self, expert: int) -> bool:
        return checksum(self.record(expert)) == self.layer.checksums[expert]

    def segment(self, record: bytes | memoryview, seg: Segment) -> np.ndarray:
        """One segment of a record as a numpy array of its storage dtype, in
        rows as MLX holds it: a view, or a copy where it is stored blocked."""
        a = np.frombuffer(
            record,
            NUMPY_DTYPES[seg.dtype],
            count=seg.nbytes // np.dtype(NUMPY_DTYPES[seg.dtype]).itemsize,
            offset=seg.offset,
        ).reshape(seg.shape)
        return unblocked(a) if seg.blocked else a

    def close(self) -> None:
        if self._fd >= 0:
            self._closer()
            self._fd = -1

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
