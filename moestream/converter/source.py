"""A checkpoint to convert: hub id or local directory, opened lazily.

Tensors are read with `mx.load`, which maps safetensors files without reading
them; a tensor's bytes are read when it is evaluated, so the converter holds
one layer at a time. Pickle checkpoints (`*.bin`, `*.pt`) are never loaded.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .hfconfig import normalize_config

log = logging.getLogger(__name__)

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
]
TOKENIZER_GLOBS = ["*.tiktoken"]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# gpt-oss repos keep a second copy of the weights, in another layout, here.
HUB_IGNORE = ["original/*"]


class SourceError(ValueError):
    """A source checkpoint that cannot be converted as it is."""


@dataclass
class Source:
    path: Path
    config: dict
    repo_id: str | None = None
    revision: str | None = None
    # tensor name -> safetensors file that holds it
    files: dict[str, Path] = field(default_factory=dict)
    _open: dict[Path, dict[str, mx.array]] = field(default_factory=dict)
    _ranges: dict[Path, dict[str, tuple[int, int]]] = field(default_factory=dict)

    def peek(self, names: list[str]) -> dict[str, mx.array]:
        """Lazy arrays for `names` without reading data (for shapes and names)."""
        return {n: self._file(self.files[n])[n] for n in names}

    def take(self, names: list[str]) -> dict[str, mx.array]:
        """Lazy arrays for `names`, forgotten here so memory goes with the caller."""
        return {n: self._file(self.files[n]).pop(n) for n in names}

    def lend(self, names: list[str]) -> dict[str, mx.array]:
        """Lazy arrays for `names` from a fresh open: never the objects `take`
        hands out, so holding them never keeps evaluated data alive."""
        opened: dict[Path, dict[str, mx.array]] = {}
        for n in names:
            path = self.files[n]
            if path not in opened:
                opened[path] = mx.load(str(path))
        return {n: opened[self.files[n]][n] for n in names}

    def prefetch(self, names: list[str]) -> None:
        """Start reading `names` (the next layer) into the page cache, in the
        background, so disk reads overlap the current layer's quantization."""
        if not hasattr(os, "posix_fadvise"):  # macOS: no read-ahead hint
            return
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.files[n]].append(n)
        for path, tensors in by_file.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                offsets = self._offsets(path, fd)
                for start, end in (offsets[n] for n in tensors if n in offsets):
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _offsets(self, path: Path, fd: int) -> dict[str, tuple[int, int]]:
        """Byte range of each tensor in a safetensors file, from its header."""
        if path not in self._ranges:
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            try:
                header = json.loads(os.pread(fd, n, 8))
            except ValueError:  # mx.load reports a broken file when it is read
                header = {}
            self._ranges[path] = {
                k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                for k, v in header.items()
                if isinstance(v, dict) and "data_offsets" in v
            }
        return self._ranges[path]

    def _file(self, path: Path) -> dict[str, mx.array]:
        if path not in self._open:
            try:
                self._open[path] = mx.load(str(path))
            except Exception as e:  # mx.load raises bare RuntimeError/ValueError
                raise SourceError(f"Cannot read {path}: {e}.") from e
        return self._open[path]

    def tokenizer_files(self) -> list[Path]:
        found = [self.path / f for f in TOKENIZER_FILES if (self.path / f).is_file()]
        for pattern in TOKENIZER_GLOBS:
            found += sorted(self.path.glob(pattern))
        return found


def resolve(source: str, revision: str | None = None) -> tuple[Path, str | None]:
    """Local directory as is; otherwise download the needed files of a hub repo."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise SourceError(f"{source} is a file; pass a checkpoint directory or hub id.")
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise SourceError(
            f"{source} is neither a directory nor a Hugging Face repo id "
            "(like Qwen/Qwen3-30B-A3B); check the path."
        )
    from huggingface_hub import snapshot_download

    log.info("downloading %s (revision %s)", source, revision or "default")
    try:
        local = snapshot_download(
            source,
            revision=revision,
            allow_patterns=HUB_PATTERNS,
            ignore_patterns=HUB_IGNORE,
        )
    except Exception as e:  # hub errors are many and specific; keep their text
        detail = " ".join(str(e).split())  # hub errors span several lines
        raise SourceError(f"Cannot download {source}: {detail}") from e
    return Path(local), revision


def open_source(source: str, revision: str | None = None) -> Source:
    path, revision = resolve(source, revision)
    if (path / "manifest.json").is_file():
        raise SourceError(
            f"{path} is already a moestream model (it has manifest.json); run it "
            "with run-moe, or convert the original checkpoint."
        )
    config = normalize_config(_read_config(path))
    src = Source(
        path, config, None if path == Path(source).expanduser() else source, revision
    )
    src.files, src._open = _tensor_files(path)
    if not src.tokenizer_files() or not any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        raise SourceError(
            f"No tokenizer in {path} (tokenizer.json, tokenizer.model or vocab.json); "
            "add the tokenizer files of the model."
        )
    return src


def _read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise SourceError(f"{path} has no config.json; is it a model checkpoint?")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{cfg} is not valid JSON: {e}.") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise SourceError(f"{cfg} has no model_type.")
    return config


def _tensor_files(path: Path) -> tuple[dict[str, Path], dict]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _weight_map(index)
        files = {}
        for name, fname in weight_map.items():
            f = path / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise SourceError(
                    f"{index.name} names {fname!r}, outside {path}; refusing it."
                )
            if not f.is_file():
                raise SourceError(
                    f"Shard {fname} named in {index.name} is missing; download it."
                )
            files[name] = f
        return files, {}
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise SourceError(
                f"{path} holds only pickle weights ({', '.join(sorted(pickles))}), "
                "which are never loaded; use a safetensors checkpoint."
            )
        raise SourceError(f"No *.safetensors weights in {path}.")
    files, opened = {}, {}
    for shard in shards:
        try:
            opened[shard] = mx.load(str(shard))
        except Exception as e:  # mx.load raises bare RuntimeError/ValueError
            raise SourceError(f"Cannot read {shard}: {e}.") from e
        files.update(dict.fromkeys(opened[shard], shard))
    return files, opened


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise SourceError(f"{index} is not a valid index: {e}.") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise SourceError(f"{index} has no weight_map of tensor -> file names.")
    return weight_map


def group_by_layer(
    names: list[str], layer_of: Callable[[str], int | None]
) -> tuple[dict[int, list[str]], list[str]]:
    """Split tensor names into per-layer lists and the rest (embeddings, head)."""
    layers: dict[int, list[str]] = defaultdict(list)
    rest = []
    for n in sorted(names):
        layer = layer_of(n)
        if layer is None:
            rest.append(n)
        else:
            layers[layer].append(n)
    return dict(sorted(layers.items())), rest
