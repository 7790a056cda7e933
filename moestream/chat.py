"""A conversation with a converted model, as mlx_lm.chat holds one: it lives in
one prompt cache, and each turn sends only its own message through the chat
template (`moestream chat`: moestream/cli/chat.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .generate import Sampling, generate
from .runtime import ExpertReadError, runtime_of


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
        """Answer `message`, continuing the conversation in the prompt cache.

        A turn that fails on an expert record (ExpertReadError) leaves the
        conversation as it was before the turn; the next one goes on from there.
        """
        prompt = self.prompt(message)
        room = self.context - self.used - len(prompt)
        if room < 1:
            raise ValueError(
                f"The conversation holds {self.used} of {self.context} tokens and "
                f"this message needs {len(prompt)} more; 'r' resets it (or start "
                "with a larger --context)."
            )
        n = min(max_tokens, room)
        before = [_snapshot(c) for c in self.cache]
        try:
            gen = generate(
                self.model, self.tokenizer, prompt, n, Sampling(), on_text,
                self.cache, sampler=sampler,
            )  # fmt: skip
        except ExpertReadError:
            self.cache[:] = before  # the failed turn's keys and values are dropped
            raise
        self.used += len(prompt) + gen.generated
        return Turn(gen.text, gen.generated, gen.generation_tps)


def _snapshot(cache: object) -> object:
    """A copy of one layer's cache that later updates of `cache` leave alone."""
    snap = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):  # a new array object: setitem mutates in place
            setattr(snap, name, mx.stop_gradient(value))
        elif isinstance(value, list):
            setattr(snap, name, [_frozen(v) for v in value])
    return snap


def _frozen(value: object) -> object:
    return mx.stop_gradient(value) if isinstance(value, mx.array) else value
