"""manifest.json: everything the runtime needs to read a converted model.

The reader trusts nothing: it checks the version, that every file stays
inside the model directory, and that sizes and offsets are consistent.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..units import count
from .dtypes import DTYPES, FLOAT_DTYPES
from .layout import BLOCK_ROWS
from .recipe import MODES, Recipe, RecipeError

FORMAT_NAME = "moestream"
# Version 1: every record row-major. Version 2 adds segments stored blocked
# (`"layout": "blocked"`); a manifest is written as 2 only where one is.
FORMAT_VERSION = 1
BLOCKED_VERSION = 2
SUPPORTED_VERSIONS = (FORMAT_VERSION, BLOCKED_VERSION)
# How a 2-D segment's bytes are ordered: "rows" as MLX holds the tensor,
# "blocked" as the CPU kernel reads it (layout.py, BLOCK_ROWS rows a block).
ROWS, BLOCKED = "rows", "blocked"
LAYOUTS = (ROWS, BLOCKED)
MANIFEST_NAME = "manifest.json"
# Apple's page size; also a multiple of Linux pages and O_DIRECT alignment.
PAGE_SIZE = 16384
SEGMENT_ALIGN = 64
CHECKSUM_ALGORITHM = "crc32"
# A manifest larger than this is not a manifest.
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 46
# The converter writes one PAGE_SIZE header page; allow room to grow, no more.
MAX_HEADER_BYTES = 1 << 20
# Far beyond any model; keeps every header field inside its 32-bit slot.
MAX_LAYERS = 1 << 16

# A segment is `projection.tensor` (gate_proj.weight), as in the expert module.
SEGMENT_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")

DTYPE_SIZES = {name: d.itemsize for name, d in DTYPES.items()}


class FormatError(ValueError):
    """A converted model directory that cannot be used as it is."""


@dataclass(frozen=True)
class Segment:
    """One tensor of an expert record, at `offset` bytes inside the record."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    layout: str = ROWS  # or BLOCKED (format v2): how a 2-D segment's bytes run
    # The largest |value| of a float segment over the layer's experts, where
    # the converter recorded it (scales): the CPU kernel tells from it
    # whether a dequantization may run as one fused multiply-add. Absent in
    # older output, which reads as before; older readers ignore it.
    max_abs: float | None = None

    @property
    def projection(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def blocked(self) -> bool:
        return self.layout == BLOCKED


@dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one MoE layer, stored in one blob file."""

    layer: int
    module: str
    file: str
    num_experts: int
    stride: int
    data_offset: int
    record_nbytes: int
    segments: tuple[Segment, ...]
    checksums: tuple[str, ...]

    @property
    def file_nbytes(self) -> int:
        return self.data_offset + self.num_experts * self.stride

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def blocked(self) -> bool:
        """Whether any segment of this layer's records is stored blocked."""
        return any(s.blocked for s in self.segments)


@dataclass(frozen=True)
class Manifest:
    model_type: str
    dtype: str
    recipe: Recipe
    layers: tuple[ExpertLayer, ...]
    dense_files: tuple[str, ...]
    source: dict[str, Any] = field(default_factory=dict)
    created_by: str = ""
    # crc32 of the other files (dense, config, tokenizer); absent in early v1 output
    file_checksums: dict[str, str] = field(default_factory=dict)
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def expert_bytes(self) -> int:
        return sum(layer.num_experts * layer.record_nbytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return sum(layer.file_nbytes for layer in self.layers)

    @property
    def blocked(self) -> bool:
        """Whether any expert record is stored blocked (format v2)."""
        return any(layer.blocked for layer in self.layers)

    def to_json(self) -> str:
        d = asdict(self)
        d["layers"] = [layer_to_dict(layer) for layer in self.layers]
        d["recipe"] = self.recipe.to_dict()
        d["expert_bytes"] = self.expert_bytes
        d["total_bytes"] = self.total_bytes
        return json.dumps(d, indent=1, sort_keys=True) + "\n"

    def save(self, directory: Path) -> None:
        write_atomic(Path(directory) / MANIFEST_NAME, self.to_json().encode())


def layer_to_dict(layer: ExpertLayer) -> dict[str, Any]:
    """One `layers` entry of manifest.json: a segment's "layout" is written
    only where it is blocked, so row-major output stays format v1's, and
    "max_abs" only where it is known."""
    d = asdict(layer)
    for s in d["segments"]:
        if s["layout"] == ROWS:
            del s["layout"]
        if s["max_abs"] is None:
            del s["max_abs"]
    return d


def format_version(layers: tuple[ExpertLayer, ...] | list[ExpertLayer]) -> int:
    """The version a manifest of `layers` is written as: 2 where any record
    is stored blocked, else 1."""
    return BLOCKED_VERSION if any(layer.blocked for layer in layers) else FORMAT_VERSION


def blocked_layout(layer: ExpertLayer) -> ExpertLayer:
    """`layer` with each projection stored blocked where every 2-D segment of
    it has whole blocks of rows (a 1-D `bias` stays rows); others stay rows."""
    by_projection: dict[str, list[Segment]] = {}
    for s in layer.segments:
        by_projection.setdefault(s.projection, []).append(s)
    whole = {
        p
        for p, segs in by_projection.items()
        if any(len(s.shape) == 2 for s in segs)
        and all(s.shape[0] % BLOCK_ROWS == 0 for s in segs if len(s.shape) == 2)
    }
    segments = tuple(
        replace(s, layout=BLOCKED) if s.projection in whole and len(s.shape) == 2 else s
        for s in layer.segments
    )
    return replace(layer, segments=segments)


def with_max_abs(
    layer: ExpertLayer, of: Callable[[Segment], float | None]
) -> ExpertLayer:
    """`layer` with each float `scales` segment's max_abs set to `of(segment)`."""
    return replace(
        layer,
        segments=tuple(
            replace(s, max_abs=of(s))
            if s.name.endswith(".scales") and s.dtype in FLOAT_DTYPES
            else s
            for s in layer.segments
        ),
    )


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name beside `path`, then rename it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written stays behind
        raise


def record_layout(
    tensors: list[tuple[str, str, tuple[int, ...], dict[str, Any] | None]],
) -> tuple[tuple[Segment, ...], int]:
    """Place segments (name, dtype, shape, quant) 64-byte aligned in one record."""
    segments, offset = [], 0
    for name, dtype, shape, quant in sorted(tensors, key=lambda t: t[0]):
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        q = quant or {}
        segments.append(
            Segment(
                name,
                dtype,
                tuple(shape),
                offset,
                nbytes,
                q.get("bits"),
                q.get("group_size"),
                q.get("mode"),
            )
        )
        offset = _align(offset + nbytes, SEGMENT_ALIGN)
    record_nbytes = segments[-1].offset + segments[-1].nbytes if segments else 0
    return tuple(segments), record_nbytes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def stride_for(record_nbytes: int) -> int:
    return max(PAGE_SIZE, _align(record_nbytes, PAGE_SIZE))


def layer_layout(
    layer: int,
    module: str,
    num_experts: int,
    tensors: list[tuple[str, str, tuple[int, ...], dict[str, Any] | None]],
) -> ExpertLayer:
    """The blob of one MoE layer: file, segments, stride; checksums still empty."""
    segments, record_nbytes = record_layout(tensors)
    return ExpertLayer(
        layer=layer,
        module=module,
        file=f"experts/layer-{layer:03d}.blob",
        num_experts=num_experts,
        stride=stride_for(record_nbytes),
        data_offset=PAGE_SIZE,
        record_nbytes=record_nbytes,
        segments=segments,
        checksums=("",) * num_experts,
    )


# ---------------------------------------------------------------- reading


def load_manifest(directory: str | Path) -> Manifest:
    """Read and validate `directory/manifest.json`; raise FormatError on any flaw."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise FormatError(
            f"{directory} is not a directory; pass the output directory of convert-moe."
        )
    if not path.is_file():
        raise FormatError(
            f"{path} is missing; {directory} is not a converted model "
            "(run convert-moe first)."
        )
    inside(directory, MANIFEST_NAME)  # not a symlink out of the directory
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes.")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path} is not valid JSON ({e}); convert again.") from e
    except RecursionError:
        raise FormatError(f"{path} is nested absurdly deep; convert again.") from None
    try:
        manifest = _from_dict(d)
    except FormatError as e:  # say which file
        raise FormatError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{path} is malformed: {e!r}; convert again.") from e
    validate(manifest, directory)
    return manifest


def _from_dict(d: dict[str, Any]) -> Manifest:
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise FormatError(
            'not a moestream manifest (no "format": "moestream"); convert again.'
        )
    version = d.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(
            f"Unsupported format version {version!r} (this moestream reads "
            f"{list(SUPPORTED_VERSIONS)}); upgrade moestream or convert again."
        )
    try:
        recipe = Recipe.from_dict(d["recipe"])
    except RecipeError as e:
        raise FormatError(str(e)) from e
    layouts = version >= BLOCKED_VERSION
    layers = tuple(layer_from_dict(e, layouts) for e in _list(d["layers"]))
    return Manifest(
        model_type=_str(d["model_type"]),
        dtype=_str(d["dtype"]),
        recipe=recipe,
        layers=layers,
        dense_files=tuple(_str(f) for f in _list(d["dense_files"])),
        source=dict(d.get("source", {})),
        created_by=str(d.get("created_by", "")),
        file_checksums=_checksum_map(d.get("file_checksums", {})),
        checksum_algorithm=_str(d["checksum_algorithm"]),
        format=d["format"],
        version=version,
    )


def layer_from_dict(e: dict[str, Any], layouts: bool = True) -> ExpertLayer:
    """One `layers` entry of manifest.json (unvalidated: see `validate_layer`);
    without `layouts` (format v1) a segment has no "layout" key."""
    return ExpertLayer(
        layer=_int(e["layer"]),
        module=_str(e["module"]),
        file=_str(e["file"]),
        num_experts=_int(e["num_experts"]),
        stride=_int(e["stride"]),
        data_offset=_int(e["data_offset"]),
        record_nbytes=_int(e["record_nbytes"]),
        segments=tuple(_segment(s, layouts) for s in _list(e["segments"])),
        checksums=tuple(_str(c) for c in _list(e["checksums"])),
    )


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"Expected an integer in manifest.json, got {v!r:.80}.")
    return v


def _checksum_map(v: Any) -> dict[str, str]:
    if not isinstance(v, dict):
        raise FormatError(f"Expected an object in manifest.json, got {v!r:.80}.")
    return {_str(k): _str(c) for k, c in v.items()}


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise FormatError(f"Expected a string in manifest.json, got {v!r:.80}.")
    return v


def _list(v: Any) -> list:
    if not isinstance(v, list):
        raise FormatError(f"Expected a list in manifest.json, got {v!r:.80}.")
    return v


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int(v)


def _opt_float(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FormatError(f"Expected a number in manifest.json, got {v!r:.80}.")
    return float(v)


def _segment(s: dict[str, Any], layouts: bool) -> Segment:
    if "layout" in s and not layouts:
        raise FormatError(
            f"Segment {s['name']!r:.80} has a layout, which format version "
            f"{FORMAT_VERSION} does not have; convert again."
        )
    return Segment(
        name=_str(s["name"]),
        dtype=_str(s["dtype"]),
        shape=tuple(_int(x) for x in _list(s["shape"])),
        offset=_int(s["offset"]),
        nbytes=_int(s["nbytes"]),
        bits=_opt_int(s.get("bits")),
        group_size=_opt_int(s.get("group_size")),
        mode=None if s.get("mode") is None else _str(s["mode"]),
        layout=_str(s.get("layout", ROWS)),
        max_abs=_opt_float(s.get("max_abs")),
    )


def validate(m: Manifest, directory: Path) -> None:
    """Check every size, offset and path of `m`; raise FormatError on the first flaw."""
    if m.checksum_algorithm != CHECKSUM_ALGORITHM:
        raise FormatError(
            f"Unknown checksum algorithm {m.checksum_algorithm!r}; convert again."
        )
    if m.version >= BLOCKED_VERSION and not m.blocked:
        raise FormatError(
            f"Format version {m.version} without any blocked segment: no "
            "moestream writes that; convert again."
        )
    for f in (*m.dense_files, *m.file_checksums):
        inside(directory, f)
    seen_layers, seen_files = set(), set()
    for layer in m.layers:
        where = f"layer {layer.layer}"
        if not 0 <= layer.layer < MAX_LAYERS or layer.layer in seen_layers:
            raise FormatError(f"Layer index {layer.layer} is out of range or repeated.")
        if layer.file in seen_files:
            raise FormatError(f"{where}: blob {layer.file} is shared with a layer.")
        seen_layers.add(layer.layer)
        seen_files.add(layer.file)
        inside(directory, layer.file)
        validate_layer(layer, where)


def validate_layer(layer: ExpertLayer, where: str) -> None:
    if not 0 < layer.num_experts <= 1 << 20:
        raise FormatError(f"{where}: absurd expert count {layer.num_experts}.")
    for name, v in (("stride", layer.stride), ("data_offset", layer.data_offset)):
        if v <= 0 or v % PAGE_SIZE:
            raise FormatError(
                f"{where}: {name} {v} is not a positive multiple of {PAGE_SIZE}."
            )
    if layer.data_offset > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: absurd header page of {layer.data_offset} bytes.")
    if not 0 < layer.record_nbytes <= layer.stride:
        raise FormatError(
            f"{where}: record size {layer.record_nbytes} does not fit "
            f"the stride {layer.stride}."
        )
    if layer.file_nbytes > MAX_FILE_BYTES:
        raise FormatError(f"{where}: absurd blob size {layer.file_nbytes}.")
    if len(layer.checksums) != layer.num_experts:
        raise FormatError(
            f"{where}: {count(len(layer.checksums), 'checksum')} for "
            f"{count(layer.num_experts, 'expert')}."
        )
    end, names = 0, set()
    for s in sorted(layer.segments, key=lambda s: s.offset):
        _validate_segment(s, where)
        if s.name in names:
            raise FormatError(f"{where}: duplicate segment {s.name}.")
        names.add(s.name)
        if s.offset < end:
            raise FormatError(f"{where}: segment {s.name} overlaps the previous one.")
        end = s.offset + s.nbytes
    if not layer.segments or end != layer.record_nbytes:
        raise FormatError(
            f"{where}: segments end at {end}, record says {layer.record_nbytes}."
        )
    _validate_layouts(layer, where)


def _validate_layouts(layer: ExpertLayer, where: str) -> None:
    """A blocked segment is 2-D with whole blocks of rows, and a projection's
    2-D segments (weight, scales, biases) share one layout."""
    layouts: dict[str, str] = {}
    for s in layer.segments:
        if s.layout not in LAYOUTS:
            raise FormatError(
                f"{where}: segment {s.name} has unknown layout {s.layout!r:.80} "
                f"(one of {', '.join(LAYOUTS)}); upgrade moestream or convert again."
            )
        if s.blocked and (len(s.shape) != 2 or s.shape[0] % BLOCK_ROWS):
            raise FormatError(
                f"{where}: segment {s.name} {s.shape} is blocked but is not 2-D "
                f"with rows a multiple of {BLOCK_ROWS}; convert again."
            )
        first = layouts.setdefault(s.projection, s.layout) if len(s.shape) == 2 else ""
        if first and first != s.layout:
            raise FormatError(
                f"{where}: projection {s.projection} mixes blocked and row-major "
                "segments; convert again."
            )


def _validate_segment(s: Segment, where: str) -> None:
    if not SEGMENT_NAME.fullmatch(s.name):
        raise FormatError(
            f"{where}: segment name {s.name!r:.80} is not projection.tensor."
        )
    if s.dtype not in DTYPE_SIZES:
        raise FormatError(f"{where}: segment {s.name} has unknown dtype {s.dtype!r}.")
    if s.mode is not None and s.mode not in MODES:
        raise FormatError(f"{where}: segment {s.name} has unknown mode {s.mode!r}.")
    if s.offset < 0 or s.offset % SEGMENT_ALIGN:
        raise FormatError(
            f"{where}: segment {s.name} offset {s.offset} is not "
            f"{SEGMENT_ALIGN}-byte aligned."
        )
    if any(d <= 0 for d in s.shape) or len(s.shape) > 4:
        raise FormatError(f"{where}: segment {s.name} has bad shape {s.shape}.")
    if s.max_abs is not None and not 0 <= s.max_abs < math.inf:
        raise FormatError(
            f"{where}: segment {s.name} has max_abs {s.max_abs!r}, not a finite "
            "magnitude; convert again."
        )
    if math.prod(s.shape) * DTYPE_SIZES[s.dtype] != s.nbytes:
        raise FormatError(
            f"{where}: segment {s.name} shape {s.shape} ({s.dtype}) "
            f"does not match {s.nbytes} bytes."
        )


def inside(directory: Path, name: str) -> Path:
    """Resolve `name` under `directory`, refusing anything that escapes it."""
    if "\x00" in name:
        raise FormatError(f"File name {name!r} in manifest.json holds a NUL byte.")
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise FormatError(
            f"File name {name!r} in manifest.json escapes the model "
            "directory; refusing it."
        )
    root = directory.resolve()
    path = (directory / name).resolve()
    if root != path and root not in path.parents:
        raise FormatError(
            f"File {name!r} resolves outside {directory} (symlink?); refusing it."
        )
    return path
