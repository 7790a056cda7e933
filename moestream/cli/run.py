"""run-moe OUT --prompt TEXT"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer

from ..errors import user_errors
from ..formats import load_manifest
from ..formats.verify import check_files
from ..generate import (
    Sampling,
    encode_prompt,
    generate,
    load_draft,
    open_prompt_cache,
    read_prompt,
    report,
    save_cache,
)
from ..options import CONTEXT, common_options, engine_options
from ..runtime import RuntimeConfig, load, runtime_of
from ..units import count


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--system-prompt", default=None, help="System prompt (chat template).")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=int)
@click.option("--temp", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int, help="Random seed for sampling.")
@click.option(
    "--ignore-chat-template",
    is_flag=True,
    help="Encode the prompt as is, without the chat template.",
)
@click.option("--max-kv-size", default=None, type=int, help="Rotating KV cache size.")
@click.option(
    "--kv-bits", default=None, type=int, help="Quantize the KV cache to these bits."
)
@click.option(
    "--prompt-cache-file",
    default=None,
    help="Continue from the KV cache saved in this file (--save-prompt-cache).",
)
@click.option(
    "--save-prompt-cache",
    default=None,
    metavar="FILE.safetensors",
    help="Process the prompt and save its KV cache (as mlx_lm.cache_prompt "
    "does), instead of generating.",
)
@click.option(
    "--draft-model",
    default=None,
    help="Speculative decoding with this draft: a moestream OUT or an mlx-lm model.",
)
@click.option(
    "--trace",
    "trace_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write per layer and step: routed experts, hits, misses, prefetches, "
    "bytes read (JSON lines; `moestream plot` draws it).",
)
@click.option(
    "--stats",
    "show_stats",
    is_flag=True,
    help="Print the backend, the memory plan, mlx_lm.generate's --verbose "
    "lines and one line of cache statistics.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (text, tokens, stats) instead.",
)
@click.option(
    "--pipeline",
    is_flag=True,
    help="Run as one rank of a pipeline started by mlx.launch: this rank loads "
    "and streams only its share of the layers; rank 0 prints.",
)
@engine_options(exclude=("context", "concurrency"))
@common_options
def main(**flags: Any) -> None:
    """Generate text with a model converted by convert-moe."""
    sampling = Sampling(**{k: flags.pop(k) for k in SAMPLING})
    args = RunArgs(sampling=sampling, **flags)
    result = user_errors(lambda: _pipelined(args) if args.pipeline else _run(args))
    if result is not None:
        _print(args, result)


# The flags that are mlx_lm.generate's sampling and KV-cache options.
SAMPLING = (
    "temp", "top_p", "max_kv_size", "kv_bits",
)  # fmt: skip


@dataclass(frozen=True)
class RunArgs:
    """run-moe's flags beside the sampling ones."""

    model_dir: str
    prompt: str
    system_prompt: str | None
    max_tokens: int
    seed: int | None
    ignore_chat_template: bool
    prompt_cache_file: str | None
    save_prompt_cache: str | None
    draft_model: str | None
    trace_file: str | None
    show_stats: bool
    as_json: bool
    pipeline: bool
    engine: dict
    sampling: Sampling

    def prompt_ids(self, tok: TokenizerWrapper, **how: bool) -> list[int]:
        text = read_prompt(self.prompt)
        return encode_prompt(
            tok, text, self.ignore_chat_template, self.system_prompt, **how
        )

    def on_text(self) -> Any:
        return None if self.as_json else lambda t: print(t, end="", flush=True)


def _pipelined(args: RunArgs) -> dict | None:
    from ..pipeline import run_rank

    alone = {
        "--save-prompt-cache": args.save_prompt_cache,
        "--prompt-cache-file": args.prompt_cache_file,
        "--draft-model": args.draft_model,
        "--trace": args.trace_file,
    }
    for flag, value in alone.items():
        if value:
            raise ValueError(f"--pipeline does not take {flag} yet.")
    return run_rank(
        args.model_dir,
        args.prompt_ids,
        args.engine,
        args.max_tokens,
        args.sampling,
        args.seed,
        args.on_text(),
        args.show_stats,
    )


def _check_flags(args: RunArgs) -> None:
    if args.save_prompt_cache and not args.save_prompt_cache.endswith(".safetensors"):
        raise ValueError("--save-prompt-cache takes a name ending .safetensors.")
    if args.sampling.kv_bits is not None and args.sampling.max_kv_size is not None:
        raise ValueError(  # mlx-lm cannot quantize a rotating KV cache
            "--kv-bits and --max-kv-size cannot be used together."
        )
    if args.prompt_cache_file and args.draft_model:
        raise ValueError(
            "--draft-model and --prompt-cache-file cannot be used together."
        )


def _tokenizer(args: RunArgs) -> TokenizerWrapper:
    """The tokenizer, after the manifest and (with --verify) its files' checks."""
    manifest = load_manifest(args.model_dir)  # a clear error before the tokenizer
    if args.engine.get("verify", True):  # config and tokenizer, before they are used
        check_files(Path(args.model_dir), manifest, skip=manifest.dense_files)
    config = load_config(Path(args.model_dir))
    return load_tokenizer(
        Path(args.model_dir),
        {"trust_remote_code": False},  # reliability: never run a model's code
        eos_token_ids=config.get("eos_token_id"),
    )


def _run(args: RunArgs) -> dict | None:
    if args.seed is not None:  # before loading, as mlx_lm.generate seeds
        mx.random.seed(args.seed)
    _check_flags(args)
    tok = _tokenizer(args)
    cache, cached = None, 0
    if args.prompt_cache_file:
        cache, _ = open_prompt_cache(
            args.prompt_cache_file, args.model_dir, args.sampling
        )
        cached = cache[0].offset
    ids = args.prompt_ids(
        tok, cached=cache is not None, open_message=args.save_prompt_cache is not None
    )
    draft = load_draft(args.draft_model, tok) if args.draft_model else None
    options = RuntimeConfig(
        **args.engine, context=cached + len(ids) + args.max_tokens
    ).with_options(record_trace=args.trace_file is not None)
    model, tok = load(args.model_dir, options, tokenizer=tok, progress=not args.as_json)
    if args.show_stats:
        rt = runtime_of(model)
        click.echo(rt.execution.describe(), err=True)
        click.echo(rt.plan.describe(), err=True)
    if args.save_prompt_cache:
        save_cache(model, ids, args.save_prompt_cache, args.model_dir, args.sampling)
        click.echo(
            f"saved the KV cache of {len(ids)} prompt tokens to "
            f"{args.save_prompt_cache}",
            err=True,
        )
        return None
    if args.show_stats and not args.as_json:
        click.echo("=" * 10)
    gen = generate(
        model, tok, ids, args.max_tokens, args.sampling, args.on_text(), cache, draft
    )
    if args.trace_file:
        from ..trace import write_trace

        write_trace(model, args.trace_file)
    return report(model, gen)


def _print(args: RunArgs, result: dict) -> None:
    if args.as_json:
        click.echo(json.dumps(result))
        return
    click.echo()
    s = result["stats"]
    if args.show_stats:
        click.echo("=" * 10)
        click.echo(
            f"Prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.3f} tokens-per-sec"
        )
        click.echo(
            f"Generation: {s['generation_tokens']} tokens, "
            f"{s['generation_tps']:.3f} tokens-per-sec"
        )
        click.echo(f"Peak memory: {s['mlx_peak_memory'] / 1e9:.3f} GB")
        _print_stats(s)


def _print_stats(s: dict) -> None:
    click.echo(
        f"prompt {s['prompt_tokens']} tok, {s['prompt_tps']:.1f} tok/s | "
        f"decode {s['generation_tokens']} tok, {s['generation_tps']:.1f} "
        f"tok/s | hit rate {s['hit_rate']:.3f} | "
        + host_tier_stats(s)
        + f"{s['decode_bytes_per_token'] / 1e6:.2f} MB read/token | "
        f"peak {s['peak_memory'] / 2**20:.0f} MB",
        err=True,
    )
    for r in s.get("ranks", []):  # --pipeline
        click.echo(
            f"rank {r['rank']}: layers {r['layers'][0]}-{r['layers'][1]}, "
            f"{count(r['capacity'], 'slot')} per layer, {r['bytes_read'] / 1e6:.2f} MB "
            f"read, peak {r['peak_memory'] / 2**20:.0f} MB",
            err=True,
        )


def host_tier_stats(s: dict) -> str:
    """The host tier's part of the --stats line (native engine), if it served."""
    served = s["host_hits"] + s["host_late"] + s["host_misses"]
    if not served:
        return ""
    return (
        f"host tier hit {s['host_hit_rate']:.3f} of {served} slot fills "
        f"({s['host_late']} still being read ahead) | "
    )


if __name__ == "__main__":
    main()
