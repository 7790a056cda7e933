"""Check a converted model directory end to end: manifest, blobs, dense files.

Every byte of every blob is read once, sequentially and in large chunks, and
compared with what the converter wrote: the header page, each expert's
checksum, and the zero padding between records. Problems are collected, not
raised, so one run names every bad layer, expert and file.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .blob import header_bytes
from .manifest import (
    MANIFEST_NAME,
    ExpertLayer,
    FormatError,
    Manifest,
    inside,
    load_manifest,
)

# Large sequential reads: the kernel reads ahead, crc32 runs on big buffers.
CHUNK_BYTES = 16 << 20
SAFETENSORS_DTYPES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
MAX_SAFETENSORS_HEADER = 100 << 20


@dataclass
class VerifyReport:
    """What `verify` found: an empty `problems` list means the model is intact."""

    directory: Path
    problems: list[str] = field(default_factory=list)
    experts: int = 0
    layers: int = 0
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(directory: str | Path, progress: bool = False) -> VerifyReport:
    """Check manifest, every expert checksum, blob headers and dense files.

    Raises FormatError only when `directory` is not a directory; every flaw
    inside it is reported in the returned `VerifyReport`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FormatError(
            f"{directory} is not a directory; pass the output directory of convert-moe."
        )
    report = VerifyReport(directory)
    try:
        manifest = load_manifest(directory)
    except FormatError as e:
        report.problems.append(f"{MANIFEST_NAME}: {e}")
        return report
    report.problems += _check_config(directory)
    for name in manifest.dense_files:
        report.problems += check_safetensors(directory, name)
    report.problems += file_problems(directory, manifest)
    total = sum(layer.file_nbytes for layer in manifest.layers)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verify", disable=not progress
    ) as bar:
        for layer in manifest.layers:
            found = check_blob(directory, layer, bar.update)
            report.problems += found
            report.layers += 1
            report.experts += layer.num_experts
            report.bytes_read += layer.file_nbytes
    return report


def file_checksum(path: Path, bar: tqdm | None = None) -> str:
    """crc32 of a whole file, read in large chunks (counted on `bar`)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            if bar is not None:
                bar.update(len(chunk))
    return f"{crc & 0xFFFFFFFF:08x}"


def file_problems(
    directory: Path,
    manifest: Manifest,
    skip: tuple[str, ...] = (),
    missing_ok: bool = False,
    progress: bool = False,
) -> list[str]:
    """The files manifest.json has a crc32 of (dense, config, tokenizer) that differ."""
    problems = []
    names = [n for n in manifest.file_checksums if n not in skip]
    bar = tqdm(
        total=sum(_size(directory, n) for n in names),
        desc="checksums",
        unit="B",
        unit_scale=True,
        delay=1.0,  # only a step that takes more than a second shows a bar
        disable=not progress,
    )
    for name in names:
        crc = manifest.file_checksums[name]
        try:
            if file_checksum(inside(directory, name), bar) != crc:
                problems.append(f"{name}: checksum mismatch")
        except FileNotFoundError:
            if not missing_ok:
                problems.append(f"{name}: missing")
        except OSError as e:
            problems.append(f"{name}: cannot be read ({e})")
    bar.close()
    return problems


def _size(directory: Path, name: str) -> int:
    try:
        return inside(directory, name).stat().st_size
    except (OSError, FormatError):
        return 0


def check_files(
    directory: Path,
    manifest: Manifest,
    skip: tuple[str, ...] = (),
    progress: bool = False,
) -> None:
    """Raise FormatError unless every checksummed file is intact (missing ones
    are left to the readers of each file, which name them)."""
    problems = file_problems(Path(directory), manifest, skip, True, progress)
    if problems:
        raise FormatError(
            f"{'; '.join(problems)} in {directory}: the files were changed or "
            "corrupted; convert again (or pass --no-verify)."
        )


def _check_config(directory: Path) -> list[str]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"config.json: cannot be read ({e})"]
    if not isinstance(config, dict) or "model_type" not in config:
        return ["config.json: has no model_type"]
    return []


def check_safetensors(directory: Path, name: str) -> list[str]:
    """The header of one safetensors file: sizes, dtypes, contiguous offsets."""
    try:
        path = inside(directory, name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_SAFETENSORS_HEADER, size - 8):
                return [f"{name}: header size {n} is absurd for a {size}-byte file"]
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        return [f"{name}: cannot be read as safetensors ({e})"]
    if not isinstance(header, dict):
        return [f"{name}: header is not a JSON object"]
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = t["dtype"], t["shape"], t["data_offsets"]
            want = SAFETENSORS_DTYPES[dtype] * int(np.prod(shape, dtype=object))
        except (KeyError, TypeError, ValueError):
            return [f"{name}: tensor {key} has a malformed header entry"]
        if end - begin != want:
            return [
                f"{name}: tensor {key} holds {end - begin} bytes, shape needs {want}"
            ]
        spans.append((begin, end, key))
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            return [f"{name}: tensor {key} at {begin} leaves a gap or overlap at {pos}"]
        pos = end
    if 8 + n + pos != size:
        return [f"{name}: file is {size} bytes, its header describes {8 + n + pos}"]
    return []


def check_blob(
    directory: Path, layer: ExpertLayer, on_bytes: Callable[[int], object] = int
) -> list[str]:
    """Every byte of one layer's blob: header page, record checksums, padding."""
    where = f"{layer.file} (layer {layer.layer})"
    try:
        path = inside(directory, layer.file)
        size = path.stat().st_size
        # large sequential reads, with a buffer no larger than the file
        f = open(path, "rb", buffering=max(8192, min(CHUNK_BYTES, size)))  # noqa: SIM115
    except (OSError, FormatError) as e:
        on_bytes(layer.file_nbytes)
        return [f"{where}: cannot be opened ({e})"]
    with f:
        return _check_open_blob(f, layer, where, on_bytes)


class _Regions:
    """Consecutive regions of a file, read in bounded pieces (memory never
    depends on what the manifest claims): crc32 and all-zero per region."""

    def __init__(self, f, largest: int, on_bytes: Callable[[int], object]):
        self.f, self.on_bytes = f, on_bytes
        self.buf = memoryview(bytearray(max(1, min(CHUNK_BYTES, largest))))

    def read(self, n: int, crc: bool = False, zero: bool = False):
        got, value, zeros = 0, 0, True
        while got < n:
            k = self.f.readinto(self.buf[: min(len(self.buf), n - got)])
            if not k:
                break
            piece = self.buf[:k]
            if crc:
                value = zlib.crc32(piece, value)
            if zero and zeros:
                zeros = not np.frombuffer(piece, np.uint8).any()
            got += k
        self.on_bytes(n)
        return got, f"{value & 0xFFFFFFFF:08x}", zeros


def _check_open_blob(
    f, layer: ExpertLayer, where: str, on_bytes: Callable[[int], object]
) -> list[str]:
    problems = []
    size = os.fstat(f.fileno()).st_size
    if size != layer.file_nbytes:
        state = "truncated" if size < layer.file_nbytes else "extended"
        problems.append(
            f"{where}: {state} ({size} bytes, manifest says {layer.file_nbytes})"
        )
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    regions = _Regions(f, max(layer.data_offset, layer.stride), on_bytes)
    want = header_bytes(layer)
    head = f.read(len(want))
    _, _, rest_zero = regions.read(layer.data_offset - len(want), zero=True)
    if head != want or not rest_zero:
        problems.append(f"{where}: header does not match manifest.json")
    bad, missing, dirty = [], [], []
    pad = layer.stride - layer.record_nbytes
    for e in range(layer.num_experts):
        got, crc, _ = regions.read(layer.record_nbytes, crc=True)
        if got < layer.record_nbytes:
            missing.append(e)
        elif crc != layer.checksums[e]:
            bad.append(e)
        if not regions.read(pad, zero=True)[2]:
            dirty.append(e)
    if bad:
        problems.append(f"{where}: checksum mismatch in {_experts(bad)}")
    if missing:
        problems.append(
            f"{where}: {_experts(missing)} "
            + ("lies" if len(missing) == 1 else "lie")
            + " beyond end of file"
        )
    if dirty:
        problems.append(
            f"{where}: nonzero padding after {_experts(dirty)} (the file was modified)"
        )
    return problems


def _experts(xs: list[int]) -> str:
    """[3] -> 'expert 3'; [1, 2, 6] -> 'experts 1-2, 6'."""
    return ("expert " if len(xs) == 1 else "experts ") + _ranges(xs)


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
