"""A tiny HF checkpoint rewritten into the other layouts users arrive with.

Fused experts (transformers >= 5), FP8 block-quantized (DeepSeek-V3 / Qwen3-FP8)
and MLX-quantized (by mlx_lm.convert itself), for tests of the converter's
source layouts. The weights are the same as the per-expert source's, so each
conversion can be compared with converting that source.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from .synthetic import write_hf_model

FUSED_STYLES = ("gate_up", "gate_up_transposed", "stacked")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def read_hf(path: Path) -> tuple[dict, dict[str, mx.array]]:
    """config.json and every tensor of a (tiny) safetensors checkpoint."""
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return json.loads((path / "config.json").read_text()), weights


def _write(src: Path, dst: Path, config: dict, weights: dict, shards: int) -> Path:
    write_hf_model(dst, config, weights, shards)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # identical bytes
        shutil.copyfile(src / f, dst / f)
    return dst


def fuse_experts(
    config: dict, w: dict[str, mx.array], style: str = "gate_up"
) -> dict[str, mx.array]:
    """Stack each layer's per-expert tensors in `w` the way `style` stores them."""
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in w:
            continue
        stack = {
            proj: mx.stack(
                [w.pop(f"{p}.{e}.{proj}.weight") for e in range(config["num_experts"])]
            )
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        if style == "stacked":
            w.update({f"{p}.{k}.weight": v for k, v in stack.items()})
            continue
        fused = {
            "gate_up_proj": mx.concatenate(
                [stack["gate_proj"], stack["up_proj"]], axis=1
            ),
            "down_proj": stack["down_proj"],
        }
        if style == "gate_up_transposed":
            fused = {k: v.swapaxes(1, 2) for k, v in fused.items()}
        w.update({f"{p}.{k}": v for k, v in fused.items()})
    return w


def to_fused(
    src: Path, dst: Path, style: str = "gate_up", shards: int | None = None
) -> Path:
    """Experts stacked per layer: `experts.gate_up_proj` [E, 2I, H] + `down_proj`
    [E, H, I] (transformers >= 5), the same transposed, or `experts.gate_proj.weight`
    [E, I, H] per projection ("stacked"). Default: every tensor in its own shard."""
    config, w = read_hf(src)
    w = fuse_experts(config, w, style)
    return _write(src, dst, config, w, shards or len(w))


def fp8_quantizable(name: str) -> bool:
    """Which tensors Qwen3-FP8 stores in FP8: linear layers (and fused experts),
    not the router, embeddings or head."""
    return name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj"))


def fp8_block_quantize(
    w: mx.array, block: tuple[int, int]
) -> tuple[mx.array, mx.array]:
    """(float8 e4m3 bytes, float32 scale_inv per block) with w ~ fp8 * scale."""
    if w.ndim == 3:  # stacked experts: blocks per expert
        q, s = zip(*(fp8_block_quantize(x, block) for x in w), strict=True)
        return mx.stack(q), mx.stack(s)
    m, n = w.shape
    bo, bi = block
    pad = mx.pad(w.astype(mx.float32), ((0, -m % bo), (0, -n % bi)))
    blocks = pad.reshape(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi)
    scale = mx.maximum(mx.abs(blocks).max(axis=(1, 3)), 1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:m, :n]
    return mx.to_fp8(q), scale


def fp8_weights(
    w: dict[str, mx.array],
    block: tuple[int, int],
    keep: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Replace linear weights in `w` by FP8 + `weight_scale_inv`; the FP8 names."""
    fp8 = {n for n in w if fp8_quantizable(n)}
    for name in sorted(fp8):
        w[name], scale = fp8_block_quantize(w[name], block)
        if not keep(name):
            w[f"{name}_scale_inv"] = scale
    return fp8


def fp8_config(config: dict, block: tuple[int, int]) -> dict:
    return {
        **config,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        },
    }


def to_fp8(
    src: Path,
    dst: Path,
    block: tuple[int, int] = (128, 128),
    shards: int = 2,
    keep: Callable[[str], bool] = lambda name: False,
) -> Path:
    """Linear weights as float8_e4m3fn + `weight_scale_inv`, as Qwen3-FP8 ships them.

    `keep(name)` drops that tensor's scale (to test the refusal)."""
    config, w = read_hf(src)
    fp8 = fp8_weights(w, block, keep)
    _write(src, dst, fp8_config(config, block), w, shards)
    for f in dst.glob("*.safetensors"):
        mark_float8(f, fp8)
    return dst


def rewrite_shards(src: Path, dst: Path, layout: str) -> Path:
    """A large checkpoint (one layer per shard) in `layout` ("fused" or "fp8"),
    one shard at a time so memory stays at one layer."""
    config = json.loads((src / "config.json").read_text())
    if layout == "fp8":
        config = fp8_config(config, (128, 128))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dst.mkdir(parents=True)
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        w = dict(mx.load(str(src / shard)))
        fp8: set[str] = set()
        if layout == "fused":
            w = fuse_experts(config, w)
        else:
            fp8 = fp8_weights(w, (128, 128))
        mx.save_safetensors(str(dst / shard), w, {"format": "pt"})
        mark_float8(dst / shard, fp8)
        weight_map.update(dict.fromkeys(w, shard))
        del w
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)
    return dst


def mark_float8(path: Path, names: set[str]) -> None:
    """Relabel uint8 tensors `names` as F8_E4M3, as torch writes float8_e4m3fn."""
    if not names:
        return
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for name, info in header.items():
        if name in names:
            assert info["dtype"] == "U8", (name, info)
            info["dtype"] = "F8_E4M3"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def to_mlx(
    src: Path,
    dst: Path,
    bits: int = 4,
    group_size: int = 64,
    quant_predicate: str | Callable | None = None,
    mode: str = "affine",
) -> Path:
    """What mlx-community uploads: mlx_lm.convert -q with these settings."""
    from mlx_lm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):  # convert prints its progress
        convert(
            str(src),
            str(dst),
            quantize=True,
            q_bits=bits,
            q_group_size=group_size,
            q_mode=mode,
            quant_predicate=quant_predicate,
        )
    return dst
