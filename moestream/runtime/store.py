"""Reads expert records from the memory-mapped blobs, verifying each once."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats import BlobReader, ExpertLayer, FormatError, Manifest, checksum
from ..formats.manifest import inside


class ExpertReadError(RuntimeError):
    """An expert record that cannot be used: the run stops, never computes."""


class ExpertStore:
    """All blobs of a converted model, memory-mapped read-only."""

    def __init__(self, directory: Path, manifest: Manifest, verify: bool = True):
        self.verify = verify
        self.readers: dict[int, BlobReader] = {}
        self._verified: dict[int, np.ndarray] = {}
        try:
            for layer in manifest.layers:
                path = inside(Path(directory), layer.file)
                self.readers[layer.layer] = BlobReader(path, layer)
                self._verified[layer.layer] = np.zeros(layer.num_experts, bool)
        except BaseException:
            self.close()
            raise

    def read(self, layer: int, expert: int) -> memoryview:
        """The record of `expert` in `layer`; its checksum is checked on first read."""
        reader = self.readers[layer]
        try:
            record = reader.record(expert)
            if self.verify and not self._verified[layer][expert]:
                if checksum(record) != reader.layer.checksums[expert]:
                    raise ExpertReadError(
                        f"Expert {expert} of layer {layer} in {reader.path} fails its "
                        "checksum; the file is corrupted: run `moestream verify` and "
                        "convert again."
                    )
                self._verified[layer][expert] = True
        except (OSError, ValueError) as e:
            raise ExpertReadError(
                f"Cannot read expert {expert} of layer {layer} from {reader.path}: {e}"
            ) from e
        return record

    def arrays(self, layer: int, expert: int) -> dict[str, mx.array]:
        """The expert's tensors as MLX arrays of their stored dtypes (copied)."""
        reader = self.readers[layer]
        record = self.read(layer, expert)
        out = {}
        for seg in reader.layer.segments:
            a = mx.array(reader.segment(record, seg))
            out[seg.name] = a.view(mx.bfloat16) if seg.dtype == "bfloat16" else a
        return out

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


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
