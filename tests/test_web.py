"""moestream serve's page: /stats and its Server-Sent Events stream (here, no
browser), and the page itself in a real Chromium (the `ui` marker: `make
test-ui`; skipped where no browser or Playwright is installed)."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import BITS, parse_metrics

import moestream
from moestream.converter import convert
from moestream.runtime import RuntimeConfig
from moestream.serve import Server, ServerOptions
from moestream.serve.live import streaming_layers
from moestream.serve.page import page_file

TIMEOUT = 30  # seconds, for every request, stream and page wait here
CHROMIUM = "/usr/bin/chromium"
# A little wider than conftest's model: six MoE layers of 32 experts, top 4.
WIDER = {"num_hidden_layers": 6, "num_experts": 32, "num_experts_per_tok": 4}


@pytest.fixture(scope="module")
def wider(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_qwen3_moe(
        tmp_path_factory.mktemp("hf") / "m",
        mlp_only_layers=[],
        _name_or_path="org/tiny-source",
        **WIDER,
    )
    out = tmp_path_factory.mktemp("out") / "wider-moe"
    convert(str(hf), out, bits=BITS, progress=False)
    return out


@pytest.fixture(scope="module")
def server(wider: Path):
    """The native engine, 8 slots a layer, a budget (the python engine's
    counts: test_engines_count_...); a CPU has no host tier."""
    config = RuntimeConfig(cache_experts=8, context=256, memory_budget="1G")
    with Server(wider, config, ServerOptions(max_tokens=16), port=0) as s:
        yield s


def get(server: Server, path: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=TIMEOUT) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


def metrics(server: Server) -> dict[str, float]:
    status, body, _ = get(server, "/metrics")
    assert status == 200
    return parse_metrics(body)


def chat(server: Server, content: str, n: int = 12) -> str:
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="-", timeout=TIMEOUT, max_retries=0
    )
    r = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": content}],
        max_tokens=n,
        temperature=0.0,
    )
    return r.choices[0].message.content


def events(server: Server, query: str) -> list[dict]:
    """The events of /stats/stream?query, read until the server ends it."""
    url = server.url + "/stats/stream?" + query
    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        blocks = r.read().decode().split("\n\n")
    assert blocks[-1] == ""
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def assert_equals_metrics(snap: dict, m: dict[str, float]) -> None:
    """A snapshot's counters are /metrics' (read after it, with no request between)."""
    x = snap["experts"]
    assert x["hits"] == m["moestream_expert_hits_total"]
    assert x["misses"] == m["moestream_expert_misses_total"]
    assert x["bytes_read"] == m["moestream_expert_bytes_read_total"]
    assert x["fill_bytes"] == m["moestream_expert_fill_bytes_total"]
    assert abs(x["hit_rate"] - m["moestream_expert_hit_rate"]) < 1e-6
    r = snap["requests"]
    assert r["generation_tokens"] == m["moestream_generation_tokens_total"]
    assert r["prompt_tokens"] == m["moestream_prompt_tokens_total"]


def test_stream_sends_count_events_then_ends(server: Server) -> None:
    chat(server, "hello")
    started = time.monotonic()
    got = events(server, "interval=0.05&count=4")
    assert len(got) == 4
    assert time.monotonic() - started < TIMEOUT
    times = [e["time"] for e in got]
    assert times == sorted(times) and times[-1] - times[0] >= 0.1
    e = got[-1]
    assert e["model"] == "wider-moe" and (e["rank"], e["ranks"]) == (0, 1)
    assert e["about"] == {  # the manifest's name, not the folder's
        "name": "org/tiny-source",
        "family": "qwen3_moe",
        "moe_layers": 6,
        "experts": 32,
        "top_k": 4,
    }
    assert [layer["layer"] for layer in e["layers"]] == list(range(6))
    plan = moestream.runtime_of(server.model).execution
    assert e["backend"] == plan.as_dict()  # the plan's words, as `plan` prints
    assert e["backend"]["describe"].startswith("backend cpu-slots, ")
    assert e["slots_visible"]
    assert e["host_tier"] is None  # a GPU's
    assert e["memory"]["budget"] == 1 << 30
    m = e["memory"]
    assert m["rss"] > 0 and m["dense"] > 0 and m["peak_rss"] >= m["rss"]
    parts = ("process", "dense", "kv_cache", "activations", "staging", "experts")
    plan = moestream.runtime_of(server.model).plan
    assert sum(m[k] for k in (*parts, "reserve")) == plan.total
    assert m["reserve"] == plan.reserve and m["process"] == plan.process


def test_snapshot_equals_metrics_and_the_slots(server: Server) -> None:
    chat(server, "what the slots hold")
    status, body, kind = get(server, "/stats")
    assert status == 200 and kind == "application/json"
    snap = json.loads(body)
    assert_equals_metrics(snap, metrics(server))
    x = snap["experts"]
    layers = snap["layers"]
    # Every routed expert of a call is one use: a hit or a miss.
    assert sum(sum(layer["uses"]) for layer in layers) == x["hits"] + x["misses"]
    assert sum(layer["misses"] for layer in layers) == x["misses"]
    model = server.model
    tables = {m.layer.layer: m.slot_table() for m in streaming_layers(model)}
    for layer in layers:
        assert layer["capacity"] == 8 and layer["experts"] == 32
        held = [e for e in layer["slots"] if e >= 0]
        assert len(held) == len(set(held)) == 8  # more than 8 experts were routed
        table = tables[layer["layer"]]
        for slot, expert in enumerate(layer["slots"]):
            assert table[expert] == slot
        used = np.array(layer["uses"])
        assert set(held) <= set(np.flatnonzero(used).tolist())


def test_concurrent_requests_while_streaming(server: Server) -> None:
    """Three chats at once and a stream reading: all counted, nothing lost."""
    before = metrics(server)
    prompts = ["one", "two", "three"]
    alone = [chat(server, p) for p in prompts]
    got: list[dict] = []
    reader = threading.Thread(
        target=lambda: got.extend(events(server, "interval=0.05&count=20"))
    )
    reader.start()
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: chat(server, p), prompts))
    reader.join(TIMEOUT)
    assert not reader.is_alive()
    assert together == alone
    assert len(got) == 20
    tokens = [e["requests"]["generation_tokens"] for e in got]
    assert tokens == sorted(tokens)  # counters only grow
    snap = json.loads(get(server, "/stats")[1])
    m = metrics(server)
    assert_equals_metrics(snap, m)
    done = (
        m["moestream_generation_tokens_total"]
        - before["moestream_generation_tokens_total"]
    )
    assert done == 6 * 12


def test_stream_ends_when_the_server_closes(wider: Path) -> None:
    config = RuntimeConfig(cache_experts=8, context=256)
    s = Server(wider, config, port=0).start()
    first, got = threading.Event(), []

    def read() -> None:
        url = s.url + "/stats/stream?interval=0.05"  # no count: until closed
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            for line in r:
                if line.startswith(b"data: "):
                    got.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=read)
    try:
        reader.start()
        assert first.wait(TIMEOUT)
    finally:
        s.close()
    reader.join(TIMEOUT)
    assert not reader.is_alive() and len(got) >= 1


def test_bad_stream_query_gets_one_line(server: Server) -> None:
    status, body, _ = get(server, "/stats/stream?interval=fast")
    assert status == 400
    assert json.loads(body)["error"].startswith("interval must be seconds")
    status, body, _ = get(server, "/stats/stream?count=0")
    assert status == 400 and "count must be 1 or more" in json.loads(body)["error"]


def test_page_files_are_served_and_self_contained(server: Server) -> None:
    status, body, kind = get(server, "/")
    assert status == 200 and kind.startswith("text/html")
    assert b'<script src="/static/app.js">' in body
    for name, want in (("app.js", "text/javascript"), ("app.css", "text/css")):
        status, text, kind = get(server, "/static/" + name)
        assert status == 200 and kind.startswith(want)
        assert b"http://" not in text and b"https://" not in text  # nothing fetched
    for path in ("/static/../serve.py", "/static/nope.js", "/static/.x.js"):
        assert get(server, path)[0] == 404
    assert page_file("/static/%2e%2e/live.py") is None


def test_engines_count_uses_as_hits_and_misses(wider: Path) -> None:
    """Python and native engines count the same uses, layer by layer, and
    hold the same experts in their slots."""
    from mlx_lm.generate import generate, generation_stream

    uses, tables = {}, {}
    for engine in ("python", "native"):
        model, tok = moestream.load(wider, cache_experts=6, engine=engine)
        generate(model, tok, "count me", max_tokens=8)
        # the step mlx-lm computed ahead, on its generation stream, has run
        # (native counts a call when it runs): stats() takes what has run
        mx.synchronize(generation_stream)
        s = moestream.stats(model)
        total = sum(int(u.sum()) for u in s.expert_uses.values())
        assert total == s.hits + s.misses
        assert sum(s.per_layer_misses.values()) == s.misses
        uses[engine] = {k: v.tolist() for k, v in s.expert_uses.items()}
        tables[engine] = [  # which experts hold a slot (slots are picked apart)
            np.flatnonzero(m.slot_table() < m.capacity).tolist()
            for m in streaming_layers(model)
        ]
        s.reset()
        assert s.expert_uses == {} and s.per_layer_misses == {}
    assert uses["python"] == uses["native"]
    assert tables["python"] == tables["native"]  # the same policy, the same experts


# ---- in a browser ----


def _browser_missing() -> str | None:
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        return f"no Chromium at {CHROMIUM} (make test-ui installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (make test-ui installs it)"
    return None


def ui(test):
    """A test in a real browser: marked `ui`, skipped where there is none."""
    missing = _browser_missing()
    test = pytest.mark.skipif(missing is not None, reason=str(missing))(test)
    return pytest.mark.ui(test)


ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1400, "height": 900},
        )
        context.set_default_timeout(TIMEOUT * 1000)
        yield context
        context.close()


@pytest.fixture
def page(browser, server: Server):
    """The page, opened; fails the test on any console error."""
    errors: list[str] = []
    page = browser.new_page()
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_selector("#status.live")
    yield page
    page.close()
    assert errors == []


def ask(page, text: str) -> str:
    """Send `text` in the page's chat; the streamed answer once it is done."""
    before = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(before)
    answer.and_(page.locator("[data-done]")).wait_for()
    return answer.locator(".text").text_content()


def panel(page) -> dict:
    return page.evaluate(
        """() => ({
            hitRate: Number(document.getElementById('hit-rate').dataset.value),
            hits: Number(document.getElementById('hit-rate').dataset.hits),
            misses: Number(document.getElementById('hit-rate').dataset.misses),
            bytesRead: Number(document.getElementById('bytes-read').dataset.value),
            fillBytes: Number(document.getElementById('fill-bytes').dataset.value),
            tokens: Number(document.getElementById('generation-tokens').dataset.value),
        })"""
    )


def panel_settles(page, server: Server) -> tuple[dict, dict]:
    """The panel and /metrics once the panel shows /metrics' token count."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        m, shown = metrics(server), panel(page)
        if shown["tokens"] == m["moestream_generation_tokens_total"] and shown[
            "hits"
        ] + shown["misses"] == (
            m["moestream_expert_hits_total"] + m["moestream_expert_misses_total"]
        ):
            return shown, m
        assert time.monotonic() < deadline, (shown, m)
        time.sleep(0.1)


@ui
def test_page_chat_streams_the_greedy_answer(page, server: Server) -> None:
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    want = chat(server, "Tell me about experts")
    assert ask(page, "Tell me about experts") == want
    shown, m = panel_settles(page, server)
    assert shown["hits"] == m["moestream_expert_hits_total"]
    assert shown["misses"] == m["moestream_expert_misses_total"]
    assert abs(shown["hitRate"] - m["moestream_expert_hit_rate"]) < 1e-6
    assert shown["bytesRead"] == m["moestream_expert_bytes_read_total"]
    assert shown["fillBytes"] == m["moestream_expert_fill_bytes_total"]


@ui
def test_page_with_concurrent_requests_and_history(
    page, server: Server, request, tmp_path: Path
) -> None:
    """Other clients' requests while the page chats; a second turn, a system
    prompt and a stop sequence reach the API as the page shows them."""
    page.fill("#max-tokens", "12")
    first = ask(page, "first turn")
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(chat, server, f"other {i}", 16) for i in range(3)]
        page.fill("#system", "Be brief.")
        page.fill("#stop", first[3:5] or "x")
        second = ask(page, "second turn")
        assert [f.result(TIMEOUT) for f in others]
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="-", timeout=TIMEOUT, max_retries=0
    )
    r = client.chat.completions.create(
        model="default_model",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first turn"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "second turn"},
        ],
        max_tokens=12,
        temperature=0.0,
        stop=[first[3:5] or "x"],
    )
    assert second == r.choices[0].message.content
    shown, m = panel_settles(page, server)
    assert shown["bytesRead"] == m["moestream_expert_bytes_read_total"]
    page.wait_for_timeout(500)  # a few more samples into the charts
    shot = request.config.getoption("screenshot") or tmp_path / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert Path(shot).stat().st_size > 10_000


@ui
def test_page_names_the_model_the_memory_and_the_colour_scales(
    page, server: Server
) -> None:
    page.fill("#max-tokens", "12")
    ask(page, "what fills the budget")
    page.wait_for_timeout(600)  # samples after the answer
    header = page.locator("#model").text_content()
    assert header == "org/tiny-source"  # the model's own; the folder is wider-moe
    about = page.locator("#about").text_content()
    assert '"wider-moe"' in about
    assert moestream.runtime_of(server.model).execution.describe() in about
    snap = json.loads(get(server, "/stats")[1])["memory"]
    keys = page.eval_on_selector_all(
        "#memory-keys [data-part]",
        "els => Object.fromEntries(els.map(e => [e.dataset.part, +e.dataset.value]))",
    )
    for name, key in (("process", "process"), ("dense", "dense"), ("KV", "kv_cache"),
                      ("slots", "experts"), ("reserve", "reserve")):  # fmt: skip
        assert keys[name] == snap[key], name
    assert keys["activations"] == snap["activations"] + snap["staging"]
    shown = page.locator("#memory").evaluate("e => [e.dataset.rss, e.dataset.peak]")
    assert int(shown[1]) >= int(shown[0]) > 0  # the peak is never below now
    ramps = page.eval_on_selector_all(
        ".scale .ramp", "els => els.map(e => getComputedStyle(e).backgroundImage)"
    )
    assert len(ramps) == 2 and all("linear-gradient" in r for r in ramps)
    # The tokens/s chart's window starts at its first sample with tokens.
    chart = page.locator("#chart-tps").evaluate("e => ({...e.dataset})")
    assert int(chart["samples"]) >= 2 and float(chart["firstX"]) <= 1.0
    assert float(page.locator("#window").get_attribute("data-seconds")) > 0
    # No dead space: the page ends where its panels do, the panel where its parts do.
    gaps = page.evaluate(
        """() => {
            const panel = document.getElementById('panel').getBoundingClientRect();
            const last = document.querySelector('#panel .bars').getBoundingClientRect();
            const chat = document.getElementById('chat').getBoundingClientRect();
            const page = document.documentElement.scrollHeight;
            return [panel.bottom - last.bottom,
                    page - Math.max(panel.bottom, chat.bottom) - window.scrollY];
        }"""
    )
    assert gaps[0] < 40 and gaps[1] < 40, gaps


def test_mlx_lm_server_lines_per_request_only_at_debug() -> None:
    """The server logs nothing per request at INFO; -vv (DEBUG) shows them."""
    import logging

    from moestream.serve.page import quiet_requests

    def record(path: str, level: int = logging.INFO, name: str = "root"):
        return logging.LogRecord(name, level, path, 1, "Prompt Cache: 1", None, None)

    per_request = record("/x/site-packages/mlx_lm/server.py")
    root = logging.getLogger()
    before = root.level
    try:
        root.setLevel(logging.INFO)
        assert not quiet_requests(per_request)
        assert quiet_requests(
            record("/x/site-packages/mlx_lm/server.py", logging.WARNING)
        )
        assert quiet_requests(record("/x/moestream/serve/app.py"))
        assert quiet_requests(record("/x/mlx_lm/server.py", name="moestream.serve"))
        root.setLevel(logging.DEBUG)
        assert quiet_requests(per_request)
    finally:
        root.setLevel(before)
