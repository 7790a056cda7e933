"""moestream info OUT: what a converted folder holds, from its manifest and config.

No weight is read: the bits per weight of the whole model come from mlx-lm's
own `compute_bits_per_weight` on the model built lazily (dense tensors mapped,
experts as never-evaluated placeholders of their stored shapes).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import compute_bits_per_weight, load_config

from .families import build_model, get_family, quantize_as_configured
from .formats import ExpertLayer, Manifest, load_manifest
from .formats.manifest import inside
from .runtime.loader import dense_weights
from .units import human_bytes


def model_info(path: str | Path) -> dict[str, Any]:
    """Everything `moestream info` prints, as one JSON-ready dict."""
    directory = Path(path)
    manifest = load_manifest(directory)
    config = load_config(directory)
    text = {**config, **config.get("text_config", {})}
    dense = sum(inside(directory, f).stat().st_size for f in manifest.dense_files)
    layers = manifest.layers
    return {
        "path": str(directory),
        "format": manifest.format,
        "version": manifest.version,
        "created_by": manifest.created_by,
        "family": manifest.model_type,
        "source": manifest.source,
        "dtype": manifest.dtype,
        "layers": text.get("num_hidden_layers"),
        "moe_layers": len(layers),
        "experts": sorted({layer.num_experts for layer in layers}),
        "top_k": get_family(config).top_k(config),
        "recipe": manifest.recipe.to_dict(),
        "expert_quantization": quantization_ranges(layers),
        "record_bytes": sorted({layer.record_nbytes for layer in layers}),
        "stride_bytes": sorted({layer.stride for layer in layers}),
        "layout": "blocked" if manifest.blocked else "rows",
        "dense_bytes": dense,
        "expert_bytes": manifest.expert_bytes,
        "blob_bytes": manifest.total_bytes,
        "bits_per_weight": model_bits_per_weight(directory, manifest, config),
        "expert_bits_per_weight": expert_bits_per_weight(layers),
    }


def _layer_quantization(layer: ExpertLayer) -> dict[str, dict[str, Any]]:
    out = {}
    for seg in layer.segments:
        if seg.name.endswith(".weight"):
            out[seg.projection] = {
                "bits": seg.bits,
                "group_size": seg.group_size,
                "mode": seg.mode,
            }
    return dict(sorted(out.items()))


def quantization_ranges(layers: tuple[ExpertLayer, ...]) -> list[dict[str, Any]]:
    """Runs of consecutive MoE layers whose expert projections share bits and
    group size: [{"layers": [first, last], "projections": {...}}, ...]."""
    ordered = sorted(layers, key=lambda x: x.layer)
    runs = []
    for q, group in itertools.groupby(ordered, key=_layer_quantization):
        members = [layer.layer for layer in group]
        runs.append({"layers": [members[0], members[-1]], "projections": q})
    return runs


def expert_bits_per_weight(layers: tuple[ExpertLayer, ...]) -> float:
    """Stored bits per expert weight: record bytes over the weights they hold."""
    bits = params = 0
    for layer in layers:
        for seg in layer.segments:
            bits += 8 * seg.nbytes * layer.num_experts
            n = math.prod(seg.shape) * layer.num_experts
            if seg.name.endswith(".weight") and seg.bits:
                params += n * 32 // seg.bits  # packed in uint32
            elif not seg.name.endswith((".scales", ".biases")):
                params += n  # unquantized weights and expert biases
    return bits / params if params else 0.0


def model_bits_per_weight(directory: Path, manifest: Manifest, config: dict) -> float:
    """As mlx_lm.convert reports it, on the lazily built whole model."""
    model = build_model(config)
    weights = dense_weights(directory, manifest)
    for layer in manifest.layers:
        for seg in layer.segments:
            shape = (layer.num_experts, *seg.shape)
            dtype = getattr(mx, seg.dtype)
            weights[f"{layer.module}.{seg.name}"] = mx.zeros(shape, dtype)
    quantize_as_configured(model, config, weights)
    model.load_weights(list(weights.items()), strict=True)
    return compute_bits_per_weight(model)


def format_info(info: dict[str, Any]) -> str:
    h = human_bytes
    src = info["source"] or {}
    repo = src.get("repo_id") or "a local directory"
    revision = f" at {src['revision']}" if src.get("revision") else ""
    experts = "/".join(str(n) for n in info["experts"])
    lines = [
        f"{info['path']}: {info['format']} format v{info['version']}, "
        f"created by {info['created_by'] or 'unknown'}",
        f"  family:       {info['family']} (stored floats {info['dtype']})",
        f"  source:       {repo}{revision}",
        f"  layers:       {info['layers']}, of which {info['moe_layers']} MoE "
        f"with {experts} experts, top-{info['top_k']}",
    ]
    for run in info["expert_quantization"]:
        first, last = run["layers"]
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        projections = ", ".join(
            f"{p} {q['bits']}-bit g{q['group_size']}"
            + ("" if q["mode"] in (None, "affine") else f" {q['mode']}")
            for p, q in run["projections"].items()
        )
        lines.append(f"  experts:      {span}: {projections}")
    recipe = info["recipe"]
    lines += [
        f"  dense:        {recipe['dense_bits']}-bit g{recipe['dense_group_size']} "
        "(mlx-lm's per-path overrides in config.json)",
        "  record:       "
        + ", ".join(h(n) for n in info["record_bytes"])
        + " per expert, stride "
        + ", ".join(h(n) for n in info["stride_bytes"]),
        f"  layout:       {info['layout']}",
        f"  bytes:        dense {h(info['dense_bytes'])}, experts "
        f"{h(info['expert_bytes'])} ({h(info['blob_bytes'])} of blobs)",
        f"  bits/weight:  {info['bits_per_weight']:.3f} whole model (as "
        f"mlx_lm.convert reports it), {info['expert_bits_per_weight']:.3f} experts",
    ]
    return "\n".join(lines)
