"""Reads expert records from the blobs into slot memory, verifying each once."""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..families import DTYPE_NAMES
from ..formats import BlobReader, ExpertLayer, FormatError, Manifest, Segment
from ..formats.blob import NUMPY_DTYPES
from ..formats.layout import BLOCK_ROWS, blocked, unblocked
from ..formats.manifest import inside


class ExpertReadError(OSError):
    """An expert record that cannot be used: the run stops, never computes.

    An OSError, so the CLIs report it as one line (reliability fix).
    """


class ExpertStore:
    """All blobs of a converted model, opened read-only; records verified once."""

    def __init__(self, directory: Path, manifest: Manifest, verify: bool = True):
        self.verify = verify
        self.readers: dict[int, BlobReader] = {}
        # One staging record for all layers: fills run one at a time.
        size = max((layer.record_nbytes for layer in manifest.layers), default=0)
        self.staging = memoryview(bytearray(size))
        self._verified: dict[int, np.ndarray] = {}
        self._injected: dict[tuple[int, int], int] = {}  # inject_read_failures
        try:
            for layer in manifest.layers:
                path = inside(Path(directory), layer.file)
                self.readers[layer.layer] = BlobReader(path, layer)
                self._verified[layer.layer] = np.zeros(layer.num_experts, bool)
        except BaseException:
            self.close()
            raise

    def readv(self, layer: int, expert: int, buffers: list[memoryview]) -> None:
        """Read one record into `buffers` (covering it exactly); verify once.

        A record that fails its read or its checksum is read once more (a
        transient error heals), from its blob opened again by path (a blob
        replaced by a good copy heals too); a second failure raises
        ExpertReadError, as the native engine does (csrc/record_reader.h).
        """
        try:
            self._read_once(layer, expert, buffers)
        except ExpertReadError:
            with contextlib.suppress(OSError, FormatError):  # else: the old file
                self.readers[layer].reopen()
            self._read_once(layer, expert, buffers)

    def inject_read_failures(self, layer: int, expert: int, count: int) -> None:
        """Tests: the next `count` reads of the record fail as an I/O error
        would (each read, or its retry, takes one); the native engine's
        `ExpertCache.inject_read_failures(expert, count)` is its twin."""
        if expert not in range(len(self._verified[layer])) or count < 0:
            raise ValueError(f"No expert {expert} in layer {layer}, or count < 0.")
        self._injected[(layer, expert)] = count

    def _read_once(self, layer: int, expert: int, buffers: list[memoryview]) -> None:
        reader = self.readers[layer]
        try:
            if self._injected.get((layer, expert), 0) > 0:
                self._injected[(layer, expert)] -= 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            reader.readv(expert, buffers)
        except (OSError, ValueError) as e:
            raise ExpertReadError(
                f"Cannot read expert {expert} of layer {layer} from {reader.path}: {e}"
            ) from e
        if self.verify and not self._verified[layer][expert]:
            crc = 0
            for b in buffers:
                crc = zlib.crc32(b, crc)
            if f"{crc:08x}" != reader.layer.checksums[expert]:
                raise ExpertReadError(
                    f"Expert {expert} of layer {layer} in {reader.path} fails its "
                    "checksum; the file is corrupted: convert again."
                )
            self._verified[layer][expert] = True

    def willneed(self, layer: int, experts: list[int]) -> None:
        """Ask the kernel to read these records now, in parallel, in the background."""
        reader = self.readers[layer]
        try:
            for e in experts:
                reader.willneed(e)
        except OSError:
            pass  # only a hint: the read that needs the record reports errors

    def drop_cache(self) -> None:
        for r in self.readers.values():
            r.drop_cache()

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


RAW_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def writable_view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array's memory (any dtype, as raw words)."""
    return np.frombuffer(memoryview(a), RAW_DTYPES[a.dtype.size]).reshape(a.shape)


class SlotFiller:
    """Reads expert records straight into slot arrays: one preadv per expert.

    `lanes`: the slots hold each projection blocked by that many rows (the
    CPU kernel's blocked slots), 0 in rows. A segment stored as the slot
    holds it (its layout and dtype) lands in the slot's memory directly;
    else it is read into a staging buffer, then cast as MLX casts
    (`cast_into`, elementwise: a cast keeps the layout), unblocked or
    blocked as the slot needs.
    """

    def __init__(
        self,
        store: ExpertStore,
        layer: ExpertLayer,
        slots: list[mx.array],
        lanes: int = 0,
    ):
        self.store, self.layer = store, layer
        self.staging = store.staging
        self.views = [writable_view(a) for a in slots]
        self.dtypes = [a.dtype for a in slots]
        self.order = sorted(range(len(slots)), key=lambda i: layer.segments[i].offset)
        self.lanes = lanes

    def _as_stored(self, seg: Segment) -> bool:
        """Whether the slot holds `seg` in the layout it is stored in."""
        return (BLOCK_ROWS if seg.blocked else 0) == self.lanes

    def fill(self, expert: int, slot: int) -> None:
        buffers, staged, pos = [], [], 0
        for i in self.order:
            seg = self.layer.segments[i]
            if seg.offset > pos:
                buffers.append(self.staging[pos : seg.offset])
            if seg.dtype == DTYPE_NAMES[self.dtypes[i]] and self._as_stored(seg):
                buffers.append(memoryview(self.views[i][slot]).cast("B"))
            else:
                buffers.append(self.staging[seg.offset : seg.offset + seg.nbytes])
                staged.append(i)
            pos = seg.offset + seg.nbytes
        self.store.readv(self.layer.layer, expert, buffers)
        for i in staged:
            self._write(self.layer.segments[i], self.views[i][slot], self.dtypes[i])

    def _write(self, seg: Segment, dst: np.ndarray, dtype: mx.Dtype) -> None:
        """A staged segment into its slot `dst`: cast, (un)blocked, or both."""
        raw = np.frombuffer(
            self.staging,
            NUMPY_DTYPES[seg.dtype],
            offset=seg.offset,
            count=seg.nbytes // NUMPY_DTYPES[seg.dtype]().itemsize,
        ).reshape(seg.shape)
        if self._as_stored(seg):  # only the dtype differs
            cast_into(raw, seg.dtype, dtype, dst)
            return
        if seg.blocked:
            raw = unblocked(raw)
        if seg.dtype != DTYPE_NAMES[dtype]:
            words = np.empty_like(dst)
            cast_into(raw, seg.dtype, dtype, words)
            raw = words
        raw = raw.view(dst.dtype)
        dst[...] = blocked(raw, self.lanes) if self.lanes else raw


def cast_into(raw: np.ndarray, stored: str, dtype: mx.Dtype, out: np.ndarray) -> None:
    """Stored floats `raw` (bfloat16 as its raw words) into `out`, the raw words
    of a `dtype` array, bit for bit as MLX's astype converts them."""
    if stored == "bfloat16" and dtype == mx.float32:  # exact: the high half
        np.left_shift(raw.astype(np.uint32), 16, out=out)
    elif stored == "float16" and dtype == mx.float32:
        out[...] = raw.astype(np.float32).view(np.uint32)
        np.bitwise_or(out, 0x400000, out=out, where=np.isnan(raw))  # MLX's quiet NaN
    else:  # rare (e.g. bf16 stored, fp16 compute): round exactly as MLX does
        a = mx.array(raw)
        if stored == "bfloat16":
            a = a.view(mx.bfloat16)
        a = mx.contiguous(a.astype(dtype))
        mx.eval(a)
        out[...] = writable_view(a)


def check_layers(
    manifest: Manifest, modules: dict[str, object]
) -> dict[str, ExpertLayer]:
    """Match manifest layers to the model's expert modules, one to one."""
    by_module = {layer.module: layer for layer in manifest.layers}
    if set(by_module) != set(modules):
        missing = sorted(set(modules) - set(by_module))
        extra = sorted(set(by_module) - set(modules))
        raise FormatError(
            f"manifest.json does not match the model: experts missing for "
            f"{missing[:3]}, unknown modules {extra[:3]}; convert again."
        )
    return by_module
