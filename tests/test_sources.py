"""Checkpoint sources: fused experts, FP8 blocks and MLX-quantized checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from builders.synthetic import write_hf_model
from builders.synthetic_sources import (
    FUSED_STYLES,
    fp8_quantizable,
    read_hf,
    to_fp8,
    to_fused,
    to_mlx,
)
from click.testing import CliRunner
from helpers import BITS, same_files

import moestream
from moestream.cli.convert import main as convert_main
from moestream.converter import SourceError, convert
from moestream.converter.layouts import dequantize_fp8
from moestream.formats import BlobReader, load_manifest
from moestream.formats.manifest import inside
from moestream.reference import resident_model

PROMPT = mx.array([[(5 * i + 1) % 300 for i in range(40)]])


def shard_of(path: Path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


# --- fused / stacked experts -------------------------------------------------


@pytest.mark.parametrize("style", FUSED_STYLES)
def test_fused_experts_convert_byte_identical(hf_dir, converted, tmp_path, style):
    src = to_fused(hf_dir, tmp_path / "src", style)
    if style != "stacked":  # one tensor per shard: a layer is read across shards
        names = shard_of(src)
        fused = [
            f"model.layers.2.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")
        ]
        assert names[fused[0]] != names[fused[1]]
    summary = convert(str(src), tmp_path / "out", bits=BITS, progress=False)
    assert summary.source_layout == "fused expert tensors"
    same_files(converted, tmp_path / "out")


def test_fused_container_mapped_per_family(hf_dir, converted, tmp_path, monkeypatch):
    """A family whose fused experts live under another module than per-expert ones
    (as transformers >= 5 renames mixtral's block_sparse_moe to mlp)."""
    from moestream.converter import layouts

    fused = to_fused(hf_dir, tmp_path / "fused", shards=2)
    config, w = read_hf(fused)
    w = {k.replace("mlp.experts.", "moe.experts."): v for k, v in w.items()}
    src = write_hf_model(tmp_path / "src", config, w, 2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf_dir / f, src / f)
    names = layouts.ExpertNames(containers=(("moe.experts", "mlp.experts"),))
    monkeypatch.setitem(layouts.EXPERT_NAMES, "qwen3_moe", names)
    convert(str(src), tmp_path / "out", bits=BITS, progress=False)
    same_files(converted, tmp_path / "out")


def test_fused_expert_shape_mismatch_refused(hf_dir, tmp_path):
    src = to_fused(hf_dir, tmp_path / "src", "gate_up", shards=1)
    config, w = read_hf(src)
    key = "model.layers.2.mlp.experts.gate_up_proj"
    w[key] = mx.concatenate([w[key], w[key][:, :64]], axis=1)  # [E, 3I, H]
    write_hf_model(tmp_path / "bad", config, w, 1)
    with pytest.raises(
        SourceError, match=r"experts\.gate_up_proj has shape \(8, 192, 128\).*"
    ):
        convert(str(tmp_path / "bad"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- FP8 block-quantized -----------------------------------------------------


def e4m3_to_float32(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float32, from the bit layout (sign, 4 exp, 3 mantissa)."""
    b = b.astype(np.int64)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return (np.where(b & 0x80, -1.0, 1.0) * value).astype(np.float32)


def test_dequantize_fp8_by_hand():
    # 1.0, 2.0, -1.0, 0.5 in e4m3; a 130 x 3 tensor has a partial second row block
    w = np.full((130, 3), 0x38, np.uint8)  # 1.0 everywhere
    w[0, :2] = [0x40, 0xB8]  # 2.0, -1.0
    w[129, 2] = 0x30  # 0.5
    scale = mx.array([[0.25], [3.0]])
    got = np.array(dequantize_fp8(mx.array(w), scale, (128, 128)))
    want = np.full((130, 3), 0.25, np.float32)
    want[0, :2] = [0.5, -0.25]
    want[128:] = 3.0
    want[129, 2] = 1.5
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        e4m3_to_float32(w), np.array(mx.from_fp8(mx.array(w), mx.float32))
    )


@pytest.mark.parametrize(
    "block, fused", [((128, 128), False), ((48, 40), False), ((48, 40), True)]
)
def test_fp8_converts_as_its_dequantized_weights(hf_dir, tmp_path, block, fused):
    """FP8 + block scales equal the float weights they stand for (numpy dequant)."""
    if fused:  # FP8 fused experts: [E, 2I, H] with [E, 2I/48, H/40] scales
        hf_dir = to_fused(hf_dir, tmp_path / "fused", shards=2)
    src = to_fp8(hf_dir, tmp_path / "fp8", block)
    header = (src / "model-00001-of-00002.safetensors").read_bytes()[:4096]
    assert b"F8_E4M3" in header  # stored as torch stores float8_e4m3fn
    config, w = read_hf(src)
    bo, bi = block
    for name in [n for n in w if fp8_quantizable(n)]:
        *_, m, n = w[name].shape
        scale = np.array(w.pop(f"{name}_scale_inv"))
        scale = np.repeat(np.repeat(scale, bo, -2), bi, -1)[..., :m, :n]
        w[name] = mx.array(e4m3_to_float32(np.array(w[name])) * scale)
    del config["quantization_config"]
    ref = write_hf_model(tmp_path / "ref", config, w)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, ref / f)
    summary = convert(str(src), tmp_path / "a", bits=BITS, progress=False)
    assert summary.source_layout.startswith(f"fp8 e4m3 in {bo}x{bi} blocks")
    convert(str(ref), tmp_path / "b", bits=BITS, progress=False)
    same_files(tmp_path / "a", tmp_path / "b")


def test_fp8_without_scale_refused(hf_dir, tmp_path):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    src = to_fp8(hf_dir, tmp_path / "fp8", keep=lambda n: n == name)
    with pytest.raises(
        SourceError, match=rf"FP8 tensor {name} has no {name}_scale_inv"
    ):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_fp8_wrong_block_size_refused(hf_dir, tmp_path):
    src = to_fp8(hf_dir, tmp_path / "fp8", (64, 64))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        SourceError, match=r"_scale_inv of shape .* check weight_block_size"
    ):
        convert(str(src), tmp_path / "out", progress=False)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_unknown_quant_method_refused(hf_dir, tmp_path, method):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    r = CliRunner().invoke(convert_main, [str(src), str(tmp_path / "out")])
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line and f"quantized with '{method}'" in line
    assert "fp8" in line and "MLX-quantized" in line
    assert not (tmp_path / "out").exists()


# --- MLX-quantized -----------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_mlx(hf_dir, tmp_path_factory.mktemp("mlx") / "tiny-4bit")


def assert_experts_are_source_bytes(out: Path, src: Path, projections) -> None:
    _, w = read_hf(src)
    manifest = load_manifest(out)
    for layer in manifest.layers:
        with BlobReader(inside(out, layer.file), layer) as blob:
            for e in range(layer.num_experts):
                record = blob.record(e)
                for seg in layer.segments:
                    if seg.name.split(".")[0] not in projections:
                        continue
                    stored = w[f"{layer.module}.{seg.name}"][e]
                    assert blob.segment(record, seg).tobytes() == bytes(stored), (
                        layer.layer,
                        e,
                        seg.name,
                    )


def assert_exact(out: Path, ref) -> None:
    model, _ = moestream.load(out, cache_experts=3)
    assert mx.array_equal(model(PROMPT), ref(PROMPT)).item()


def test_mlx_source_repacked_without_requantizing(mlx_dir, tmp_path):
    summary = convert(str(mlx_dir), tmp_path / "out", progress=False)
    out = tmp_path / "out"
    recipe = load_manifest(out).recipe
    assert recipe.experts == {"down_proj": 4, "gate_proj": 4, "up_proj": 4}
    assert (recipe.group_size, recipe.dense_bits, recipe.overrides) == (64, 4, ())
    assert "re-quantized" not in " ".join(summary.notes)
    assert_experts_are_source_bytes(out, mlx_dir, ("gate_proj", "up_proj", "down_proj"))
    _, source = read_hf(mlx_dir)
    dense = mx.load(str(out / "dense.safetensors"))
    assert dense and all(
        v.dtype == source[k].dtype and bytes(v) == bytes(source[k])
        for k, v in dense.items()
    )
    assert_exact(out, resident_model(mlx_dir, recipe))


def test_mlx_source_requantized_where_bits_differ(mlx_dir, tmp_path):
    r = CliRunner().invoke(
        convert_main, [str(mlx_dir), str(tmp_path / "out"), "--bits", "down_proj=8"]
    )
    assert r.exit_code == 0, r.output
    assert "re-quantized:    down_proj (4-bit g64 -> 8-bit g64)" in r.output
    assert "GB/s" in r.output and "peak RSS" in r.output
    out = tmp_path / "out"
    recipe = load_manifest(out).recipe
    assert recipe.expert_spec("down_proj", 2).bits == 8
    assert load_manifest(out).layers[0].segment("down_proj.weight").bits == 8
    assert_experts_are_source_bytes(out, mlx_dir, ("gate_proj", "up_proj"))
    assert_exact(out, resident_model(mlx_dir, recipe))


def test_mlx_mixed_bits_source_kept_per_layer(hf_dir, tmp_path):
    """mlx-lm's mixed_4_6 recipe: 6-bit down_proj in some layers, per-path config."""
    src = to_mlx(hf_dir, tmp_path / "mixed", quant_predicate="mixed_4_6")
    config = json.loads((src / "config.json").read_text())
    assert (
        config["quantization"]["model.layers.2.mlp.switch_mlp.down_proj"]["bits"] == 6
    )
    convert(str(src), tmp_path / "out", progress=False)
    manifest = load_manifest(tmp_path / "out")
    assert manifest.layers[0].segment("down_proj.weight").bits == 4
    assert manifest.layers[1].segment("down_proj.weight").bits == 6
    assert_experts_are_source_bytes(
        tmp_path / "out", src, ("gate_proj", "up_proj", "down_proj")
    )
    assert_exact(tmp_path / "out", resident_model(src, manifest.recipe))


def test_mlx_mxfp4_source_refused_or_requantized(hf_dir, tmp_path):
    src = to_mlx(hf_dir, tmp_path / "fp4", bits=4, group_size=32, mode="mxfp4")
    with pytest.raises(SourceError, match=r"mode\(s\) \['mxfp4'\].*Pass --bits"):
        convert(str(src), tmp_path / "out", progress=False)
    summary = convert(str(src), tmp_path / "out", bits="down_proj=4", progress=False)
    assert "down_proj (4-bit g32 mxfp4 -> 4-bit g32)" in summary.notes[0]
    recipe = load_manifest(tmp_path / "out").recipe
    assert_exact(tmp_path / "out", resident_model(src, recipe))


def test_mlx_source_with_mixed_group_sizes_needs_a_group_size(hf_dir, tmp_path):
    def predicate(path, module):
        return {"group_size": 32, "bits": 4} if path.endswith("gate_proj") else True

    src = to_mlx(hf_dir, tmp_path / "g", quant_predicate=predicate)
    with pytest.raises(SourceError, match=r"group sizes \[32, 64\].*--q-group-size"):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    convert(str(src), tmp_path / "out", q_group_size=64, progress=False)
    recipe = load_manifest(tmp_path / "out").recipe
    assert_exact(tmp_path / "out", resident_model(src, recipe))


def test_converted_model_as_source_refused(converted, tmp_path):
    with pytest.raises(SourceError, match=r"already a moestream model.*run-moe"):
        convert(str(converted), tmp_path / "out", progress=False)


@pytest.mark.parametrize("layout", ["per-expert", "fused", "fp8", "mlx"])
def test_every_layout_is_read_one_layer_at_a_time(
    hf_dir, mlx_dir, tmp_path, monkeypatch, layout
):
    from moestream.converter.source import Source

    src = {
        "per-expert": lambda: hf_dir,
        "fused": lambda: to_fused(hf_dir, tmp_path / "src"),
        "fp8": lambda: to_fp8(hf_dir, tmp_path / "src"),
        "mlx": lambda: mlx_dir,
    }[layout]()
    taken, opened = [], []
    take = Source.take

    def recording_take(self, names):
        taken.append({n.split(".")[2] if ".layers." in n else "rest" for n in names})
        opened.append(self._open)
        return take(self, names)

    monkeypatch.setattr(Source, "take", recording_take)
    convert(str(src), tmp_path / "out", progress=False)
    assert taken == [{"0"}, {"1"}, {"2"}, {"rest"}]
    assert not any(opened[0].values())  # every lazily opened tensor handed on
