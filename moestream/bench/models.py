"""Synthetic Qwen3-MoE models at benchmark scale, written straight into format v1.

Quantized expert records are random words with sane scales and biases
(dequantized weights uniform in +-1/sqrt(fan_in)), so a 32 GB model is written
at disk speed without ever holding a layer of floats. The dense part comes
from mlx-lm's own initialisation, quantized as the converter does.
`export_mlx` writes the same weights as an mlx-lm directory (the resident
reference loads it with `mlx_lm.load`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import __version__
from ..converter.pack import module_quantization, quantize_unit
from ..families import build_model, layer_index, module_at, switch_modules
from ..formats import (
    BlobReader,
    ExpertLayer,
    Manifest,
    ModelWriter,
    Recipe,
    blocked,
    blocked_layout,
    layer_layout,
    load_manifest,
)
from ..formats.dtypes import gather_max_abs
from ..formats.manifest import inside, with_max_abs
from .tokenizer import write_tokenizer


@dataclass(frozen=True)
class Scale:
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    vocab: int = 8192

    def config(self) -> dict:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 0,
            "hidden_size": self.hidden,
            "intermediate_size": 4 * self.hidden,
            "moe_intermediate_size": self.moe_intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "mlp_only_layers": [],
            "vocab_size": self.vocab,
            "max_position_embeddings": 32768,
        }

    def expert_bytes(self, bits: int = 4, group_size: int = 64) -> int:
        params = 3 * self.hidden * self.moe_intermediate
        per_expert = params * bits // 8 + 2 * 2 * params // group_size
        return self.layers * self.experts * per_expert


SCALES = {
    # The model of the comparison table (~1 GB of experts).
    "small": Scale(16, 64, 8, 1024, 512),
    # Fits in RAM (~8 GB of experts).
    "medium": Scale(24, 128, 8, 2048, 768, heads=32, head_dim=64),
    # Bigger than a 24 GB machine's RAM (~33 GB of experts).
    "large": Scale(48, 256, 8, 2048, 768, heads=32, head_dim=64),
}


def write_synthetic(
    out: Path,
    scale: Scale,
    recipe: Recipe | None = None,
    seed: int = 0,
    layout: str = "rows",
) -> Manifest:
    """Write a complete converted model of `scale` to `out` (temp dir, then
    rename); `layout` "blocked" stores the same values as convert-moe --layout
    blocked would."""
    recipe = recipe or Recipe()
    config = scale.config()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "experts").mkdir(parents=True)
    writer = ModelWriter(tmp)
    try:
        manifest = _write_into(writer, config, recipe, scale, seed, layout)
        writer.publish(out)
    except BaseException:
        shutil.rmtree(writer.directory, ignore_errors=True)
        raise
    return manifest


def _write_into(
    writer: ModelWriter,
    config: dict,
    recipe: Recipe,
    scale: Scale,
    seed: int,
    layout: str,
) -> Manifest:
    mx.random.seed(seed)
    model = build_model(config)
    # bfloat16, as the manifest says and as a bfloat16 checkpoint converts:
    # the dense layers' scales and biases come out bfloat16 too.
    model.set_dtype(mx.bfloat16)
    switches = {p: layer_index(p) for p in switch_modules(model)}
    quantization = recipe.dense.to_mlx()
    modules = dict(model.named_modules())
    dense = {
        k: v
        for k, v in tree_flatten(model.parameters())
        if not any(k.startswith(s + ".") for s in switches)
    }
    predicate = module_quantization(model, recipe)
    # No source layout: freshly initialised floats, never pre-quantized.
    writer.add_dense(quantize_unit(dense, modules, predicate, quantization, None))
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**32, 1 << 24, dtype=np.uint32)  # 64 MB of random words
    for spath, layer in sorted(switches.items(), key=lambda kv: kv[1]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            quantization[f"{spath}.{proj}"] = recipe.expert_spec(proj, layer).to_mlx()
        _write_layer(writer, spath, layer, model, quantization, pool, rng, layout)
    writer.close_tensors()
    writer.write_config(config, quantization)
    write_tokenizer(writer.directory)
    return writer.write_manifest(
        model_type=config["model_type"],
        dtype="bfloat16",
        recipe=recipe,
        source={"repo_id": f"synthetic:{scale}", "revision": str(seed)},
        created_by=f"moestream {__version__}",
    )


def _write_layer(
    writer: ModelWriter,
    spath: str,
    layer: int,
    model: nn.Module,
    quantization: dict,
    pool: np.ndarray,
    rng: np.random.Generator,
    layout: str,
) -> ExpertLayer:
    switch = module_at(model, spath)
    shapes = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        q = quantization[f"{spath}.{proj}"]
        num_experts, out_dim, in_dim = switch[proj]["weight"].shape
        shapes[proj] = (out_dim, in_dim, q["bits"], q["group_size"], q)
    spec = []
    for proj, (o, i, bits, gs, q) in shapes.items():
        spec.append((f"{proj}.weight", "uint32", (o, i * bits // 32), q))
        spec.append((f"{proj}.scales", "bfloat16", (o, i // gs), q))
        spec.append((f"{proj}.biases", "bfloat16", (o, i // gs), q))
    entry = layer_layout(layer, spath, num_experts, spec)
    if layout == "blocked":
        entry = blocked_layout(entry)
    maxima: dict[str, float | None] = {}
    written = writer.add_layer(entry, _records(entry, shapes, pool, rng, maxima))
    # Each projection's largest scale, recorded as the converter records it.
    writer.layers[-1] = with_max_abs(written, lambda s: maxima[s.name])
    return writer.layers[-1]


def _records(
    entry: ExpertLayer,
    shapes: dict,
    pool: np.ndarray,
    rng: np.random.Generator,
    maxima: dict[str, float | None],
) -> Iterator[bytes]:
    """Random 4-bit words; scale and bias map the 0..15 codes onto +-1/sqrt(fan_in).
    `maxima` gathers each float segment's largest |value| (Segment.max_abs)."""
    for _ in range(entry.num_experts):
        buf = bytearray(entry.record_nbytes)
        for seg in entry.segments:
            proj, _, kind = seg.name.partition(".")
            _, in_dim, bits, _, _ = shapes[proj]
            n = seg.nbytes // (4 if kind == "weight" else 2)
            if kind == "weight":
                start = int(rng.integers(0, pool.size - n))
                data = pool[start : start + n].tobytes()
            else:
                a = 1.0 / np.sqrt(in_dim)
                levels = (1 << bits) - 1
                value = 2 * a / levels if kind == "scales" else -a
                jitter = 1 + 0.25 * rng.standard_normal(n).astype(np.float32)
                words = _bf16(value * jitter)
                gather_max_abs(maxima, seg.name, words, seg.dtype)
                data = words.tobytes()
            if seg.blocked:  # the same values, stored as the kernel reads them
                dtype = np.uint32 if kind == "weight" else np.uint16
                data = blocked(np.frombuffer(data, dtype).reshape(seg.shape)).tobytes()
            buf[seg.offset : seg.offset + seg.nbytes] = data
        yield bytes(buf)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words, rounding to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def export_mlx(converted: Path, out: Path) -> Path:
    """The same weights as an mlx-lm directory: one safetensors shard per MoE layer."""
    manifest = load_manifest(converted)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    for name in manifest.dense_files:
        shutil.copyfile(inside(converted, name), tmp / f"model-{name}")
        for key in mx.load(str(tmp / f"model-{name}")):
            weight_map[key] = f"model-{name}"
    for layer in manifest.layers:
        shard = f"model-experts-{layer.layer:03d}.safetensors"
        with BlobReader(inside(converted, layer.file), layer) as blob:
            records = [blob.record(e) for e in range(layer.num_experts)]
            arrays = {}
            for seg in layer.segments:
                stack = mx.array(np.stack([blob.segment(r, seg) for r in records]))
                if seg.dtype == "bfloat16":
                    stack = stack.view(mx.bfloat16)
                arrays[f"{layer.module}.{seg.name}"] = stack
            del records
        mx.save_safetensors(str(tmp / shard), arrays, {"format": "mlx"})
        weight_map.update(dict.fromkeys(arrays, shard))
        del arrays
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})
    )
    for f in converted.iterdir():
        if f.is_file() and not f.name.startswith(("dense", "manifest")):
            shutil.copyfile(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
