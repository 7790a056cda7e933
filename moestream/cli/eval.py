"""moestream eval OUT --data FILE"""

from __future__ import annotations

import json

import click

from ..errors import user_errors
from ..options import (
    CONTEXT,
    common_options,
    engine_options,
    json_option,
    model_argument,
)
from ..runtime.config import RuntimeConfig


@click.command(context_settings=CONTEXT)
@model_argument
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A UTF-8 text file.",
)
@click.option("--context", default=512, show_default=True, help="Tokens per sequence.")
@click.option(
    "--num-samples",
    default=-1,
    show_default=True,
    help="Sequences to score (-1: all the data holds).",
)
@click.option("--batch-size", default=1, show_default=True)
@click.option(
    "--reference",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="The unquantized source (HF or mlx-lm directory): also report the mean "
    "KL divergence of the next-token distributions. It must fit in memory.",
)
@json_option
@engine_options(exclude=("context", "concurrency"))
@common_options
def eval_cmd(
    model_dir: str,
    data: str,
    context: int,
    num_samples: int,
    batch_size: int,
    reference: str | None,
    as_json: bool,
    engine: dict,
) -> None:
    """Perplexity of OUT over a text file, as mlx_lm.perplexity computes it;
    with --arithmetic fast, also the exact path's and the KL between them."""
    from ..evaluate import evaluate, format_result, load_reference, read_text, sequences
    from ..runtime.loader import load, runtime_of

    def run() -> dict:
        if batch_size < 1:
            raise ValueError("--batch-size must be at least 1.")
        cfg = RuntimeConfig(**engine, context=context * batch_size)
        model, tok = load(model_dir, cfg, progress=not as_json)
        rows = sequences(
            tok, read_text(data), context, None if num_samples < 0 else num_samples
        )
        ref = None
        if reference:
            ref = load_reference(reference, runtime_of(model).manifest.dtype)
        fast = runtime_of(model).execution.fast  # also run on the exact path
        result = evaluate(model, rows, ref, batch_size, not as_json, fast)
        return {"result": result, "stats": runtime_of(model).stats.as_dict()}

    out = user_errors(run)
    if as_json:
        click.echo(json.dumps({**out["result"].as_dict(), "stats": out["stats"]}))
    else:
        click.echo(format_result(out["result"], model_dir))
