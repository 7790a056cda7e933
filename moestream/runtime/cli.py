"""run-moe OUT --prompt TEXT"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer

from ..errors import user_errors
from ..formats import load_manifest
from ..formats.verify import check_files
from .config import DTYPES
from .loader import load, runtime_of, stats
from .pool import POLICIES


@dataclass
class Generation:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    prompt_bytes_read: int = 0


def read_prompt(prompt: str) -> str:
    """--prompt as `mlx_lm.generate` reads it: escapes expanded, '-' is stdin."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if prompt == "-" else prompt


def encode_prompt(
    tokenizer: TokenizerWrapper, prompt: str, ignore_chat_template: bool
) -> list[int]:
    """Exactly as `mlx_lm.generate` encodes its --prompt (already read)."""
    use_chat_template = not ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_chat_template)


def generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    max_tokens: int,
    temp: float,
    top_p: float,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Run mlx-lm's generation loop; collect text, token ids and timings."""
    out = Generation(prompt_tokens=len(prompt))
    sampler = make_sampler(temp, top_p)
    eos = set(tokenizer.eos_token_ids)
    for r in stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler
    ):
        if not out.tokens and not out.prompt_bytes_read:
            out.prompt_bytes_read = stats(model).bytes_read
        if not (r.finish_reason == "stop" and r.token in eos):
            out.tokens.append(r.token)
        out.text += r.text
        out.prompt_tps, out.generation_tps = r.prompt_tps, r.generation_tps
        if on_text is not None:
            on_text(r.text)
    return out


def peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=int)
@click.option("--temp", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int, help="Random seed for sampling.")
@click.option(
    "--ignore-chat-template",
    is_flag=True,
    help="Encode the prompt as is, without the chat template.",
)
@click.option(
    "--memory-budget",
    default=None,
    help="Bound for the whole process, e.g. 6G (default: 80% of RAM).",
)
@click.option(
    "--cache-experts",
    default=None,
    type=int,
    help="Resident experts per MoE layer (overrides --memory-budget).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="Compute dtype; auto = float32 on CPU, stored dtype on GPU.",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Skip checking each expert's checksum on its first read.",
)
@click.option(
    "--policy",
    type=click.Choice(sorted(POLICIES)),
    default="lrfu",
    show_default=True,
    help="Which resident expert to evict first.",
)
@click.option(
    "--no-prefetch",
    is_flag=True,
    help="Do not predict and pre-read the next layer's experts.",
)
@click.option(
    "--stats",
    "show_stats",
    is_flag=True,
    help="Print one line of speed and cache statistics at the end.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (text, tokens, stats) instead.",
)
def main(
    model_dir: str,
    prompt: str,
    max_tokens: int,
    temp: float,
    top_p: float,
    seed: int | None,
    ignore_chat_template: bool,
    memory_budget: str | None,
    cache_experts: int | None,
    dtype: str,
    no_verify: bool,
    policy: str,
    no_prefetch: bool,
    show_stats: bool,
    as_json: bool,
) -> None:
    """Generate text with a model converted by convert-moe."""

    def run() -> dict:
        if seed is not None:
            mx.random.seed(seed)
        manifest = load_manifest(model_dir)  # a clear error before the tokenizer
        if not no_verify:  # config and tokenizer intact (load checks the dense part)
            check_files(Path(model_dir), manifest, skip=manifest.dense_files)
        config = load_config(Path(model_dir))
        tok = load_tokenizer(
            Path(model_dir),
            {"trust_remote_code": False},  # reliability: never run a model's code
            eos_token_ids=config.get("eos_token_id"),
        )
        ids = encode_prompt(tok, read_prompt(prompt), ignore_chat_template)
        model, tok = load(
            model_dir,
            memory_budget=memory_budget,
            cache_experts=cache_experts,
            dtype=dtype,
            verify=not no_verify,
            context=len(ids) + max_tokens,
            policy=policy,
            prefetch=not no_prefetch,
            tokenizer=tok,
        )
        if show_stats:
            click.echo(runtime_of(model).plan.describe(), err=True)
        on_text = None if as_json else lambda t: print(t, end="", flush=True)
        gen = generate(model, tok, ids, max_tokens, temp, top_p, on_text)
        return report(model, gen)

    result = user_errors(run)
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo()
        if show_stats:
            s = result["stats"]
            click.echo(
                f"prompt {s['prompt_tokens']} tok, {s['prompt_tps']:.1f} tok/s | "
                f"decode {s['generation_tokens']} tok, {s['generation_tps']:.1f} "
                f"tok/s | hit rate {s['hit_rate']:.3f} | "
                f"{s['decode_bytes_per_token'] / 1e6:.2f} MB read/token | "
                f"peak {s['peak_memory'] / 2**20:.0f} MB",
                err=True,
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
