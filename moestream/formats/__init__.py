"""The one contract between converter and runtime: manifest, blobs, recipe."""

from .blob import BlobReader, checksum, pack_record, write_blob
from .dtypes import max_abs
from .layout import BLOCK_ROWS, blocked, unblocked
from .manifest import (
    BLOCKED_VERSION,
    FORMAT_VERSION,
    LAYOUTS,
    SUPPORTED_VERSIONS,
    ExpertLayer,
    FormatError,
    Manifest,
    Segment,
    blocked_layout,
    format_version,
    layer_layout,
    load_manifest,
    record_layout,
    stride_for,
)
from .recipe import QuantSpec, Recipe, RecipeError
from .writer import ModelWriter, WriterState

__all__ = [
    "BLOCKED_VERSION",
    "BLOCK_ROWS",
    "FORMAT_VERSION",
    "LAYOUTS",
    "SUPPORTED_VERSIONS",
    "BlobReader",
    "ExpertLayer",
    "FormatError",
    "Manifest",
    "ModelWriter",
    "QuantSpec",
    "Recipe",
    "RecipeError",
    "Segment",
    "WriterState",
    "blocked",
    "blocked_layout",
    "checksum",
    "format_version",
    "layer_layout",
    "load_manifest",
    "max_abs",
    "pack_record",
    "record_layout",
    "stride_for",
    "unblocked",
    "write_blob",
]
