"""The correctness oracle: mlx-lm's fully resident model on the same weights.

Built from the *source* checkpoint by mlx-lm alone (load, cast, quantize_model
with the recipe's predicate), so it checks the converter and the runtime at
once: the streaming model's logits must equal this model's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load as mlx_load
from mlx_lm.utils import quantize_model

from .converter.pack import _source_dtype, quant_predicate
from .families import cast_floating
from .formats import Recipe


def resident_model(
    source: str | Path,
    recipe: Recipe | None = None,
    dtype: str | None = None,
    compute_dtype: str = "float32",
) -> nn.Module:
    """mlx-lm model of `source`: cast to `dtype`, quantized by `recipe`, resident."""
    recipe = recipe or Recipe()
    model, _, config = mlx_load(str(source), lazy=True, return_config=True)
    cast_floating(model, getattr(mx, dtype or _source_dtype(config)))
    model, _ = _quiet_quantize(model, config, recipe)
    cast_floating(model, getattr(mx, compute_dtype))
    mx.eval(model.parameters())
    return model


def _quiet_quantize(model: nn.Module, config: dict, recipe: Recipe):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bpw
        return quantize_model(
            model,
            config,
            recipe.dense_group_size,
            recipe.dense_bits,
            quant_predicate=quant_predicate(model, recipe),
        )
