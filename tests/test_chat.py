"""moestream chat, as a user types into it: a subprocess fed through stdin."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer

import moestream
from moestream.chat import Conversation

TIMEOUT = 120
SYSTEM = "be brief"


def chat(converted: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moestream", "chat", str(converted), *flags],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def resident_turns(reference, tok, turns: list[str | None], n: int) -> list[str]:
    """mlx_lm.chat's loop on the resident model: one prompt cache per
    conversation (None starts a new one), the system prompt at its start."""
    out, cache, fresh = [], make_prompt_cache(reference), True
    for query in turns:
        if query is None:
            cache, fresh = make_prompt_cache(reference), True
            continue
        messages = [{"role": "system", "content": SYSTEM}] if fresh else []
        messages.append({"role": "user", "content": query})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        text = "".join(
            r.text
            for r in stream_generate(
                reference, tok, prompt, max_tokens=n, prompt_cache=cache
            )
        )
        out.append(text)
        fresh = False
    return out


def test_chat_keeps_history_resets_and_quits(converted: Path, reference) -> None:
    tok = load_tokenizer(converted)
    first, second, again = resident_turns(
        reference, tok, ["hello", "more please", None, "hello"], 10
    )
    alone = resident_turns(reference, tok, ["more please"], 10)[0]
    assert second != alone  # so the history shows in the answer
    r = chat(
        converted,
        "hello\nmore please\nr\nh\nhello\nq\nnever read\n",
        "--cache-experts",
        "3",
        "-m",
        "10",
        "--system-prompt",
        SYSTEM,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == f">> {first}\n>> {second}\n>> >> >> {again}\n>> "
    assert again == first
    assert "conversation reset" in r.stderr and "q quit" in r.stderr
    assert r.stderr.count("tok/s, hit rate") == 3


def test_a_full_conversation_is_refused_until_reset(converted: Path) -> None:
    model, tok = moestream.load(converted, cache_experts=3, context=40)
    chat = Conversation(model, tok)
    greedy = make_sampler(0.0)
    first = chat.say("hello", 30, greedy)
    assert 0 < first.tokens <= 40 - len(chat.prompt("hello"))  # stopped at 40
    with pytest.raises(ValueError, match=r"holds \d+ of 40 tokens.*'r' resets"):
        chat.say("hello again", 30, greedy)
    chat.reset()
    assert chat.say("hello", 30, greedy).text == first.text


def test_chat_flags_reach_the_config_the_model_was_loaded_with(
    converted: Path, monkeypatch
) -> None:
    import moestream.cli.chat

    loaded = []

    def load(*args, **kwargs):
        model, tok = moestream.load(*args, **kwargs)
        loaded.append(moestream.runtime_of(model).config)
        return model, tok

    monkeypatch.setattr(moestream.cli.chat, "load", load)
    flags = ["--cache-experts", "5", "--context", "64", "--set", "policy=lru"]
    flags += ["--set", "lrfu_decay=0.5", "--no-verify", "--set", "prefetch_extra=1"]
    r = CliRunner().invoke(moestream.cli.chat.chat_cmd, [str(converted), *flags], "q\n")
    assert r.exit_code == 0, r.output
    (config,) = loaded
    t = config.tuning
    assert (config.cache_experts, config.context, t.policy) == (5, 64, "lru")
    assert (t.lrfu_decay, config.verify, t.prefetch_extra) == (0.5, False, 1)
    args = [str(converted), "--set", "engine=python", "--set", "prefetch=on"]
    bad = CliRunner().invoke(moestream.cli.chat.chat_cmd, args)
    assert bad.exit_code == 2
    assert re.fullmatch(r"error: The python engine has no prefetch.*\n", bad.output)
