"""moestream info / plan / eval / plot: the commands around a run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import user_errors
from .options import CONTEXT, common_options, engine_options
from .runtime.config import RuntimeConfig

MODEL = click.argument("model_dir", metavar="OUT", type=click.Path())
JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


@click.command(context_settings=CONTEXT)
@MODEL
@JSON
@common_options
def info_cmd(model_dir: str, as_json: bool) -> None:
    """What a converted model OUT holds (reads manifest and config only)."""
    from .info import format_info, model_info

    info = user_errors(lambda: model_info(model_dir))
    click.echo(json.dumps(info, indent=1) if as_json else format_info(info))


def run_prompt_ids(
    tok: object, prompt: str, ignore_chat_template: bool, system_prompt: str | None
) -> list[int]:
    """The prompt's tokens as run-moe encodes its --prompt."""
    from .runtime.cli import encode_prompt, read_prompt

    return encode_prompt(tok, read_prompt(prompt), ignore_chat_template, system_prompt)


def serve_runtime(model_dir: str, cfg: RuntimeConfig) -> RuntimeConfig:
    """What `moestream serve` with these engine flags gives `load`: its budget
    less the prompt cache, sized for its default decode concurrency."""
    from .serve import ServerOptions, plan_server

    return plan_server(model_dir, cfg, ServerOptions()).runtime


@click.command(context_settings=CONTEXT)
@MODEL
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
@JSON
@engine_options(exclude=("record_trace",))
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
    from .plan import format_plan, format_ranks, plan_and_forecast, plan_ranks

    def run() -> dict:
        from mlx_lm.utils import load_config, load_tokenizer

        from .formats import load_manifest

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


@click.command(context_settings=CONTEXT)
@MODEL
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
@JSON
@engine_options(exclude=("record_trace", "context", "concurrency"))
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
    """Perplexity of OUT over a text file, as mlx_lm.perplexity computes it."""
    from .evaluate import evaluate, format_result, load_reference, read_text, sequences
    from .runtime.loader import load, runtime_of

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
        result = evaluate(model, rows, ref, batch_size, progress=not as_json)
        return {"result": result, "stats": runtime_of(model).stats.as_dict()}

    out = user_errors(run)
    if as_json:
        click.echo(json.dumps({**out["result"].as_dict(), "stats": out["stats"]}))
    else:
        click.echo(format_result(out["result"], model_dir))


@click.command(context_settings=CONTEXT)
@click.argument("trace_file", metavar="TRACE", type=click.Path(exists=True))
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False),
    help="Image file to write (.png, .svg, .pdf).",
)
@common_options
def plot_cmd(trace_file: str, output: str) -> None:
    """Draw a run-moe --trace file: expert use per layer, hit rate and MB read
    per token, beside LRU and Belady replays of the same routing."""
    from .plot import plot_trace, pyplot
    from .trace import read_trace

    def run() -> None:
        pyplot()  # a clear error before reading the trace
        plot_trace(read_trace(trace_file), output)

    user_errors(run)
    click.echo(f"wrote {output}")
