"""Format v1: round trip, deterministic bytes, and every bad input refused clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import edit_manifest

import moestream
from moestream.converter import ConvertError, SourceError, convert
from moestream.families import UnsupportedModelError
from moestream.formats import (
    BlobReader,
    ExpertLayer,
    FormatError,
    load_manifest,
    pack_record,
    record_layout,
    stride_for,
    write_blob,
)
from moestream.formats.manifest import PAGE_SIZE
from moestream.runtime import ExpertReadError


def test_blob_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = [
        ("a.weight", "uint32", (3, 5), {"bits": 4, "group_size": 64, "mode": "affine"}),
        ("a.scales", "bfloat16", (3, 1), None),
        ("b.bias", "float32", (7,), None),
    ]
    segments, nbytes = record_layout(tensors)
    assert all(s.offset % 64 == 0 for s in segments)
    layer = ExpertLayer(
        4, "m", "x.blob", 3, stride_for(nbytes), PAGE_SIZE, nbytes, segments, ("",) * 3
    )
    experts = [
        {
            "a.weight": rng.integers(0, 2**32, (3, 5), dtype=np.uint32),
            "a.scales": rng.integers(0, 2**16, (3, 1), dtype=np.uint16),
            "b.bias": rng.standard_normal(7).astype(np.float32),
        }
        for _ in range(3)
    ]
    sums = write_blob(
        tmp_path / "x.blob", layer, (pack_record(segments, nbytes, e) for e in experts)
    )
    layer = ExpertLayer(**{**layer.__dict__, "checksums": tuple(sums)})
    assert (tmp_path / "x.blob").stat().st_size == PAGE_SIZE + 3 * layer.stride
    assert layer.stride % PAGE_SIZE == 0
    with BlobReader(tmp_path / "x.blob", layer) as r:
        for e, want in enumerate(experts):
            assert r.verify(e)
            rec = r.record(e)
            for s in segments:
                np.testing.assert_array_equal(r.segment(rec, s), want[s.name])
            del rec


def test_manifest_round_trip(converted: Path) -> None:
    m = load_manifest(converted)
    assert m.version == 1 and m.model_type == "qwen3_moe"
    assert [layer.layer for layer in m.layers] == [0, 2]  # layer 1 is a dense MLP
    down = m.layers[1].segment("down_proj.weight")
    assert (down.bits, down.group_size, down.mode) == (8, 64, "affine")
    assert m.layers[0].segment("up_proj.weight").bits == 3
    again = json.loads(m.to_json())
    assert again["expert_bytes"] == m.expert_bytes
    assert all(
        layer.data_offset % PAGE_SIZE == 0 == layer.stride % PAGE_SIZE
        for layer in m.layers
    )


def test_conversion_is_deterministic(
    hf_dir: Path, converted: Path, tmp_path: Path
) -> None:
    from helpers import BITS

    again = tmp_path / "again"
    convert(str(hf_dir), again, bits=BITS, progress=False)
    files = sorted(
        p.relative_to(converted) for p in converted.rglob("*") if p.is_file()
    )
    assert files == sorted(
        p.relative_to(again) for p in again.rglob("*") if p.is_file()
    )
    for f in files:
        assert (converted / f).read_bytes() == (again / f).read_bytes(), f


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=99), "Unsupported format version 99"),
        (lambda d: d["layers"][0].update(file="../../etc/passwd"), "escapes"),
        (lambda d: d["layers"][0].update(file="/etc/passwd"), "escapes"),
        (lambda d: d["layers"][0].update(stride=1000), "not a positive multiple"),
        (lambda d: d["layers"][0]["segments"][0].update(offset=-64), "aligned"),
        (lambda d: d["layers"][0]["segments"][1].update(offset=0), "overlaps"),
        (lambda d: d["layers"][0]["segments"][0].update(nbytes=12), "does not match"),
        (lambda d: d["layers"][0]["segments"][0].update(dtype="int4"), "unknown dtype"),
        (lambda d: d["layers"][0].update(checksums=[]), "checksums"),
        (lambda d: d["layers"][0].update(num_experts=10**9), "absurd"),
        (lambda d: d["layers"][1].update(layer=0), "repeated"),
        (lambda d: d.update(format="other"), "not a moestream manifest"),
        (lambda d: d["layers"][0].update(stride="16384"), "Expected an integer"),
    ],
)
def test_bad_manifest_refused(copy: Path, edit, message: str) -> None:
    edit_manifest(copy, edit)
    with pytest.raises(FormatError, match=message):
        load_manifest(copy)


def test_malformed_json_refused(copy: Path) -> None:
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_manifest(copy)


def test_symlink_outside_refused(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.blob"
    shutil.move(copy / "experts/layer-000.blob", outside)
    (copy / "experts/layer-000.blob").symlink_to(outside)
    with pytest.raises(FormatError, match="outside"):
        load_manifest(copy)


def test_missing_blob_refused(copy: Path) -> None:
    (copy / "experts/layer-002.blob").unlink()
    with pytest.raises(FormatError, match="missing"):
        moestream.load(copy)


@pytest.mark.parametrize("change, message", [(-1, "truncated"), (4096, "extended")])
def test_resized_blob_refused(copy: Path, change: int, message: str) -> None:
    blob = copy / "experts/layer-000.blob"
    size = blob.stat().st_size
    with open(blob, "r+b") as f:
        f.truncate(size + change)
    with pytest.raises(FormatError, match=message):
        moestream.load(copy)


def test_header_mismatch_refused(copy: Path) -> None:
    import struct
    import zlib

    from moestream.formats.blob import HEADER

    blob = copy / "experts/layer-000.blob"
    data = bytearray(blob.read_bytes())
    fields = list(HEADER.unpack_from(data))
    fields[2] = 2  # claims to be layer 2, with a valid header checksum
    head = HEADER.pack(*fields)
    data[: len(head) + 4] = head + struct.pack("<I", zlib.crc32(head))
    blob.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="Header"):
        moestream.load(copy)


def test_flipped_byte_stops_generation(copy: Path) -> None:
    m = load_manifest(copy)
    layer = m.layers[0]
    blob = copy / layer.file
    data = bytearray(blob.read_bytes())
    data[layer.data_offset + 3 * layer.stride + 100] ^= 0x01  # expert 3
    blob.write_bytes(bytes(data))
    model, _ = moestream.load(copy, cache_experts=4)
    with pytest.raises(ExpertReadError, match=r"Expert 3 of layer 0.*checksum"):
        mx.eval(model(mx.array([list(range(64))])))
    with pytest.raises(ExpertReadError, match=r"Expert 3 of layer 0.*checksum"):
        moestream.load(copy, cache_experts=8)  # all fit: all read at load


def test_missing_dense_refused(copy: Path) -> None:
    (copy / "dense.safetensors").unlink()
    with pytest.raises(FormatError, match=r"Dense weights .* missing"):
        moestream.load(copy)


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=r"manifest\.json is missing"):
        load_manifest(tmp_path)
    with pytest.raises(FormatError, match="not a directory"):
        load_manifest(tmp_path / "nope")


def test_out_exists_refused(hf_dir: Path, converted: Path) -> None:
    with pytest.raises(ConvertError, match=r"already exists.*--force"):
        convert(str(hf_dir), converted, progress=False)


def test_unsupported_model_type(hf_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModelError, match=r"'llama' is not supported.*qwen3_moe"
    ):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer(hf_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer.json").unlink()
    with pytest.raises(SourceError, match="No tokenizer"):
        convert(str(src), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == [src]  # nothing half-written


def test_hub_source_downloads_only_needed_files(
    hf_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    import huggingface_hub

    calls = {}

    def fake_snapshot_download(
        repo_id, revision=None, allow_patterns=None, ignore_patterns=None
    ):
        calls.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        calls.update(ignored=ignore_patterns)
        return str(hf_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert("org/tiny-moe", tmp_path / "out", revision="abc123", progress=False)
    assert calls["repo_id"] == "org/tiny-moe" and calls["revision"] == "abc123"
    assert "*.safetensors" in calls["patterns"] and "*.bin" not in calls["patterns"]
    assert calls["ignored"] == ["original/*"]  # gpt-oss's second copy
    source = load_manifest(tmp_path / "out").source
    assert source == {"repo_id": "org/tiny-moe", "revision": "abc123"}


def test_pickle_only_source_refused(hf_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, src / f)
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(SourceError, match=r"only pickle weights.*never loaded"):
        convert(str(src), tmp_path / "out", progress=False)


def test_missing_tensor_and_bad_shape_refused(hf_dir: Path, tmp_path: Path) -> None:
    from builders.synthetic import QWEN3_MOE, write_hf_model

    weights = dict(mx.load(str(hf_dir / "model-00001-of-00002.safetensors")))
    weights.update(mx.load(str(hf_dir / "model-00002-of-00002.safetensors")))
    broken = dict(weights)
    del broken["model.layers.2.mlp.experts.5.up_proj.weight"]
    write_hf_model(tmp_path / "a", QWEN3_MOE, broken)
    with pytest.raises(SourceError, match=r"missing tensor .*experts\.5\.up_proj"):
        convert(str(tmp_path / "a"), tmp_path / "out-a", progress=False)
    reshaped = dict(weights)
    reshaped["model.layers.0.self_attn.o_proj.weight"] = mx.zeros(
        (128, 64), mx.bfloat16
    )
    write_hf_model(tmp_path / "b", QWEN3_MOE, reshaped)
    with pytest.raises(SourceError, match=r"shape \(128, 64\).*config"):
        convert(str(tmp_path / "b"), tmp_path / "out-b", progress=False)
    assert not (tmp_path / "out-a").exists() and not (tmp_path / "out-b").exists()


@pytest.mark.parametrize(
    "bits, message",
    [
        ("gat_proj=4", r"names 'gat_proj'.*gate_proj"),
        ("down_proj@5-9=8", r"covers no MoE layer \(they are 0-2\)"),
    ],
)
def test_recipe_that_matches_nothing_refused(
    hf_dir: Path, tmp_path: Path, bits, message
) -> None:
    with pytest.raises(ConvertError, match=message):
        convert(str(hf_dir), tmp_path / "out", bits=bits, progress=False)
    assert not (tmp_path / "out").exists()
