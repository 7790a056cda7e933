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


def run_prompt_ids(
    tok: object, prompt: str, ignore_chat_template: bool, system_prompt: str | None
) -> list[int]:
    """The prompt's tokens as run-moe encodes its --prompt."""
    from ..generate import encode_prompt, read_prompt

    return encode_prompt(tok, read_prompt(prompt), ignore_chat_template, system_prompt)


def serve_runtime(model_dir: str, cfg: RuntimeConfig) -> RuntimeConfig:
    """What `moestream serve` with these engine flags gives `load`: its budget
    less the prompt cache, sized for its default decode concurrency."""
    from ..serve import ServerOptions, plan_server

    return plan_server(model_dir, cfg, ServerOptions()).runtime


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
@click.option(
    "--for",
    "command",
    type=click.Choice(["run", "chat", "serve"]),
    default="run",
    show_default=True,
    help="Plan as this command sizes its KV cache and activations: run-moe for "
    "its prompt plus --max-tokens, chat and serve for their --context.",
)
@click.option("--prompt", "-p", default="", help="run-moe's prompt ('-' reads stdin).")
@click.option(
    "--prompt-tokens",
    default=None,
    type=click.IntRange(0),
    help="Or the prompt's length in tokens, as encoded (instead of --prompt).",
)
@click.option("--max-tokens", "-m", default=256, show_default=True, type=int)
@click.option("--system-prompt", default=None, help="run-moe's system prompt.")
@click.option("--ignore-chat-template", is_flag=True, help="As run-moe takes it.")
@json_option
@engine_options()
@common_options
def plan_cmd(
    model_dir: str,
    no_forecast: bool,
    hit_rates: tuple[float, ...],
    ranks: int,
    command: str,
    prompt: str,
    prompt_tokens: int | None,
    max_tokens: int,
    system_prompt: str | None,
    ignore_chat_template: bool,
    as_json: bool,
    engine: dict,
) -> None:
    """The memory plan run-moe (or chat, serve) would use for OUT, without
    loading weights, and a decode speed forecast from short probes of this
    disk and machine. For run-moe it sizes the context as run-moe does: the
    prompt's tokens plus --max-tokens (--context overrides)."""
    from ..plan import format_plan, format_ranks, plan_and_forecast, plan_ranks

    def run() -> dict:
        from mlx_lm.utils import load_config, load_tokenizer

        from ..formats import load_manifest

        load_manifest(model_dir)  # a clear error first
        config = load_config(Path(model_dir))
        # Loaded, as run-moe does, so that the plan counts it in the process.
        tok = load_tokenizer(
            Path(model_dir),
            {"trust_remote_code": False},
            eos_token_ids=config.get("eos_token_id"),
        )
        cfg = RuntimeConfig(**engine)
        if command == "run" and "context" not in engine:
            n = prompt_tokens
            if n is None:
                n = len(
                    run_prompt_ids(tok, prompt, ignore_chat_template, system_prompt)
                )
            cfg = RuntimeConfig(**engine, context=n + max_tokens)
        elif command == "serve":
            cfg = serve_runtime(model_dir, cfg)
        if ranks > 1:
            return plan_ranks(model_dir, cfg, ranks)
        return plan_and_forecast(model_dir, cfg, not no_forecast, hit_rates)

    result = user_errors(run)
    text = format_ranks(result) if ranks > 1 else format_plan(result)
    click.echo(json.dumps(result, indent=1) if as_json else text)
