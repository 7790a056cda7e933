"""A converted model in the other record layout: `convert-moe OUT NEW --layout
blocked` (or `rows`) rewrites its expert blobs, each record's values in the
new layout (format.md, blocked records), and copies every other file as it
is. The same weights, no source checkpoint needed: the output equals a
conversion of the original checkpoint with that --layout, byte for byte.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..formats import (
    BlobReader,
    ExpertLayer,
    FormatError,
    Manifest,
    ModelWriter,
    blocked,
    blocked_layout,
    checksum,
    load_manifest,
)
from ..formats.dtypes import FLOAT_DTYPES, gather_max_abs
from ..formats.manifest import MANIFEST_NAME, ROWS, inside, with_max_abs
from ..formats.verify import check_files
from ..units import human_bytes

log = logging.getLogger(__name__)


def is_converted(source: str) -> bool:
    """Whether `source` is a folder convert-moe wrote (its manifest is there)."""
    return (Path(source) / MANIFEST_NAME).is_file()


def relayout(source: Path, out: Path, layout: str, progress: bool = True) -> Manifest:
    """`source` (a converted model) written to `out` with its expert records
    in `layout`; each record's checksum is checked as it is read. Written in a
    temporary folder beside `out`, renamed at the end."""
    manifest = load_manifest(source)
    check_files(source, manifest)
    tmp = out.with_name(f".{out.name}.relayout")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer = ModelWriter(tmp)
    try:
        start = time.perf_counter()
        writer.copy_dense(inside(source, f) for f in manifest.dense_files)
        for i, layer in enumerate(manifest.layers):
            entry = new_entry(layer, layout)
            maxima: dict[str, float | None] = {}
            with BlobReader(inside(source, layer.file), layer) as reader:
                records = _records(reader, layer, entry, maxima)
                written = writer.add_layer(entry, records)
            # Read from the records, as the converter records it.
            writer.layers[-1] = with_max_abs(written, lambda s, m=maxima: m[s.name])
            if progress:
                log.info("layer %d of %d rewritten", i + 1, len(manifest.layers))
        writer.close_tensors()
        for f in sorted(source.iterdir()):
            if (
                f.is_file()
                and f.name != MANIFEST_NAME
                and f.name not in writer.dense_files
            ):
                writer.copy_file(f)
        new = writer.write_manifest(
            model_type=manifest.model_type,
            dtype=manifest.dtype,
            recipe=manifest.recipe,
            source=manifest.source,
            created_by=f"moestream {__version__}",
        )
        writer.publish(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "%s of records rewritten in %.1f s",
        human_bytes(manifest.expert_bytes),
        time.perf_counter() - start,
    )
    return new


def new_entry(layer: ExpertLayer, layout: str) -> ExpertLayer:
    """`layer`'s table in `layout`: where each segment sits is unchanged (a
    layout keeps every segment's bytes), only its `layout`."""
    rows = replace(
        layer, segments=tuple(replace(s, layout=ROWS) for s in layer.segments)
    )
    return blocked_layout(rows) if layout == "blocked" else rows


def _records(
    reader: BlobReader,
    layer: ExpertLayer,
    entry: ExpertLayer,
    maxima: dict[str, float | None],
) -> Iterator[bytes]:
    """Each record of `layer` checked, then its segments in `entry`'s layout;
    `maxima` gathers each segment's largest |value| (Segment.max_abs)."""
    for e in range(layer.num_experts):
        record = reader.record(e)
        if checksum(record) != layer.checksums[e]:
            raise FormatError(
                f"{layer.file}: expert {e} of layer {layer.layer} fails its checksum; "
                "the source is damaged: convert the original checkpoint again."
            )
        out = bytearray(record)
        for old, seg in zip(layer.segments, entry.segments, strict=True):
            values = reader.segment(record, old)  # rows, whatever it was stored as
            if old.dtype in FLOAT_DTYPES:
                gather_max_abs(maxima, old.name, values, old.dtype)
            data = blocked(values) if seg.blocked else values
            out[seg.offset : seg.offset + seg.nbytes] = data.tobytes()
        yield bytes(out)
