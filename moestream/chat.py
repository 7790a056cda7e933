"""moestream chat OUT: talk to a converted model, as mlx_lm.chat does.

The conversation lives in one prompt cache: each turn sends only its own
message through the chat template. `q` quits, `r` resets, `h` helps. Replies
go to stdout, everything else (plan, statistics, help) to stderr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import click
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import user_errors
from .generate import chat_template_text
from .options import CONTEXT, common_options, engine_options
from .runtime import RuntimeConfig, load, runtime_of, stats

HELP = "commands: q quit, r reset the conversation, h help"
# RuntimeConfig fields a chat sets its own way: one conversation, no trace.
ENGINE_EXCLUDED = ("record_trace", "concurrency")


@dataclass
class Turn:
    text: str
    tokens: int
    generation_tps: float


class Conversation:
    """One chat: its prompt cache, and how many of `context` tokens it holds."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        system_prompt: str | None = None,
        context: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.context = context or runtime_of(model).config.context
        self.reset()

    def reset(self) -> None:
        self.cache = make_prompt_cache(self.model)
        self.used = 0

    def prompt(self, message: str) -> list[int]:
        """This turn's tokens: its message templated (the system prompt first)."""
        messages = []
        if self.used == 0 and self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": message})
        if not self.tokenizer.has_chat_template:
            raise ValueError(
                "This model has no chat template; give one with --chat-template."
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def say(
        self,
        message: str,
        max_tokens: int,
        sampler: Callable[[mx.array], mx.array],
        on_text: Callable[[str], None] | None = None,
    ) -> Turn:
        """Answer `message`, continuing the conversation in the prompt cache."""
        prompt = self.prompt(message)
        room = self.context - self.used - len(prompt)
        if room < 1:
            raise ValueError(
                f"The conversation holds {self.used} of {self.context} tokens and "
                f"this message needs {len(prompt)} more; 'r' resets it (or start "
                "with a larger --context)."
            )
        turn = Turn("", 0, 0.0)
        for r in stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            max_tokens=min(max_tokens, room),
            sampler=sampler,
            prompt_cache=self.cache,
        ):
            turn.text += r.text
            turn.tokens, turn.generation_tps = r.generation_tokens, r.generation_tps
            if on_text is not None:
                on_text(r.text)
        self.used += len(prompt) + turn.tokens
        return turn


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option(
    "--system-prompt", default=None, help="System prompt of each conversation."
)
@click.option("--max-tokens", "-m", default=256, show_default=True, type=int)
@click.option("--temp", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int, help="PRNG seed.")
@click.option(
    "--chat-template", default="", help="Chat template (Jinja text or a file)."
)
@click.option(
    "--pipeline",
    is_flag=True,
    help="Run as one rank of a pipeline started by mlx.launch (every rank reads "
    "the same input; rank 0 answers).",
)
@engine_options(exclude=ENGINE_EXCLUDED)
@common_options
def chat_cmd(
    model_dir: str,
    system_prompt: str | None,
    max_tokens: int,
    temp: float,
    top_p: float,
    seed: int,
    chat_template: str,
    pipeline: bool,
    engine: dict,
) -> None:
    """Chat with a converted model OUT in the terminal (q quits, r resets)."""

    def start() -> Conversation:
        mx.random.seed(seed)
        template = chat_template_text(chat_template)
        config = RuntimeConfig(**engine)
        options = {"chat_template": template} if template else None
        if not pipeline:
            model, tokenizer = load(model_dir, config, tokenizer_config=options)
            return Conversation(model, tokenizer, system_prompt)
        from .pipeline import init, load_stage

        # every rank's load draws the whole model's random numbers (loader.py)
        model, tokenizer, _ = load_stage(model_dir, config, init(), None, options)
        return Conversation(model, tokenizer, system_prompt)

    chat = user_errors(start)
    if pipeline:
        from .pipeline import ended_by_launcher, init, lost_peers

        def converse() -> None:
            group = init()
            with ended_by_launcher(group.rank()), lost_peers(group):
                _converse(chat, max_tokens, temp, top_p, group.rank())

        user_errors(converse)
    else:
        _converse(chat, max_tokens, temp, top_p)


def _converse(
    chat: Conversation, max_tokens: int, temp: float, top_p: float, rank: int = 0
) -> None:
    """The terminal loop; on a pipeline's other ranks, silent."""
    echo = click.echo if rank == 0 else lambda *_, **__: None
    echo(runtime_of(chat.model).plan.describe(), err=True)
    echo(HELP, err=True)
    sampler = make_sampler(temp, top_p)
    show = (lambda t: print(t, end="", flush=True)) if rank == 0 else None
    while True:
        try:
            query = input(">> " if rank == 0 else "")
        except EOFError:
            break
        if query == "q":
            break
        if query == "r":
            chat.reset()
            echo("conversation reset", err=True)
            continue
        if query == "h":
            echo(HELP, err=True)
            continue
        before = stats(chat.model).hits, stats(chat.model).misses
        try:
            turn = chat.say(query, max_tokens, sampler, show)
        except ValueError as e:  # a full conversation: say so, keep chatting
            echo(f"error: {' '.join(str(e).split())}", err=True)
            continue
        echo()
        s = stats(chat.model)
        hits, misses = s.hits - before[0], s.misses - before[1]
        rate = hits / (hits + misses) if hits + misses else 0.0
        echo(
            f"[{turn.tokens} tokens, {turn.generation_tps:.1f} tok/s, hit rate "
            f"{rate:.2f}, {chat.used}/{chat.context} tokens of context]",
            err=True,
        )
