"""moestream plan OUT"""

from __future__ import annotations

import json
from pathlib import Path

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
    "--no-forecast", is_flag=True, help="Only the plan: skip the speed probes."
)
@click.option(
    "--hit-rate",
    "hit_rates",
    multiple=True,
    type=click.FloatRange(0, 1),
    help="Forecast at this hit rate (repeatable; default: the uniform-routing "
    "one and 0.5-0.95), e.g. one a previous run's --stats reported.",
)
@click.option(
    "--ranks",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Plan a pipeline of this many processes (run-moe --pipeline): each "
    "rank's layers and memory plan, without a forecast.",
)
@json_option
@engine_options(exclude=("record_trace",))
@common_options
def plan_cmd(
    model_dir: str,
    no_forecast: bool,
    hit_rates: tuple[float, ...],
    ranks: int,
    as_json: bool,
    engine: dict,
) -> None:
    """The memory plan run-moe would use for OUT, without loading weights, and
    a decode speed forecast from short probes of this disk and machine."""
    from ..plan import format_plan, format_ranks, plan_and_forecast, plan_ranks

    def run() -> dict:
        from mlx_lm.utils import load_config, load_tokenizer

        from ..formats import load_manifest

        load_manifest(model_dir)  # a clear error first
        config = load_config(Path(model_dir))
        # Loaded, as run-moe does, so that the plan counts it in the process.
        load_tokenizer(
            Path(model_dir),
            {"trust_remote_code": False},
            eos_token_ids=config.get("eos_token_id"),
        )
        cfg = RuntimeConfig(**engine)
        if ranks > 1:
            return plan_ranks(model_dir, cfg, ranks)
        return plan_and_forecast(model_dir, cfg, not no_forecast, hit_rates)

    result = user_errors(run)
    text = format_ranks(result) if ranks > 1 else format_plan(result)
    click.echo(json.dumps(result, indent=1) if as_json else text)
