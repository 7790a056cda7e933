"""The weights of a converted Qwen3-MoE model as a GGUF file for llama.cpp.

Read straight from the format-v1 directory (dense safetensors + expert blobs),
one tensor at a time, so a model larger than RAM is written at disk speed.
Two encodings of MLX's affine 4-bit quantization (codes q, a bfloat16 scale s
and bias b per group of 64: w = s*q + b):

- `q4_1`: the same values. A Q4_1 block (32 weights) holds float16 d and m
  with w = d*q + m, so each MLX group becomes two blocks with the same codes,
  d = s, m = b (bfloat16 -> float16 is exact for normal float16 magnitudes).
  5.0 bits per weight against MLX's 4.5.
- `q4_0`: the same bits per weight (4.5), other values: the dequantized weights
  requantized by gguf-py (symmetric, 32 weights per float16 scale).

Tensors of other bit widths are dequantized and written as Q8_0 (8 bits) or
float16; norms stay float32. The router (8 bits in MLX) is written as float32
(its dequantized values, exact).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..formats import load_manifest, unblocked
from ..formats.blob import NUMPY_DTYPES
from ..formats.dtypes import bf16_to_f32
from ..formats.manifest import inside

QUANTS = ("q4_1", "q4_0")
ARCH = "qwen3moe"
# MLX name (after "model.layers.N.") -> GGUF name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}
TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def import_gguf(source: Path | None = None) -> Any:
    """gguf-py: the installed package, else the copy in llama.cpp's source tree."""
    try:
        import gguf
    except ImportError:
        if source is None or not (source / "gguf-py" / "gguf").is_dir():
            raise ImportError(
                "gguf-py is not installed: pip install gguf, or build llama.cpp's "
                "source first (`moestream bench llama-cpp build`), which carries it."
            ) from None
        sys.path.insert(0, str(source / "gguf-py"))
        import gguf
    return gguf


@dataclass
class Tensor:
    """One GGUF tensor: its name, numpy-order logical shape, type and bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    data: Any  # np.ndarray, or a callable producing it (written one at a time)

    def array(self) -> np.ndarray:
        return self.data() if callable(self.data) else self.data


def q4_1_blocks(
    words: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> np.ndarray:
    """MLX 4-bit affine rows (uint32 words, bf16 scales/biases) -> Q4_1 block bytes.

    words (..., in/8), scales (..., in/gs) -> uint8 (..., in/32 * 20): per block
    float16 d, float16 m, then 16 bytes whose low nibbles hold weights 0-15
    and high nibbles weights 16-31 (ggml's block_q4_1).
    """
    *lead, nwords = words.shape
    n = nwords * 8
    group = n // scales.shape[-1]
    if group % 32:
        raise ValueError(f"Q4_1 needs groups of a multiple of 32 weights, not {group}.")
    raw = np.ascontiguousarray(words).view(np.uint8)  # 2 codes per byte, low first
    codes = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(*lead, n // 32, 2, 16)
    qs = codes[..., 0, :] | (codes[..., 1, :] << 4)
    per = group // 32
    d = np.repeat(bf16_to_f32(scales).astype(np.float16), per, axis=-1)
    m = np.repeat(bf16_to_f32(biases).astype(np.float16), per, axis=-1)
    head = np.stack([d, m], axis=-1).view(np.uint8)  # (..., nb, 4)
    return np.concatenate([head, qs], axis=-1).reshape(*lead, n // 32 * 20)


def dequantize(
    words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int
) -> np.ndarray:
    """MLX affine rows -> float32 (..., in)."""
    *lead, nwords = words.shape
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*lead, nwords * per_word).astype(np.float32)
    group = codes.shape[-1] // scales.shape[-1]
    s = np.repeat(bf16_to_f32(scales), group, axis=-1)
    b = np.repeat(bf16_to_f32(biases), group, axis=-1)
    return codes * s + b


def _np(a: Any) -> np.ndarray:
    """An mx.array as numpy, bfloat16 as its uint16 words."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def _quant_of(config: dict, module: str) -> dict:
    q = config.get("quantization") or {}
    own = q.get(module)
    if isinstance(own, dict):
        return own
    return {"bits": q.get("bits"), "group_size": q.get("group_size")}


def encode(
    gguf: Any, name: str, shape: tuple, load: Any, bits: int, quant: str
) -> Tensor:
    """One MLX-quantized matrix as a GGUF tensor; `load()` gives its (words,
    scales, biases) when the tensor is written, not before."""
    T = gguf.GGMLQuantizationType
    shape = (*shape[:-1], shape[-1] * 32 // bits)  # words -> weights

    def values() -> np.ndarray:
        return dequantize(*load(), bits)

    if bits == 4 and quant == "q4_1":
        return Tensor(name, shape, T.Q4_1, lambda: q4_1_blocks(*load()))
    kind = {4: T.Q4_0, 8: T.Q8_0}.get(bits)
    if kind is None:  # no llama.cpp type of these bits: the values, as float16
        return Tensor(name, shape, T.F16, lambda: values().astype(np.float16))
    return Tensor(name, shape, kind, lambda: gguf.quantize(values(), kind))


def dense_tensors(converted: Path, config: dict, quant: str, gguf: Any) -> list[Tensor]:
    import mlx.core as mx

    manifest = load_manifest(converted)
    modules: dict[str, dict] = {}
    for file in manifest.dense_files:
        for key, value in mx.load(str(inside(converted, file))).items():
            module, _, part = key.rpartition(".")
            modules.setdefault(module, {})[part] = _np(value)
    T = gguf.GGMLQuantizationType
    out = []
    for module, p in sorted(modules.items()):
        name = gguf_name(module) + ".weight"
        if "scales" not in p:  # a norm: bfloat16 words -> float32
            out.append(Tensor(name, p["weight"].shape, T.F32, bf16_to_f32(p["weight"])))
            continue
        bits = int(_quant_of(config, module)["bits"])
        parts = (p["weight"], p["scales"], p["biases"])
        if module.endswith("mlp.gate"):  # the router, exact as float32
            w = dequantize(*parts, bits)
            out.append(Tensor(name, w.shape, T.F32, w))
        else:
            out.append(
                encode(gguf, name, p["weight"].shape, lambda p=parts: p, bits, quant)
            )
    return out


def gguf_name(module: str) -> str:
    if module in TOP_NAMES:
        return TOP_NAMES[module]
    prefix, _, rest = module.partition(".layers.")
    index, _, tail = rest.partition(".")
    if prefix != "model" or tail not in LAYER_NAMES:
        raise ValueError(
            f"No GGUF name for {module!r}: only qwen3_moe models are supported."
        )
    return f"blk.{index}.{LAYER_NAMES[tail]}"


def expert_tensors(converted: Path, quant: str, gguf: Any) -> list[Tensor]:
    """Per MoE layer and projection: its experts stacked (E, out, in), read on write."""
    out = []
    for layer in load_manifest(converted).layers:
        for proj, gname in EXPERT_NAMES.items():
            segs = [s for s in layer.segments if s.projection == proj]
            weight = next(s for s in segs if s.name.endswith(".weight"))
            shape = (layer.num_experts, *weight.shape)
            name = f"blk.{layer.layer}.{gname}.weight"

            def load(layer: Any = layer, segs: list = segs) -> tuple:
                return read_segments(inside(converted, layer.file), layer, segs)

            out.append(encode(gguf, name, shape, load, int(weight.bits), quant))
    return out


def read_segments(path: Path, layer: Any, segs: list) -> tuple[np.ndarray, ...]:
    """(weight, scales, biases) of every expert of `layer`, stacked, in rows
    as MLX holds them (a blocked record's segments unblocked)."""
    order = {s.name.rpartition(".")[2]: s for s in segs}
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for part in ("weight", "scales", "biases"):
            seg = order[part]
            dtype = np.dtype(NUMPY_DTYPES[seg.dtype])
            rows = [
                np.frombuffer(
                    os.pread(
                        fd,
                        seg.nbytes,
                        layer.data_offset + e * layer.stride + seg.offset,
                    ),
                    dtype,
                ).reshape(seg.shape)
                for e in range(layer.num_experts)
            ]
            stack = np.stack(rows)
            out.append(unblocked(stack) if seg.blocked else stack)
    finally:
        os.close(fd)
    return tuple(out)


def add_metadata(writer: Any, config: dict, quant: str, gguf: Any) -> None:
    c = config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_name(f"moestream synthetic {c['num_hidden_layers']}x{c['num_experts']}")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c.get("max_position_embeddings", 32768))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    writer.add_expert_count(c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    ftype = {
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }
    writer.add_file_type(ftype[quant])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer(writer: Any, converted: Path, config: dict, gguf: Any) -> None:
    """The byte-level BPE of tokenizer.json, padded to the model's vocabulary."""
    tok = json.loads((converted / "tokenizer.json").read_text())
    vocab = {
        **tok["model"]["vocab"],
        **{a["content"]: a["id"] for a in tok.get("added_tokens", [])},
    }
    n = config["vocab_size"]
    if len(vocab) > n:
        raise ValueError(f"tokenizer.json has {len(vocab)} tokens, the model {n}.")
    special = {a["id"] for a in tok.get("added_tokens", [])}
    by_id = {i: t for t, i in vocab.items()}
    T = gguf.TokenType
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [
        T.CONTROL if i in special else T.NORMAL if i in by_id else T.UNUSED
        for i in range(n)
    ]
    merges = [
        m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(config.get("bos_token_id") or 0))
    writer.add_eos_token_id(int(config.get("eos_token_id") or 0))
    writer.add_add_bos_token(False)


def write_gguf(
    converted: Path, out: Path, quant: str = "q4_1", source: Path | None = None
) -> dict:
    """Write `converted`'s weights to `out` (temp name, then rename); returns
    bytes and bits per weight of the expert tensors and of the whole file."""
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}.")
    converted = Path(converted)
    config = json.loads((converted / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(
            f"{converted} is {config.get('model_type')!r}; GGUF export takes qwen3_moe."
        )
    gguf = import_gguf(source)
    tensors = dense_tensors(converted, config, quant, gguf) + expert_tensors(
        converted, quant, gguf
    )
    tmp = out.with_name(f".{out.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    add_metadata(writer, config, quant, gguf)
    add_tokenizer(writer, converted, config, gguf)
    for t in tensors:
        writer.add_tensor_info(
            t.name, t.shape, np.dtype(np.float32), nbytes(gguf, t), t.qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    stats = {"expert_bytes": 0, "expert_weights": 0, "bytes": 0, "weights": 0}
    try:
        for t in tensors:
            data = t.array()
            writer.write_tensor_data(
                data.view(np.uint8) if t.qtype.name[0] == "Q" else data
            )
            size, count = data.nbytes, int(np.prod(t.shape))
            stats["bytes"] += size
            stats["weights"] += count
            if "_exps." in t.name:
                stats["expert_bytes"] += size
                stats["expert_weights"] += count
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    stats["expert_bits_per_weight"] = (
        8 * stats["expert_bytes"] / stats["expert_weights"]
    )
    stats["bits_per_weight"] = 8 * stats["bytes"] / stats["weights"]
    stats["file_bytes"] = out.stat().st_size
    return stats


def nbytes(gguf: Any, t: Tensor) -> int:
    block, size = gguf.GGML_QUANT_SIZES[t.qtype]
    return int(np.prod(t.shape)) // block * size
