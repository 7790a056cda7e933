"""ModelWriter: the one way a converted model directory is written.

Dense tensors and expert blobs first (in any order), then config.json and the
other files, then the manifest with every file's checksum, then the rename of
the finished directory to its name: the states make any other order an error
(as gguf-py's `WriterState` does), so no reader ever sees a half-made model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import replace
from enum import Enum, auto
from pathlib import Path
from typing import Any

import mlx.core as mx

from .blob import write_blob
from .manifest import MANIFEST_NAME, ExpertLayer, Manifest, format_version
from .recipe import Recipe
from .verify import file_checksum

DENSE_SHARD_BYTES = 4 << 30


class WriterState(Enum):
    TENSORS = auto()  # dense tensors and expert blobs
    FILES = auto()  # config.json, tokenizer and other files beside them
    MANIFEST = auto()  # the manifest is written: only publishing is left
    PUBLISHED = auto()


class ModelWriter:
    """Writes one model into `directory` (a temporary name, see `publish`).

    `layers`: blobs already in `directory` (a resumed conversion's), kept as
    they are. `ignore`: file names beside the blobs that the manifest's
    checksums leave out (a resume journal, a lock).
    """

    def __init__(
        self,
        directory: Path,
        layers: Iterable[ExpertLayer] = (),
        shard_bytes: int = DENSE_SHARD_BYTES,
        ignore: Iterable[str] = (),
    ):
        self.directory = Path(directory)
        self.layers = list(layers)
        self.dense = _DenseWriter(self.directory, shard_bytes)
        self.dense_files: list[str] = []
        self.ignore = {MANIFEST_NAME, *ignore}
        self.state = WriterState.TENSORS

    def _expect(self, state: WriterState) -> None:
        if self.state is not state:
            raise RuntimeError(
                f"ModelWriter is in state {self.state.name}, not {state.name}."
            )

    @property
    def dense_bytes(self) -> int:
        return self.dense.nbytes

    def add_dense(self, arrays: dict[str, mx.array]) -> None:
        self._expect(WriterState.TENSORS)
        self.dense.add(arrays)

    def add_layer(self, entry: ExpertLayer, records: Iterable[bytes]) -> ExpertLayer:
        """Write one layer's blob from its records; the entry with its checksums."""
        self._expect(WriterState.TENSORS)
        (self.directory / entry.file).parent.mkdir(parents=True, exist_ok=True)
        sums = write_blob(self.directory / entry.file, entry, records)
        entry = replace(entry, checksums=tuple(sums))
        self.layers.append(entry)
        return entry

    def copy_dense(self, files: Iterable[Path]) -> None:
        """Another model's dense files (and index), taken as they are: the
        dense part of a model written again in another record layout."""
        self._expect(WriterState.TENSORS)
        if self.dense.nbytes:
            raise RuntimeError("ModelWriter: dense tensors and copied files, not both.")
        for f in files:
            shutil.copyfile(f, self.directory / f.name)
            self.dense_files.append(f.name)

    def close_tensors(self) -> list[str]:
        """Flush the dense tensors; the dense file names."""
        self._expect(WriterState.TENSORS)
        if self.dense_files:  # copied (copy_dense)
            self.state = WriterState.FILES
            return self.dense_files
        self.dense_files = self.dense.close()
        self.state = WriterState.FILES
        return self.dense_files

    def write_config(self, config: dict, quantization: dict) -> None:
        """The config plus mlx-lm's quantization entries (as save_config writes)."""
        self._expect(WriterState.FILES)
        config = {k: v for k, v in config.items() if k != "_name_or_path"}
        config["quantization"] = quantization
        config["quantization_config"] = quantization
        text = json.dumps(dict(sorted(config.items())), indent=4)
        (self.directory / "config.json").write_text(text)

    def copy_file(self, path: Path) -> None:
        self._expect(WriterState.FILES)
        shutil.copyfile(path, self.directory / path.name)

    def write_manifest(
        self,
        model_type: str,
        dtype: str,
        recipe: Recipe,
        source: dict[str, Any],
        created_by: str,
    ) -> Manifest:
        """The manifest, with the crc32 of every file beside the blobs (format
        version 2 where a record is stored blocked, else 1)."""
        self._expect(WriterState.FILES)
        layers = tuple(sorted(self.layers, key=lambda e: e.layer))
        manifest = Manifest(
            model_type=model_type,
            dtype=dtype,
            recipe=recipe,
            layers=layers,
            dense_files=tuple(self.dense_files),
            source=source,
            created_by=created_by,
            file_checksums=self._file_checksums(),
            version=format_version(layers),
        )
        manifest.save(self.directory)
        self.state = WriterState.MANIFEST
        return manifest

    def _file_checksums(self) -> dict[str, str]:
        return {
            f.name: file_checksum(f)
            for f in sorted(self.directory.iterdir())
            if f.is_file() and f.name not in self.ignore
        }

    def publish(self, out: Path) -> None:
        """Move the finished directory to `out`, replacing an old `out` only last."""
        self._expect(WriterState.MANIFEST)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(self.directory, out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        self.state = WriterState.PUBLISHED


class _DenseWriter:
    """Dense tensors into `dense.safetensors`, or shards plus an index when large."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.pending: dict[str, mx.array] = {}
        self.shards: list[dict[str, str]] = []
        self.nbytes = 0

    def add(self, arrays: dict[str, mx.array]) -> None:
        self.pending.update(arrays)
        self.nbytes += sum(a.nbytes for a in arrays.values())
        if sum(a.nbytes for a in self.pending.values()) >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"dense-{len(self.shards) + 1:05d}.safetensors"
        _save_safetensors(self.directory / name, self.pending)
        self.shards.append({k: name for k in self.pending})
        self.pending = {}

    def close(self) -> list[str]:
        if not self.shards:
            _save_safetensors(self.directory / "dense.safetensors", self.pending)
            return ["dense.safetensors"]
        self._flush()
        weight_map = {k: v for shard in self.shards for k, v in shard.items()}
        index = {
            "metadata": {"total_size": self.nbytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.directory / "dense.safetensors.index.json").write_text(
            json.dumps(index, indent=1) + "\n"
        )
        return sorted(set(weight_map.values()))


def _save_safetensors(path: Path, arrays: dict[str, mx.array]) -> None:
    # Through a Python file: a full disk raises OSError(ENOSPC), not a bare
    # RuntimeError as MLX's own file writer does.
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, {"format": "mlx"})
