"""moestream chat OUT: talk to a converted model, as mlx_lm.chat does.

`q` quits, `r` resets, `h` helps. Replies go to stdout, everything else (plan,
statistics, help) to stderr.
"""

from __future__ import annotations

from collections.abc import Callable

import click
import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from ..chat import Conversation
from ..errors import user_errors
from ..generate import chat_template_text
from ..options import CONTEXT, common_options, engine_options
from ..runtime import ExpertReadError, RuntimeConfig, load, runtime_of, stats

HELP = "commands: q quit, r reset the conversation, h help"
READ_ERROR_HINT = (
    "This message was dropped, the conversation goes on from before it; "
    "`moestream verify OUT` checks the model."
)
# RuntimeConfig fields a chat sets its own way: one conversation, no trace.
ENGINE_EXCLUDED = ("concurrency",)


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
    help="Run as one rank of a pipeline started by mlx.launch (rank 0 reads the "
    "input, shares each line with the other ranks and answers).",
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
        from ..pipeline import init, load_stage

        # every rank's load draws the whole model's random numbers (loader.py)
        model, tokenizer, _ = load_stage(model_dir, config, init(), None, options)
        return Conversation(model, tokenizer, system_prompt)

    chat = user_errors(start)
    if pipeline:
        from ..pipeline import ended_by_launcher, init, lost_peers, share_line

        def converse() -> None:
            group = init()

            def read(prompt: str) -> str | None:
                return share_line(group, _read(prompt) if group.rank() == 0 else None)

            with ended_by_launcher(group.rank()), lost_peers(group):
                _converse(chat, max_tokens, temp, top_p, group.rank(), read, True)

        user_errors(converse)
    else:
        _converse(chat, max_tokens, temp, top_p)


def _read(prompt: str) -> str | None:
    """A line of the terminal (None: its end)."""
    try:
        return input(prompt)
    except EOFError:
        return None


def _converse(
    chat: Conversation,
    max_tokens: int,
    temp: float,
    top_p: float,
    rank: int = 0,
    read: Callable[[str], str | None] = _read,
    pipeline: bool = False,
) -> None:
    """The terminal loop; on a pipeline's other ranks, silent (`read` gives
    them rank 0's lines). A read error ends a pipeline's ranks (the others
    wait inside the failed step), a lone chat's turn only."""
    echo = click.echo if rank == 0 else lambda *_, **__: None
    echo(runtime_of(chat.model).plan.describe(), err=True)
    echo(HELP, err=True)
    sampler = make_sampler(temp, top_p)
    show = (lambda t: print(t, end="", flush=True)) if rank == 0 else None
    while True:
        query = read(">> ")
        if query is None or query == "q":
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
        except ExpertReadError as e:  # this turn fails; the conversation goes on
            if pipeline:
                raise
            echo(err=True)
            echo(f"error: {' '.join(str(e).split())} {READ_ERROR_HINT}", err=True)
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
