"""moestream serve: mlx_lm.server's OpenAI API over a streaming model, through
the official `openai` client, against mlx-lm's resident model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from helpers import parse_metrics
from mlx_lm.generate import stream_generate
from mlx_lm.utils import load_tokenizer

import moestream
from moestream.cli.serve import serve_cmd
from moestream.runtime import BudgetError, RuntimeConfig
from moestream.runtime.loader import budget_for
from moestream.serve import Server, ServerOptions, plan_server
from moestream.units import parse_size

TIMEOUT = 60  # seconds, for every request and process here
SERVE = [sys.executable, "-m", "moestream", "serve", "--log-level", "WARNING"]
CONTEXT = 160
PROMPTS = ["def add", "class Point:", "import os", "for i in range"]
# A template that renders tools, as the Qwen and Llama templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(converted: Path):
    config = RuntimeConfig(cache_experts=4, context=CONTEXT)
    with Server(converted, config, ServerOptions(), port=0) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="-", timeout=TIMEOUT, max_retries=0
    )


@pytest.fixture(scope="module")
def tok(converted: Path):
    return load_tokenizer(converted)


def resident(model, tok, prompt: list[int], n: int) -> tuple[str, list[float]]:
    """mlx-lm's greedy text and the chosen tokens' log-probabilities."""
    text, logprobs = "", []
    for r in stream_generate(model, tok, prompt, max_tokens=n):
        text += r.text
        logprobs.append(r.logprobs[r.token].item())
    return text, logprobs


def chat_ids(tok, content: str, **kwargs) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def complete(client: openai.OpenAI, prompt: str, n: int = 12) -> str:
    r = client.completions.create(
        model="model", prompt=prompt, max_tokens=n, temperature=0.0
    )
    return r.choices[0].text


def get(server: Server, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(server: Server, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(
        server.url + path, body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics(server: Server) -> dict[str, float]:
    status, body = get(server, "/metrics")
    assert status == 200
    return parse_metrics(body)


def test_completion_equals_resident_greedy(client, tok, reference) -> None:
    for prompt in PROMPTS[:2]:
        want, _ = resident(reference, tok, tok.encode(prompt), 12)
        assert complete(client, prompt) == want


def test_chat_equals_resident_with_logprobs(client, tok, reference) -> None:
    want, logprobs = resident(reference, tok, chat_ids(tok, "hello"), 10)
    r = client.chat.completions.create(
        model="model",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=10,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    assert choice.message.content == want
    content = choice.logprobs.content
    assert [c.logprob for c in content] == logprobs
    assert "".join(c.token for c in content) == "".join(
        tok.convert_ids_to_tokens(r.id for r in content)  # type: ignore[attr-defined]
    )
    for c in content:  # greedy: the chosen token is the best of its top 3
        best = [t.logprob for t in c.top_logprobs]
        assert len(best) == 3 and best == sorted(best, reverse=True)
        assert best[0] == c.logprob
    assert r.usage.completion_tokens == len(logprobs)


def test_streaming_chat_returns_chunks_and_a_finish_reason(client, tok, reference):
    want, logprobs = resident(reference, tok, chat_ids(tok, "stream"), 10)
    assert len(logprobs) == 10  # no eos within 10 tokens
    chunks = list(
        client.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": "stream"}],
            max_tokens=10,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},  # as Open WebUI asks
        )
    )
    *chunks, usage = chunks
    texts = [c.choices[0].delta.content or "" for c in chunks]
    assert sum(1 for t in texts if t) >= 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(texts) == want
    assert usage.choices == [] and usage.usage.completion_tokens == 10


def test_concurrent_requests_return_what_they_return_alone(client, server) -> None:
    alone = [complete(client, p, 16) for p in PROMPTS]
    before = metrics(server)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(client, p, 16), PROMPTS))
    assert together == alone
    after = metrics(server)
    assert after["moestream_generation_tokens_total"] >= (
        before["moestream_generation_tokens_total"] + 4
    )


def test_tools_and_chat_template_reach_the_tokenizer(converted, reference) -> None:
    tok = load_tokenizer(converted, {"chat_template": TOOLS_TEMPLATE})
    ids = chat_ids(tok, "weather?", tools=TOOLS)
    assert "get_weather" in tok.decode(ids)
    want, _ = resident(reference, tok, ids, 10)
    options = ServerOptions(chat_template=TOOLS_TEMPLATE)
    config = RuntimeConfig(cache_experts=4, context=512)  # the tools' JSON is long
    with Server(converted, config, options, port=0) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        r = client.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": "weather?"}],
            tools=TOOLS,
            max_tokens=10,
            temperature=0.0,
            timeout=TIMEOUT,
        )
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)


def test_malformed_requests_get_4xx_json_and_the_server_keeps_serving(
    client, server
) -> None:
    status, body = post(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and "Invalid JSON" in json.loads(body)["error"]
    status, body = post(server, "/v1/chat/completions", b'{"model": "model"}')
    assert status == 400 and "messages" in json.loads(body)["error"]
    bad = {"model": "model", "messages": [{"content": "x"}], "max_tokens": 4}
    status, body = post(server, "/v1/chat/completions", json.dumps(bad).encode())
    assert status == 400 and "Cannot make a prompt" in json.loads(body)["error"]
    for kwargs, error in [
        ({"max_tokens": -1}, "max_tokens must be at least 1"),
        ({"model": "gpt-4"}, "not served here"),
        ({"prompt": "a b " * 400}, "context is 160"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                **{"model": "model", "prompt": "x", "max_tokens": 2, **kwargs}
            )
        assert error in e.value.body  # mlx_lm's errors: {"error": "..."}
    assert complete(client, "def add", 4)
    m = metrics(server)
    assert m['moestream_http_requests_total{path="/v1/chat/completions",code="400"}']
    assert m['moestream_http_requests_total{path="/v1/completions",code="400"}'] >= 3


def test_generation_stops_at_the_context(client, tok) -> None:
    prompt = "def " * 60
    n = len(tok.encode(prompt))
    r = client.completions.create(
        model="model", prompt=prompt, max_tokens=1000, temperature=0.0
    )
    assert r.usage.prompt_tokens == n
    assert r.usage.completion_tokens <= CONTEXT - n
    assert r.choices[0].finish_reason in ("length", "stop")


def test_models_health_and_metrics(client, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id
    assert get(server, "/health") == (200, b'{"status": "ok"}')
    assert get(server, "/v1/models/nope")[0] == 404
    complete(client, "import os", 6)
    m = metrics(server)
    assert m["moestream_expert_slots_per_layer"] == 4
    assert m["moestream_experts_per_layer"] == 8
    assert m["moestream_generation_tokens_total"] >= 6
    assert m["moestream_prompt_tokens_total"] > 0
    routed = m["moestream_expert_hits_total"] + m["moestream_expert_misses_total"]
    assert routed > 0 and m["moestream_expert_bytes_read_total"] > 0
    assert m["moestream_expert_hit_rate"] == pytest.approx(
        m["moestream_expert_hits_total"] / routed, abs=1e-6
    )
    assert m["moestream_generation_tokens_per_second"] > 0
    assert m["moestream_peak_memory_bytes"] > 0
    assert m["moestream_requests_active"] == 0
    stats = moestream.stats(server.model)
    assert m["moestream_expert_misses_total"] <= stats.misses


def test_prompt_cache_stays_within_its_bound(converted, client, server, tok) -> None:
    """The server's plan: KV of each sequence at once, and a bounded prompt cache."""
    plan = server.plan
    assert plan.decode_concurrency == 2  # 4 slots hold 2 sequences of top-2
    kv1 = moestream.runtime_of(server.model).plan.kv_cache // 2
    assert plan.kv_per_sequence == kv1
    for p in ["x = 1", "y = 2", "z = 3", "w = 4"]:
        complete(client, p, 4)
    m = metrics(server)
    assert 0 < m["moestream_prompt_cache_bytes"] <= plan.prompt_cache_bytes
    per_token = kv1 / 256  # the plan's KV: the context in steps of 256 tokens
    tokens = len(tok.encode("x = 1")) + 4  # prompt and answer, a little more
    bound = int(1.5 * tokens * per_token)  # room for one such sequence, not two
    config = RuntimeConfig(cache_experts=4, context=CONTEXT)
    with Server(
        converted, config, ServerOptions(prompt_cache_bytes=bound), port=0
    ) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        for p in ["x = 1", "y = 2", "z = 3"]:
            c.completions.create(model="model", prompt=p, max_tokens=4, timeout=60)
            assert 0 < s.prompt_cache.nbytes <= bound
        assert len(s.prompt_cache) == 1


def test_plan_counts_concurrency_and_caps_it_to_fit(converted) -> None:
    one = moestream.runtime.loader.plan_for(converted, RuntimeConfig(cache_experts=4))
    two = moestream.runtime.loader.plan_for(
        converted, RuntimeConfig(cache_experts=4, concurrency=2)
    )
    assert two.kv_cache == 2 * one.kv_cache
    assert two.activations == 2 * one.activations
    # A budget that holds 2 sequences (4 slots) and a prompt cache, not 3 (6
    # slots); a long context, so that a sequence's share is large.
    two_need = budget_for(converted, 4, 2048, RuntimeConfig(concurrency=2))
    three_need = budget_for(converted, 6, 2048, RuntimeConfig(concurrency=3))
    budget = (two_need + three_need) // 2
    config = RuntimeConfig(memory_budget=budget, context=2048)
    auto = plan_server(converted, config, ServerOptions())
    assert auto.decode_concurrency == 2
    assert auto.runtime.memory_budget + auto.prompt_cache_bytes == budget
    assert auto.prompt_cache_bytes <= (budget - two_need) // 2
    with pytest.raises(BudgetError, match="give --memory-budget") as e:
        plan_server(converted, config, ServerOptions(decode_concurrency=4))
    enough = re.search(r"give --memory-budget (\S+) or more", str(e.value)).group(1)
    # 1 % more: this test's process grows between the two plans (a user's
    # next run starts afresh).
    bigger = RuntimeConfig(memory_budget=int(1.01 * parse_size(enough)), context=2048)
    fits = plan_server(converted, bigger, ServerOptions(decode_concurrency=4))
    assert fits.decode_concurrency == 4
    model, _ = moestream.load(converted, fits.runtime)
    plan = moestream.runtime_of(model).plan
    assert plan.capacity >= 8 and plan.concurrency == 4
    assert plan.total + fits.prompt_cache_bytes <= fits.budget
    with pytest.raises(BudgetError, match="give --cache-experts 6 or more"):
        moestream.load(converted, cache_experts=4, concurrency=3)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
    ids=["SIGTERM", "SIGINT"],
)
def test_serve_cli_starts_and_stops_cleanly(converted, tmp_path, sig) -> None:
    """`moestream serve` as a user runs it: serves, then stops on SIGTERM/SIGINT
    and writes the trace of what it served."""
    trace = tmp_path / "trace.jsonl"
    args = ["--port", "0", "--cache-experts", "4", "--trace", str(trace)]
    proc = subprocess.Popen(
        [*SERVE, str(converted), *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _served_url(proc)
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT) as r:
            assert r.status == 200
        body = json.dumps({"prompt": "def", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            assert r.status == 200
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert "stopped" in err and "terminate" not in err
    lines = trace.read_text().splitlines()
    assert f"trace: {len(lines) - 1} MoE layer calls" in err
    assert len(lines) > 3 and json.loads(lines[0])["moestream_trace"] == 1


def _served_url(proc: subprocess.Popen) -> str:
    lines = []
    for line in proc.stderr:  # bounded by the test's kill in `finally`
        lines.append(line)
        m = re.search(r"at (http://\S+)/v1 ", line)
        if m:
            return m.group(1)
    raise AssertionError("the server did not start: " + "".join(lines))


def test_serve_refuses_a_budget_it_cannot_hold(converted) -> None:
    r = CliRunner().invoke(
        serve_cmd, [str(converted), "--memory-budget", "1M", "--port", "0"]
    )
    assert r.exit_code == 2
    assert re.fullmatch(r"error: Memory budget .* or more\.\n", r.output)


# ------------------------------------------------------------------ flags

# Every engine flag given, none at its default: each must reach the model.
ENGINE_FLAGS = {
    "--cache-experts": ("5", "cache_experts", 5),
    "--context": ("200", "context", 200),
    "--dtype": ("float32", "dtype", "float32"),
    "--no-verify": (None, "verify", False),
    "--backend": ("slots", "backend", "slots"),
    "--arithmetic": ("fast", "arithmetic", "fast"),
}
# And every developer knob through --set: each must reach the model's Tuning.
TUNING_SETS = {
    "policy=lru": ("policy", "lru"),
    "prefetch_extra=3": ("prefetch_extra", 3),
    "lrfu_decay=0.5": ("lrfu_decay", 0.5),
    "engine=python": ("engine", "python"),
    "prefetch=off": ("prefetch", False),
    "readers=3": ("readers", 3),
    "device_resolve=off": ("device_resolve", False),
    "cpu_kernel=off": ("cpu_kernel", False),
    "kernel_threads=1": ("kernel_threads", 1),
    "kernel_spin_us=0": ("kernel_spin_us", 0),
    "fast_rows=8": ("fast_rows", 8),
}


def test_serve_and_chat_take_every_engine_flag() -> None:
    """The one generated set (options.engine_options): every RuntimeConfig
    user field, with the help run-moe shows, but those serve sets otherwise."""
    from moestream.cli.chat import chat_cmd
    from moestream.cli.run import main as run_main
    from moestream.cli.serve import ENGINE_EXCLUDED
    from moestream.options import engine_fields, field_help
    from moestream.runtime.config import TUNING_FIELDS

    expected = set(engine_fields(exclude=ENGINE_EXCLUDED))
    assert expected == {f.name for f in fields(RuntimeConfig)} - {
        "tuning",  # --set KEY=VALUE
        "concurrency",  # --decode-concurrency
    }
    # the budgets are checked below, host_budget (the native engine's, refused
    # beside engine=python) by its error
    given = {f for _, f, _ in ENGINE_FLAGS.values()}
    assert given == expected - {"memory_budget", "host_budget"}
    set_fields = {f for f, _ in TUNING_SETS.values()}
    assert set_fields == set(TUNING_FIELDS) - {"record_trace"}
    run_help = {p.name: p.help for p in run_main.params}
    for command in (serve_cmd, chat_cmd):
        params = {p.name: p for p in command.params}
        assert expected <= set(params), command.name
        for name in expected:
            assert params[name].help.startswith(field_help(name)[:-1])
            if name in run_help:
                assert params[name].help == run_help[name]
    log_level = {p.name: p for p in serve_cmd.params}["log_level"]
    assert {"debug", "info", "warning", "error", "critical"} == set(
        log_level.type.choices
    )


def test_serve_flags_reach_the_config_the_model_was_loaded_with(
    converted, monkeypatch
) -> None:
    seen = {}

    def serve_once(server: Server) -> None:  # serve nothing: return at once
        seen["config"] = moestream.runtime_of(server.model).config
        seen["plan"] = server.plan

    monkeypatch.setattr(Server, "serve_forever", serve_once)
    args = ["--port", "0", "--log-level", "warning", "--decode-concurrency", "1"]
    for flag, (value, _, _) in ENGINE_FLAGS.items():
        args += [flag] if value is None else [flag, value]
    for item in TUNING_SETS:
        args += ["--set", item]
    r = CliRunner().invoke(serve_cmd, [str(converted), *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "stopped" in r.output
    config = seen["config"]
    for flag, (_, name, value) in ENGINE_FLAGS.items():
        assert getattr(config, name) == value, flag
    for item, (name, value) in TUNING_SETS.items():
        assert getattr(config.tuning, name) == value, item
    assert config.concurrency == 1 and seen["plan"].decode_concurrency == 1
    assert config.tuning.record_trace is False
    # A budget: it bounds the whole server, so the model gets it less the cache.
    need = budget_for(converted, 4, 200, RuntimeConfig(concurrency=1))
    budget = need + 2**20
    args = ["--port", "0", "--memory-budget", str(budget), "--context", "200"]
    args += ["--decode-concurrency", "1", "--log-level", "warning"]
    r = CliRunner().invoke(serve_cmd, [str(converted), *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    plan = seen["plan"]
    assert plan.budget == budget
    assert seen["config"].memory_budget == budget - plan.prompt_cache_bytes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "lrfu_decay=2"], r"lrfu_decay must be in \[0.0, 1.0\], got 2.0"),
        (["--context", "0"], r"context must be at least 1 token, got 0"),
        (["--set", "engine=python", "--set", "prefetch=on"], "python engine has no"),
        (["--set", "engine=python", "--host-budget", "1G"], "python engine has no"),
        (["--memory-budget", "3Q"], "Cannot read size '3Q'"),
        (["--cache-experts", "0"], "at least 1"),
        (["--decode-concurrency", "0"], "--decode-concurrency must be at least 1"),
    ],
)
def test_serve_bad_engine_value_is_one_line(converted, args, message) -> None:
    r = CliRunner().invoke(serve_cmd, [str(converted), "--port", "0", *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert re.search(message, lines[0]), lines[0]


def test_serve_bad_choice_names_the_flag(converted) -> None:
    r = CliRunner().invoke(serve_cmd, [str(converted), "--backend", "fifo"])
    assert r.exit_code == 2 and "'--backend'" in r.output and "fifo" in r.output
    for item, words in [
        ("readers", "'readers' is not KEY=VALUE"),
        ("readers=many", "readers='many': give a whole number"),
    ]:
        r = CliRunner().invoke(serve_cmd, [str(converted), "--set", item])
        assert r.exit_code == 2 and "--set" in r.output and words in r.output
