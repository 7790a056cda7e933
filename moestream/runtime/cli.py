"""run-moe OUT --prompt TEXT"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer
from tqdm import tqdm

from ..errors import user_errors
from ..formats import load_manifest
from ..formats.verify import check_files
from ..options import CONTEXT, common_options, engine_options
from ..units import peak_rss
from .config import RuntimeConfig
from .loader import load, runtime_of, stats

# mlx_lm.generate's default for --quantized-kv-start.
QUANTIZED_KV_START = 5000


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    prompt_bytes_read: int = 0


@dataclass(frozen=True)
class Sampling:
    """mlx_lm.generate's sampling and KV-cache flags."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START
    num_draft_tokens: int = 3

    def sampler(self) -> Callable[[mx.array], mx.array]:
        return make_sampler(self.temp, self.top_p, self.min_p, top_k=self.top_k)

    def kv_options(self) -> dict[str, Any]:
        return {
            "max_kv_size": self.max_kv_size,
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "quantized_kv_start": self.quantized_kv_start,
        }


def read_prompt(prompt: str) -> str:
    """--prompt as `mlx_lm.generate` reads it: escapes expanded, '-' is stdin."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if prompt == "-" else prompt


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: str,
    ignore_chat_template: bool,
    system_prompt: str | None = None,
    cached: bool = False,
    open_message: bool = False,
) -> list[int]:
    """Exactly as `mlx_lm.generate` encodes its --prompt (already read).

    cached: the prompt continues a saved prompt cache (mlx_lm.generate
        --prompt-cache-file): only the template from the message on is encoded.
    open_message: as `mlx_lm.cache_prompt` encodes a prompt to cache: the
        user message is left open.
    """
    use_chat_template = not ignore_chat_template and tokenizer.has_chat_template
    if not use_chat_template:
        return tokenizer.encode(prompt, add_special_tokens=not cached)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    template = {
        "tokenize": False,
        "add_generation_prompt": not open_message,
        "continue_final_message": open_message,
    }
    text = tokenizer.apply_chat_template(messages, **template)
    if cached:  # the prefix is in the cache: keep what follows the message start
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(messages, **template)
        text = text[probe.index("<query>") :]
    return tokenizer.encode(text, add_special_tokens=False)


def generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    max_tokens: int,
    sampling: Sampling,
    on_text: Callable[[str], None] | None = None,
    prompt_cache: list | None = None,
    draft_model: nn.Module | None = None,
) -> Generation:
    """Run mlx-lm's generation loop; collect text, token ids and timings."""
    out = Generation(prompt_tokens=len(prompt))
    eos = set(tokenizer.eos_token_ids)
    bar = tqdm(
        total=len(prompt),
        desc="prefill",
        unit="tok",
        leave=False,
        delay=1.0,  # only a prefill that takes more than a second shows a bar
    )

    def on_prefill(done: int, total: int) -> None:
        bar.update(done - bar.n)

    for r in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        sampler=sampling.sampler(),
        prompt_cache=prompt_cache,
        draft_model=draft_model,
        num_draft_tokens=sampling.num_draft_tokens,
        prompt_progress_callback=on_prefill,
        **sampling.kv_options(),
    ):
        if not out.tokens and not out.prompt_bytes_read:
            bar.close()
            out.prompt_bytes_read = stats(model).bytes_read
        if not (r.finish_reason == "stop" and r.token in eos):
            out.tokens.append(r.token)
        out.text += r.text
        out.prompt_tps, out.generation_tps = r.prompt_tps, r.generation_tps
        if on_text is not None:
            on_text(r.text)
    bar.close()
    return out


def load_draft(path: str, tokenizer: TokenizerWrapper) -> nn.Module:
    """--draft-model: a moestream OUT (all experts resident when they fit) or
    an mlx-lm model (path or hub id), whose vocabulary must be the model's."""
    if (Path(path) / "manifest.json").is_file():
        draft, draft_tok = load(path)
    elif path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(f"--draft-model {path} is not a directory.")
    else:
        from mlx_lm.utils import load as mlx_load

        draft, draft_tok = mlx_load(path)
    if draft_tok.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"--draft-model {path} has a vocabulary of {draft_tok.vocab_size} "
            f"tokens, the model {tokenizer.vocab_size}; use a draft of the same "
            "tokenizer."
        )
    return draft


def open_prompt_cache(
    path: str, model_dir: str, sampling: Sampling
) -> tuple[list, dict[str, str]]:
    """A prompt cache saved by `--save-prompt-cache` for this model."""
    cache, meta = load_prompt_cache(path, return_metadata=True)
    if Path(meta.get("model", "")).resolve() != Path(model_dir).resolve():
        raise ValueError(
            f"--prompt-cache-file {path} was saved for {meta.get('model')!r}, not "
            f"{model_dir}; use the model it was saved with."
        )
    bits = getattr(cache[0], "bits", None)
    if sampling.kv_bits is not None and sampling.kv_bits != bits:
        raise ValueError(
            f"--kv-bits {sampling.kv_bits} does not match the {bits}-bit KV cache "
            f"in {path}."
        )
    return cache, meta


def save_cache(
    model: nn.Module,
    prompt: list[int],
    path: str,
    model_dir: str,
    sampling: Sampling,
) -> None:
    """Prefill `prompt` and save its KV cache as mlx_lm.cache_prompt does
    (written to a temporary name, then renamed)."""
    cache = make_prompt_cache(model, sampling.max_kv_size)
    options = sampling.kv_options()
    del options["max_kv_size"]
    for _ in generate_step(
        mx.array(prompt), model, max_tokens=0, prompt_cache=cache, **options
    ):
        pass
    tmp = f"{path}.{os.getpid()}.tmp.safetensors"
    meta = {"model": str(Path(model_dir).resolve()), "tokenizer_config": "{}"}
    try:
        save_prompt_cache(tmp, cache, meta)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--system-prompt", default=None, help="System prompt (chat template).")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=int)
@click.option("--temp", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0: off.")
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
@click.option("--kv-group-size", default=64, show_default=True, type=int)
@click.option(
    "--quantized-kv-start",
    default=QUANTIZED_KV_START,
    show_default=True,
    type=int,
    help="With --kv-bits, quantize the KV cache from this step on.",
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
@click.option("--num-draft-tokens", default=3, show_default=True, type=int)
@click.option(
    "--trace",
    "trace_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write per layer and step: routed experts, hits, misses, prefetches, "
    "bytes read (JSON lines; `moestream plot` draws it).",
)
@click.option(
    "--verbose", is_flag=True, help="Print as mlx_lm.generate --verbose does."
)
@click.option(
    "--stats",
    "show_stats",
    is_flag=True,
    help="Print the memory plan and one line of speed and cache statistics.",
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
@engine_options(exclude=("record_trace", "context", "concurrency"))
@common_options
def main(
    model_dir: str,
    prompt: str,
    system_prompt: str | None,
    max_tokens: int,
    seed: int | None,
    ignore_chat_template: bool,
    prompt_cache_file: str | None,
    save_prompt_cache: str | None,
    draft_model: str | None,
    trace_file: str | None,
    verbose: bool,
    show_stats: bool,
    as_json: bool,
    pipeline: bool,
    engine: dict,
    **flags: Any,
) -> None:
    """Generate text with a model converted by convert-moe."""
    sampling = Sampling(**flags)
    if pipeline:
        from ..pipeline import run_rank

        def pipelined() -> dict | None:
            alone = {
                "--save-prompt-cache": save_prompt_cache,
                "--prompt-cache-file": prompt_cache_file,
                "--draft-model": draft_model,
                "--trace": trace_file,
            }
            for flag, value in alone.items():
                if value:
                    raise ValueError(f"--pipeline does not take {flag} yet.")
            on_text = None if as_json else lambda t: print(t, end="", flush=True)
            return run_rank(
                model_dir,
                prompt_ids,
                engine,
                max_tokens,
                sampling,
                seed,
                on_text,
                show_stats,
            )

    def prompt_ids(tok: TokenizerWrapper) -> list[int]:
        return encode_prompt(
            tok, read_prompt(prompt), ignore_chat_template, system_prompt
        )

    def run() -> dict | None:
        if seed is not None:  # before loading, as mlx_lm.generate seeds
            mx.random.seed(seed)
        if save_prompt_cache and not save_prompt_cache.endswith(".safetensors"):
            raise ValueError("--save-prompt-cache takes a name ending .safetensors.")
        if sampling.kv_bits is not None and sampling.max_kv_size is not None:
            raise ValueError(  # mlx-lm cannot quantize a rotating KV cache
                "--kv-bits and --max-kv-size cannot be used together."
            )
        if prompt_cache_file and draft_model:
            raise ValueError(
                "--draft-model and --prompt-cache-file cannot be used together."
            )
        manifest = load_manifest(model_dir)  # a clear error before the tokenizer
        if engine.get("verify", True):  # config and tokenizer, before they are used
            check_files(Path(model_dir), manifest, skip=manifest.dense_files)
        config = load_config(Path(model_dir))
        tok = load_tokenizer(
            Path(model_dir),
            {"trust_remote_code": False},  # reliability: never run a model's code
            eos_token_ids=config.get("eos_token_id"),
        )
        cache, cached = None, 0
        if prompt_cache_file:
            cache, _ = open_prompt_cache(prompt_cache_file, model_dir, sampling)
            cached = cache[0].offset
        ids = encode_prompt(
            tok,
            read_prompt(prompt),
            ignore_chat_template,
            system_prompt,
            cached=cache is not None,
            open_message=save_prompt_cache is not None,
        )
        draft = load_draft(draft_model, tok) if draft_model else None
        options = RuntimeConfig(
            **engine,
            context=cached + len(ids) + max_tokens,
            record_trace=trace_file is not None,
        )
        model, tok = load(model_dir, options, tokenizer=tok, progress=not as_json)
        if show_stats:
            click.echo(runtime_of(model).plan.describe(), err=True)
        if save_prompt_cache:
            save_cache(model, ids, save_prompt_cache, model_dir, sampling)
            click.echo(
                f"saved the KV cache of {len(ids)} prompt tokens to "
                f"{save_prompt_cache}",
                err=True,
            )
            return None
        on_text = None if as_json else lambda t: print(t, end="", flush=True)
        if verbose and not as_json:
            click.echo("=" * 10)
        gen = generate(model, tok, ids, max_tokens, sampling, on_text, cache, draft)
        if trace_file:
            from ..trace import write_trace

            write_trace(model, trace_file)
        return report(model, gen)

    result = user_errors(pipelined if pipeline else run)
    if result is None:
        return
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo()
    s = result["stats"]
    if verbose:
        click.echo("=" * 10)
        click.echo(
            f"Prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.3f} tokens-per-sec"
        )
        click.echo(
            f"Generation: {s['generation_tokens']} tokens, "
            f"{s['generation_tps']:.3f} tokens-per-sec"
        )
        click.echo(f"Peak memory: {s['mlx_peak_memory'] / 1e9:.3f} GB")
    if show_stats:
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
                f"{r['capacity']} slots per layer, {r['bytes_read'] / 1e6:.2f} MB "
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


def report(model: nn.Module, gen: Generation) -> dict:
    s = stats(model)
    n = len(gen.tokens)
    return {
        "text": gen.text,
        "tokens": gen.tokens,
        "stats": {
            "prompt_tokens": gen.prompt_tokens,
            "prompt_tps": gen.prompt_tps,
            "generation_tokens": n,
            "generation_tps": gen.generation_tps,
            **s.as_dict(),
            "decode_bytes_per_token": (s.bytes_read - gen.prompt_bytes_read)
            / max(n - 1, 1),
            "peak_memory": peak_rss(),
            "mlx_peak_memory": mx.get_peak_memory(),
        },
    }


if __name__ == "__main__":
    main()
