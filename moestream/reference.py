"""The correctness oracle: mlx-lm's fully resident model on the same weights.

`resident_model` builds it from the *source* checkpoint with mlx-lm alone
(load, cast, quantize_model with the recipe's predicate), from the config the
converter writes (transformers 5's keys where mlx-lm reads them, hfconfig.py),
so it checks the converter and the runtime at once: the streaming model's
logits must equal it bit for bit. An MLX-quantized source is loaded by mlx-lm
as stored; only the expert projections whose bits differ from the recipe are
dequantized and quantized again. `resident_from_converted` loads every expert
of a converted directory instead: the same weights, fully in memory (the speed
reference).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import load_config, quantize_model

from .converter.hfconfig import normalize_config
from .converter.pack import quant_predicate, source_dtype
from .converter.source import resolve
from .families import (
    build_model,
    cast_floating,
    layer_index,
    quantize_as_configured,
    switch_modules,
)
from .formats import BlobReader, Recipe, load_manifest
from .formats.dtypes import DTYPE_NAMES
from .formats.manifest import inside
from .runtime.loader import dense_weights, resolve_dtype


def resident_model(
    source: str | Path,
    recipe: Recipe | None = None,
    dtype: str | None = None,
    compute_dtype: str = "float32",
) -> nn.Module:
    """mlx-lm model of `source`: cast to `dtype`, quantized by `recipe`, resident."""
    recipe = recipe or Recipe()
    path, _ = resolve(str(source))
    shipped = load_config(path)
    # the config the converter writes: transformers 5's keys where mlx-lm reads them
    model, _, config = mlx_load(
        str(path), model_config=normalize_config(shipped), lazy=True, return_config=True
    )
    # load sets "quantization" for hub-quantized sources too (gpt_oss's MXFP4);
    # an MLX checkpoint is one whose own config.json has it
    if isinstance(shipped.get("quantization"), dict):  # an MLX checkpoint
        cast_floating(model, getattr(mx, dtype or _scales_dtype(model)))
        _requantize_experts(model, recipe)
    else:
        cast_floating(model, getattr(mx, dtype or source_dtype(config)))
        model, _ = _quiet_quantize(model, config, recipe)
    cast_floating(model, getattr(mx, compute_dtype))
    mx.eval(model.parameters())
    return model


def resident_from_converted(directory: str | Path, dtype: str = "auto") -> nn.Module:
    """mlx-lm's model with every expert of a converted directory loaded, stacked."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    config = load_config(directory)
    model = build_model(config)
    weights = dense_weights(directory, manifest)
    for layer in manifest.layers:
        with BlobReader(inside(directory, layer.file), layer) as blob:
            records = [blob.record(e) for e in range(layer.num_experts)]
            for seg in layer.segments:
                stack = mx.array(np.stack([blob.segment(r, seg) for r in records]))
                if seg.dtype == "bfloat16":
                    stack = stack.view(mx.bfloat16)
                weights[f"{layer.module}.{seg.name}"] = stack
    quantize_as_configured(model, config, weights)
    model.load_weights(list(weights.items()), strict=True)
    cast_floating(model, getattr(mx, resolve_dtype(dtype, manifest.dtype)))
    mx.eval(model.parameters())
    return model.eval()


def _scales_dtype(model: nn.Module) -> str:
    """The dtype an MLX checkpoint's affine scales are stored in."""
    for k, v in tree_flatten(model.parameters()):
        if k.endswith(".scales") and mx.issubdtype(v.dtype, mx.floating):
            return DTYPE_NAMES[v.dtype]
    return "float32"


def _requantize_experts(model: nn.Module, recipe: Recipe) -> None:
    """Quantize every expert projection as `recipe` says, from its stored values."""
    for spath, switch in switch_modules(model).items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            m = switch[proj]
            spec = recipe.expert_spec(proj, layer_index(spath)).to_mlx()
            weight = m.weight
            if isinstance(m, QuantizedSwitchLinear):
                stored = {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
                if stored == spec:
                    continue
                weight = mx.dequantize(
                    m.weight,
                    m.scales,
                    m.get("biases"),
                    group_size=m.group_size,
                    bits=m.bits,
                    mode=m.mode,
                )
            num_experts, out_dims, in_dims = weight.shape
            linear = SwitchLinear(in_dims, out_dims, num_experts, bias="bias" in m)
            linear.update({k: v for k, v in m.items() if k == "bias"})
            linear.weight = weight
            switch[proj] = linear.to_quantized(**spec)


def _quiet_quantize(
    model: nn.Module, config: dict, recipe: Recipe
) -> tuple[nn.Module, dict]:
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bpw
        return quantize_model(
            model,
            config,
            recipe.dense_group_size,
            recipe.dense_bits,
            quant_predicate=quant_predicate(model, recipe),
        )
