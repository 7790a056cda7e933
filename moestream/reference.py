"""The correctness oracle: mlx-lm's fully resident model on the same weights.

`resident_model` builds it from the *source* checkpoint with mlx-lm alone
(load, cast, quantize_model with the recipe's predicate), so it checks the
converter and the runtime at once: the streaming model's logits must equal it
bit for bit. `resident_from_converted` loads every expert of a converted
directory instead: the same weights, fully in memory (the speed reference).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import load_config, quantize_model

from .converter.pack import quant_predicate, source_dtype
from .families import build_model, cast_floating, quantize_as_configured
from .formats import BlobReader, Recipe, load_manifest
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
    model, _, config = mlx_load(str(source), lazy=True, return_config=True)
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
