"""moestream serve OUT"""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Any

import click
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from ..errors import user_errors
from ..options import CONTEXT, engine_options, logging_options
from ..runtime import RuntimeConfig
from ..runtime.loader import PREFILL_STEP
from ..serve import LOG_FORMAT, Server, ServerOptions
from ..serve.provider import DEFAULT_DECODE_CONCURRENCY
from ..units import parse_size

# RuntimeConfig fields that are not serve flags of their own: --trace FILE sets
# record_trace, and --decode-concurrency (mlx_lm.server's name) concurrency.
ENGINE_EXCLUDED = ("concurrency",)


def _json_object(ctx, param, value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"x\": 1}'")
    return parsed


def _size(ctx, param, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int, help="0: any free.")
@engine_options(exclude=ENGINE_EXCLUDED)
@click.option(
    "--allowed-origins",
    default="*",
    show_default=True,
    help="CORS origins, comma-separated.",
)
@click.option(
    "--chat-template", default="", help="Chat template (Jinja text or a file)."
)
@click.option(
    "--use-default-chat-template",
    is_flag=True,
    help="The tokenizer's default template when the model has none.",
)
@click.option(
    "--chat-template-args",
    default="{}",
    callback=_json_object,
    help="JSON object of apply_chat_template arguments, e.g. "
    "'{\"enable_thinking\":false}'.",
)
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=float,
    help="Default sampling temperature.",
)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option(
    "--max-tokens",
    default=512,
    show_default=True,
    type=int,
    help="Default tokens to generate.",
)
@click.option(
    "--decode-concurrency",
    default=None,
    type=int,
    help="Sequences decoded at once, the engine's concurrency (default: as many "
    f"as fit, up to {DEFAULT_DECODE_CONCURRENCY}).",
)
@click.option(
    "--prompt-concurrency",
    default=8,
    show_default=True,
    type=int,
    help="Prompts prefilled at once (at most --decode-concurrency).",
)
@click.option("--prefill-step-size", default=PREFILL_STEP, show_default=True, type=int)
@click.option(
    "--prompt-cache-size",
    default=10,
    show_default=True,
    type=int,
    help="Sequences kept in the prompt cache.",
)
@click.option(
    "--prompt-cache-bytes",
    default=None,
    callback=_size,
    help="Bound of the prompt cache, e.g. 1G (default: within the budget).",
)
@click.option(
    "--kv-bits",
    default=None,
    type=int,
    help="Quantize the KV cache (requests then run one at a time).",
)
@click.option("--kv-group-size", default=64, show_default=True, type=int)
@click.option(
    "--quantized-kv-start",
    default=DEFAULT_QUANTIZED_KV_START,
    show_default=True,
    type=int,
)
@click.option(
    "--max-body",
    default="4M",
    show_default=True,
    callback=_size,
    help="Largest request body; a larger one gets 413 before it is read.",
)
@click.option(
    "--trace",
    "trace_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Record every MoE layer call and write it as run-moe --trace does "
    "when the server stops (it grows with every token served).",
)
@click.option(
    "--pipeline",
    is_flag=True,
    help="Run as one rank of a pipeline started by mlx.launch: rank 0 serves "
    "HTTP, every rank runs its share of the layers.",
)
@logging_options("info", fmt=LOG_FORMAT, level_option=True)
def serve_cmd(
    model_dir: str,
    host: str,
    port: int,
    trace_file: str | None,
    pipeline: bool,
    engine: dict,
    **flags: Any,
) -> None:
    """Serve a converted model OUT with an OpenAI-compatible API (mlx_lm.server's).

    POST /v1/chat/completions and /v1/completions (streaming or not), GET
    /v1/models, /health and /metrics (Prometheus). The engine flags are
    run-moe's; --memory-budget bounds the whole server, prompt cache included.
    """
    flags["allowed_origins"] = tuple(flags["allowed_origins"].split(","))

    def start() -> Server:
        options = ServerOptions(**flags)
        config = RuntimeConfig(**engine).with_options(record_trace=bool(trace_file))
        if pipeline and trace_file:
            raise ValueError("--pipeline does not take --trace yet.")
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return Server(model_dir, config, options, host, port, level, pipeline)

    server = user_errors(start)
    # Stop on SIGTERM as on Ctrl-C, from before "Ctrl-C stops" is printed (a
    # caller may stop us as soon as it reads it); the caller's handler is
    # back afterwards.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    failed: OSError | ValueError | None = None
    try:
        _announce(server, host)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as e:  # a pipeline rank's bad record, or its peer's
        failed = e
    finally:
        signal.signal(signal.SIGTERM, previous)
        if trace_file:  # before close, which lets go of the model
            from ..trace import write_trace

            calls = write_trace(server.model, trace_file)
            click.echo(f"trace: {calls} MoE layer calls -> {trace_file}", err=True)
        server.close()
    if failed is not None:
        click.echo(f"error: {failed}", err=True)
        sys.exit(2)
    click.echo("stopped", err=True)


def _announce(server: Server, host: str) -> None:
    """What rank 0 prints once it serves."""
    if server.rank != 0:
        return
    click.echo(server.describe(), err=True)
    click.echo(
        f"serving {server.model_id!r} at {server.url}/v1 (Ctrl-C stops)", err=True
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(
            "note: mlx_lm.server only implements basic security checks; "
            "keep it behind a trusted network.",
            err=True,
        )
