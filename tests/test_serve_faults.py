"""moestream serve under faults: a bad expert record fails the requests that
read it, with a clear error, while the server goes on serving and says why.

Every server here listens on 127.0.0.1 and stops with its `with` block; every
request has a timeout. Each response is either exact (mlx-lm's resident greedy
answer) or the clear error, and /health answers throughout.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from helpers import corrupt_layer, fail_reads, parse_metrics
from mlx_lm.generate import stream_generate
from mlx_lm.server import GenerationContext, Response
from mlx_lm.utils import load_tokenizer

from moestream.cli.chat import chat_cmd
from moestream.formats import load_manifest
from moestream.runtime import ExpertReadError, config_from, native
from moestream.serve import Server, ServerOptions
from moestream.serve.app import _Answers
from moestream.serve.faults import CHECK_INTERVAL

TIMEOUT = 30  # seconds, for every request here
CONTEXT = 160
TOKENS = 10
PROMPTS = ["def add", "class Point:", "import os", "for i in range"] * 2
ENGINES = ["python"] + (["native"] if native.available() else [])
# The damaged record: layer index 1 of the manifest (model layer 2), expert 3.
BAD_LAYER, BAD_EXPERT = 1, 3


@pytest.fixture(scope="module")
def tok(converted: Path):
    return load_tokenizer(converted)


@pytest.fixture(scope="module")
def alone(reference, tok) -> dict[str, str]:
    """Each prompt's greedy answer from mlx-lm's resident model."""
    out = {}
    for p in set(PROMPTS):
        out[p] = "".join(
            r.text
            for r in stream_generate(reference, tok, tok.encode(p), max_tokens=TOKENS)
        )
    return out


def serve(directory: Path, engine: str, **options) -> Server:
    config = config_from(cache_experts=4, context=CONTEXT, engine=engine)
    return Server(directory, config, ServerOptions(**options), port=0)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="-", timeout=TIMEOUT, max_retries=0
    )


def ask(client: openai.OpenAI, prompt: str, stream: bool) -> str | openai.APIError:
    """The answer's text, or the API error it ended with."""
    try:
        r = client.completions.create(
            model="model",
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0.0,
            stream=stream,
        )
        if not stream:
            return r.choices[0].text
        return "".join(c.choices[0].text for c in r)
    except openai.APIError as e:
        return e


def ask_all(
    server: Server, together: bool = True
) -> list[tuple[str, bool, str | openai.APIError]]:
    """PROMPTS from as many concurrent clients (or one after another), every
    other one streamed."""
    client = client_of(server)
    jobs = [(p, i % 2 == 1) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(len(jobs) if together else 1) as pool:
        answers = list(pool.map(lambda j: ask(client, *j), jobs))
    return [(p, s, a) for (p, s), a in zip(jobs, answers, strict=True)]


def get(server: Server, path: str) -> tuple[int, dict | bytes]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=TIMEOUT) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    return status, (json.loads(body) if path == "/health" else body)


def metrics(server: Server) -> dict[str, float]:
    status, body = get(server, "/metrics")
    assert status == 200
    return parse_metrics(body)


class HealthWatch:
    """Polls /health from its own thread while a block runs; keeps the answers."""

    def __init__(self, server: Server) -> None:
        self.server, self.answers = server, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            start = time.monotonic()
            status, body = get(self.server, "/health")
            self.answers.append((status, body["status"], time.monotonic() - start))

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)

    def assert_answered(self) -> None:
        assert self.answers, "no /health answer while requests ran"
        for status, state, took in self.answers:
            assert status == 200 and state in ("ok", "degraded")
            assert took < 5


def split(answers, alone: dict[str, str]) -> list[openai.APIError]:
    """Assert each answer is exact or a clear read error; return the errors."""
    errors = []
    for prompt, streamed, a in answers:
        if isinstance(a, str):
            assert a == alone[prompt], (prompt, streamed)
            continue
        errors.append(a)
        if not streamed:  # a stream's error comes after its 200
            assert isinstance(a, openai.InternalServerError) and a.status_code == 500
        assert "moestream verify" in a.message
        assert f"of layer {load_manifest_layer(a)}" in a.message
    return errors


def load_manifest_layer(error: openai.APIError) -> str:
    return error.message.split("of layer ")[1].split(" ")[0]


def damage(directory: Path) -> tuple[Path, bytes]:
    """Flip one byte of one record in place; returns the blob and its bytes."""
    layer = load_manifest(directory).layers[BAD_LAYER]
    blob = directory / layer.file
    original = blob.read_bytes()
    data = bytearray(original)
    data[layer.data_offset + BAD_EXPERT * layer.stride + 7] ^= 0x10
    blob.write_bytes(bytes(data))
    return blob, original


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("engine", ENGINES)
def test_corrupted_record_fails_its_requests_then_heals_in_place(
    copy, alone, engine
) -> None:
    blob, original = damage(copy)
    layer = load_manifest(copy).layers[BAD_LAYER]
    with serve(copy, engine) as server, HealthWatch(server) as watch:
        answers = ask_all(server)
        errors = split(answers, alone)
        assert errors, "no request read the damaged record"
        assert len(errors) < len(answers), "every request read the damaged record"
        # each fails as it fails alone: only the requests that need the record
        one_by_one = ask_all(server, together=False)
        assert [isinstance(a, str) for *_, a in answers] == [
            isinstance(a, str) for *_, a in one_by_one
        ]
        assert all("fails its checksum" in e.message for e in errors)
        status, health = get(server, "/health")
        assert status == 200 and health["status"] == "degraded"
        assert "moestream verify" in health["message"]
        assert health["bad_records"] == [
            {
                "layer": layer.layer,
                "expert": BAD_EXPERT,
                "file": layer.file,
                "error": health["bad_records"][0]["error"],
            }
        ]
        m = metrics(server)
        assert m["moestream_expert_bad_records"] == 1
        assert m[f'moestream_expert_bad_record{{layer="{layer.layer}",expert="3"}}']
        assert m["moestream_expert_read_errors_total"] >= 1
        assert m["moestream_expert_read_failed_requests_total"] == 2 * len(errors)
        assert m['moestream_http_requests_total{path="/v1/completions",code="500"}']

        blob.write_bytes(original)  # repaired in place: no restart
        time.sleep(CHECK_INTERVAL)
        assert get(server, "/health") == (200, {"status": "ok"})
        assert split(ask_all(server), alone) == []
        m = metrics(server)
        assert m["moestream_expert_bad_records"] == 0
        assert m["moestream_expert_records_repaired_total"] == 1
    watch.assert_answered()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_read_that_fails_once_fails_no_request(copy, alone, engine) -> None:
    layer = load_manifest(copy).layers[BAD_LAYER]
    with serve(copy, engine) as server, HealthWatch(server) as watch:
        fail_reads(server.model, layer.layer, BAD_EXPERT, 1)
        errors = split(ask_all(server), alone)
        m = metrics(server)
        # the engine reads a failed record once more: the error heals there
        assert m["moestream_expert_read_errors_total"] == 0
        assert errors == [] and m["moestream_expert_read_failed_requests_total"] == 0
        time.sleep(CHECK_INTERVAL)  # the bytes on disk are good: not listed
        assert get(server, "/health") == (200, {"status": "ok"})
        assert split(ask_all(server), alone) == []
    watch.assert_answered()


def test_dropped_stream_is_one_log_line(converted, alone, caplog, capfd) -> None:
    caplog.set_level(logging.INFO, "moestream.serve.app")  # before the drop
    with serve(converted, "python") as server:
        body = {"prompt": "def add", "max_tokens": CONTEXT, "stream": True}
        with socket.create_connection(server.httpd.server_address[:2], TIMEOUT) as s:
            data = json.dumps(body).encode()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            got = b""
            while b"data: " not in got:  # streaming: then gone
                got += s.recv(65536)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        wait_for(lambda: metrics(server)["moestream_requests_active"] == 0)
        wait_for(lambda: "went away" in caplog.text)
        assert ask(client_of(server), "def add", False) == alone["def add"]
    went = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(went) == 1 and "\n" not in went[0].getMessage()
    assert "Traceback" not in capfd.readouterr().err


def test_oversized_body_is_refused_at_once(converted, alone) -> None:
    with serve(converted, "python", max_body=1 << 20) as server:
        size = 50_000_000
        start = time.monotonic()
        with socket.create_connection(server.httpd.server_address[:2], TIMEOUT) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                + f"Content-Length: {size}\r\n\r\n".encode()
                + b'{"messages": "'
                + b"x" * (1 << 20)
            )
            head = s.recv(65536)
            while b"\r\n\r\n" not in head or not head.endswith(b"}"):
                head += s.recv(65536)
        took = time.monotonic() - start
        assert head.startswith(b"HTTP/1.0 413 ") and took < 1.0
        error = json.loads(head.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "body_too_large" and "--max-body" in error["message"]
        # a client that sends all of its body first still reads the answer
        with pytest.raises(openai.APIStatusError) as e:
            client_of(server).completions.create(
                model="model", prompt="x" * (2 << 20), max_tokens=1
            )
        assert e.value.status_code == 413
        with socket.create_connection(server.httpd.server_address[:2], TIMEOUT) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.0 400 ")  # not read to EOF
        assert ask(client_of(server), "def add", False) == alone["def add"]
        chat_413 = (
            'moestream_http_requests_total{path="/v1/chat/completions",code="413"}'
        )
        assert metrics(server)[chat_413] == 1


def test_chat_turn_fails_and_the_conversation_goes_on(converted) -> None:
    from mlx_lm.sample_utils import make_sampler

    from moestream import load
    from moestream.chat import Conversation

    model, tok = load(converted, cache_experts=2, engine="python")
    greedy = make_sampler(0.0)
    chat = Conversation(model, tok)
    first = chat.say("hello", 6, greedy).text
    used = chat.used
    for layer in load_manifest(converted).layers:  # the next read fails
        for e in range(layer.num_experts):
            fail_reads(model, layer.layer, e, 2)  # its read, and the retry
    with pytest.raises(ExpertReadError, match="Cannot read expert"):
        chat.say("a long message " * 4, 6, greedy)
    assert chat.used == used
    for layer in load_manifest(converted).layers:  # spent or not: read well now
        for e in range(layer.num_experts):
            fail_reads(model, layer.layer, e, -2)
    after = chat.say("again", 6, greedy).text
    fresh = Conversation(model, tok)
    assert fresh.say("hello", 6, greedy).text == first
    assert fresh.say("again", 6, greedy).text == after
    assert fresh.used == chat.used


def test_chat_cli_says_the_read_error_and_goes_on(copy, monkeypatch) -> None:
    lines = iter(["hello", "again", "q"])
    asked = []

    def typed(prompt: str) -> str:  # the model is loaded: damage it now
        if not asked:
            corrupt_layer(copy, load_manifest(copy).layers[0])
        asked.append(prompt)
        return next(lines)

    monkeypatch.setattr("builtins.input", typed)
    args = [str(copy), "-m", "3", "--cache-experts", "2", "--set", "engine=python"]
    r = CliRunner().invoke(chat_cmd, args)
    assert r.exit_code == 0, r.output
    assert len(asked) == 3  # every line was read: the chat went on
    errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert errors and all("fails its checksum" in x for x in errors)
    assert all("the conversation goes on" in x for x in errors)


def test_a_request_served_again_sends_each_token_once_or_fails() -> None:
    """The protocol of a request served again after a failed step: its second
    context and the tokens its client has are dropped; a token that differs
    ends it with the step's error, and stops the second answer."""

    def ctx() -> GenerationContext:
        return GenerationContext(False, False, None, None, "normal", [1, 2])

    def token(t: int) -> Response:
        return Response(str(t), t, 0.0, None, ())

    for again, want_tail in (([5, 6, 7], [7, None]), ([5, 9, 7], ["error"])):
        q: queue.Queue = queue.Queue()
        answers = _Answers(q, "request", "args")
        first = ctx()
        for item in (first, token(5), token(6)):
            answers.put(item)
        error = ExpertReadError("Expert 3 of layer 2 ... fails its checksum")
        answers.again(error)
        second = ctx()
        for item in (second, *map(token, again), None):
            answers.put(item)
        got = [q.get_nowait() for _ in range(q.qsize())]
        assert got[0] is first and [r.token for r in got[1:3]] == [5, 6]
        tail = [r.token if isinstance(r, Response) else r for r in got[3:]]
        assert tail == [error if w == "error" else w for w in want_tail]
        assert second._should_stop == (want_tail == ["error"])
        first.stop()  # the handler's stop reaches the second answer too
        assert second._should_stop


@pytest.mark.slow
def test_pipeline_rank_with_a_bad_record_stops_every_rank(copy) -> None:
    """serve --pipeline on 2 ranks: a record of rank 1's layers goes bad under
    it; rank 1 says so in one line, rank 0 that the pipeline broke; no hang."""
    import os
    import signal
    import subprocess
    import sys

    from moestream.pipeline import stages

    bin_dir = Path(sys.executable).parent
    port, ring = free_port(), free_port(2)
    args = [str(bin_dir / "mlx.launch"), "-n", "2", "--backend", "ring"]
    args += ["--starting-port", str(ring), "--", str(bin_dir / "moestream")]
    args += ["serve", str(copy), "--pipeline", "--port", str(port)]
    args += ["--cache-experts", "2", "--log-level", "WARNING"]
    p = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in p.stderr:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120), "".join(lines)
        owned = stages(copy, 2)[1].layers
        for layer in load_manifest(copy).layers:
            if layer.layer in owned:
                corrupt_layer(copy, layer)  # after load: read on the next miss
        body = json.dumps({"prompt": "def add", "max_tokens": 12}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {}
        )
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(request, timeout=60).read()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = "".join(lines)
    ones = [x for x in text.splitlines() if x.startswith("error: rank ")]
    assert any(
        x.startswith("error: rank 1: ") and "fails its checksum" in x for x in ones
    )
    assert any(x.startswith("error: rank 0: the pipeline broke") for x in ones), text


def free_port(n: int = 1) -> int:
    """A first port of `n` consecutive free ones (the ring listens on each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
