"""Generation and its report, shared by the commands and the pipeline: prompts
encoded as mlx_lm.generate encodes them, its sampling and KV-cache options,
prompt caches, drafts and chat templates."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tqdm import tqdm

from .runtime import load, stats
from .units import peak_rss

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
    generated: int = 0  # tokens generated, a final end-of-sequence one included


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
    sampler: Callable[[mx.array], mx.array] | None = None,
) -> Generation:
    """Run mlx-lm's generation loop; collect text, token ids and timings.

    sampler: instead of `sampling`'s (which still gives the KV-cache options).
    """
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
        sampler=sampler or sampling.sampler(),
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
        out.generated = r.generation_tokens
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


def chat_template_text(value: str) -> str:
    """--chat-template: the template itself, or a file that holds it."""
    try:
        if value and Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a template's text too long for a file name
        pass
    return value
