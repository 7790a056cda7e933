"""The HTTP side: mlx_lm.server's handler and response generator around the
served model, and the Server that binds them to a port."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import (
    APIHandler,
    GenerationContext,
    Response,
    ResponseGenerator,
    get_system_fingerprint,
)

from ..generate import chat_template_text
from ..pipeline import PipelineError, init, lost_peers
from ..runtime import ExpertReadError, RuntimeConfig, runtime_of
from . import page
from .faults import RecordFaults
from .metrics import PATHS, ServerMetrics, _Counted, render_metrics
from .provider import (
    RequestError,
    ServerOptions,
    StreamingModelProvider,
    plan_server,
)

log = logging.getLogger(__name__)


# mlx_lm.server's log lines (it logs each request at info, its default level).
LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"
# How long a refused body is read and dropped after its 413 is sent.
LINGER_SECONDS = 1.0


class _Answers:
    """A request's response queue as the generation loop sees it: what it was
    answered so far, and whether it has ended.

    A request served again after a failed step is answered anew from its
    start: its second context is not passed on (its stop is), and the tokens
    the client has already are checked and dropped; one that differs ends the
    request with the step's error, so no client gets a text it was not sent.
    """

    def __init__(self, queue, request, args) -> None:
        self.queue, self._request, self.args = queue, request, args
        self.ctx: GenerationContext | None = None
        self.answered = False  # anything put: a context, progress, tokens
        self.sent: list[int] = []  # the tokens passed on
        self.ended = False
        self.error: ExpertReadError | None = None  # set: served again, alone
        self._again: GenerationContext | None = None
        self._resent: list[int] = []  # `sent` when served again: checked, dropped

    @property
    def request(self) -> tuple:
        """What the generation loop takes from its queue."""
        return self, self._request, self.args

    def again(self, error: ExpertReadError) -> None:
        self.error, self._again, self._resent = error, None, list(self.sent)

    def put(self, item) -> None:
        if self.ended:
            return
        self.answered = True
        if isinstance(item, GenerationContext) and self.ctx is not None:
            self._again = item  # the handler holds the first one
            stop = self.ctx.stop
            self.ctx.stop = lambda: (stop(), item.stop())
            if self.ctx._should_stop:  # the client left already
                item.stop()
            return
        if isinstance(item, Response) and self._resent:
            if item.token == self._resent.pop(0):
                return
            item = self.error  # another text than the client has: fail it
            if self._again is not None:
                self._again.stop()
        if isinstance(item, GenerationContext):
            self.ctx = item
        if isinstance(item, Response):
            self.sent.append(item.token)
        self.ended = item is None or isinstance(item, Exception)
        self.queue.put(item)


class StreamingResponseGenerator(ResponseGenerator):
    """mlx_lm.server's generator: at most `concurrency` requests in flight (each
    holds a KV cache), every request within `context` tokens, and counted.

    A record that fails its read ends mlx_lm's loop in the batch step that read
    it; the loop starts again. The step's requests are served again one at a
    time (greedy ones, and sampled ones that had no token yet; other sampled
    ones fail), so only the one that needs the record fails; requests not
    started are served as they were.
    """

    def __init__(
        self,
        provider: StreamingModelProvider,
        prompt_cache: LRUPromptCache,
        context: int,
        concurrency: int,
        metrics: ServerMetrics,
        faults: RecordFaults,
    ) -> None:
        self.context = context
        self.metrics = metrics
        self.faults = faults
        self._admit = threading.BoundedSemaphore(concurrency)
        self._taken: weakref.WeakSet[_Answers] = weakref.WeakSet()
        self._alone: dict[int, _Answers] = {}  # by id of their arguments
        self.fatal: OSError | ValueError | None = None  # a pipeline rank's end
        self.on_fatal: Callable[[], None] = lambda: None
        super().__init__(provider, prompt_cache)  # starts the generation thread

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is None:
            return None
        answers = request[0]
        if not isinstance(answers, _Answers):  # else: queued again by _fail_taken
            answers = _Answers(*request)
        self._taken.add(answers)
        return answers.request

    def _is_batchable(self, args) -> bool:
        alone = self._alone.get(id(args))
        if alone is not None and alone.args is args and not alone.ended:
            return False
        return super()._is_batchable(args)

    def _generate(self) -> None:
        peers = lost_peers(init()) if self._is_distributed else nullcontext()
        while True:
            try:
                with peers:
                    return super()._generate()
            except ExpertReadError as e:  # mlx_lm's loop ends; start it again
                log.error("a batch step failed: %s", " ".join(str(e).split()))
                self.faults.report(e)
                if self._is_distributed:  # the other ranks wait inside the step
                    return self._stop_pipeline(
                        ExpertReadError(
                            f"rank {self._rank}: {' '.join(str(e).split())} A "
                            "pipeline stops at a bad record: check the model with "
                            f"`moestream verify {self.faults.directory}`, then "
                            "start it again."
                        )
                    )
                self._fail_taken(e)
            except PipelineError as e:  # another rank stopped
                return self._stop_pipeline(e)

    def _stop_pipeline(self, error: OSError | ValueError) -> None:
        """End this rank: the others wait in the failed step for it, and
        mlx.launch ends them once it is gone. The server raises `fatal`."""
        self.fatal = error
        self._generation_failed = True
        self.on_fatal()

    def _fail_taken(self, error: ExpertReadError) -> None:
        """Settle the requests the loop had taken when a step failed."""
        taken, self._taken = list(self._taken), weakref.WeakSet()
        self._alone = {k: a for k, a in self._alone.items() if not a.ended}
        for answers in taken:
            if answers.ended:
                continue
            greedy = answers.args.sampling.temperature == 0
            if not answers.answered:  # not started: nothing of it ran
                self.requests.put(answers.request)
            elif answers.error is None and (greedy or not answers.sent):
                answers.again(error)  # alone: it fails only if it needs the record
                self._alone[id(answers.args)] = answers
                self.requests.put(answers.request)
            else:
                answers.put(error)

    def _tokenize(self, tokenizer, request, args):
        try:
            out = super()._tokenize(tokenizer, request, args)
        except Exception as e:
            raise RequestError(400, f"Cannot make a prompt of this request: {e}") from e
        n = len(out[0])
        if n >= self.context:
            raise RequestError(
                400,
                f"The prompt has {n} tokens and the server's context is "
                f"{self.context}; send a shorter one, or start the server with a "
                "larger --context.",
            )
        args.max_tokens = min(args.max_tokens, self.context - n)  # KV stays in plan
        return out

    def generate(self, request, generation_args, progress_callback=None):
        while not self._admit.acquire(timeout=1.0):
            if not self.generation_available():
                raise RuntimeError("generation thread died")
        try:
            ctx, responses = super().generate(
                request, generation_args, progress_callback
            )
        except BaseException:
            self._admit.release()
            raise
        self.metrics.start(len(ctx.prompt), ctx.prompt_cache_count)

        def done() -> None:
            self.metrics.stop()
            self._admit.release()

        counted = _Counted(responses, self.metrics, done)
        stop = ctx.stop

        def stopped() -> None:  # the handler is done with it, however it ended
            stop()
            counted.close()

        ctx.stop = stopped
        return ctx, counted

    def stop_and_join(self) -> None:
        super().stop_and_join()
        _wait_ended(self._generation_thread)


def _wait_ended(thread: threading.Thread, timeout: float = 5.0) -> None:
    """Wait until the OS thread is gone, thread-local destructors included.

    MLX's per-thread compile cache releases Python objects when the thread
    ends, after `join` has returned; racing interpreter shutdown, that aborts
    the process ("terminate called without an active exception"). Linux only.
    """
    task = Path(f"/proc/self/task/{thread.native_id}")
    deadline = time.monotonic() + timeout
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class StreamingAPIHandler(APIHandler):
    """mlx_lm.server's handler, plus /metrics and a /v1/models of the served model."""

    def __init__(self, server_state: Server, *args: Any, **kwargs: Any) -> None:
        self.server_state = server_state
        super().__init__(server_state.generator, *args, **kwargs)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code  # counted when the headers go out (end_headers)
        super().send_response(code, message)

    def end_headers(self) -> None:
        path = getattr(self, "path", "").partition("?")[0]  # unset: a bad request line
        status = getattr(self, "_status", 0)
        self.server_state.metrics.response(path if path in PATHS else "other", status)
        super().end_headers()

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError as e:  # the client left: one line, no traceback
            log.info("client %s went away: %s", self.address_string(), str(e))

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0  # mlx_lm answers it
        if length < 0:  # mlx_lm would read until the client closes
            self.close_connection = True
            self._send_json(
                400,
                _error(
                    "Invalid Content-Length header",
                    "invalid_request_error",
                    "bad_content_length",
                ),
            )
            return
        limit = self.server_state.options.max_body
        if length > limit:  # refused before its body is read
            self.close_connection = True
            self._send_json(
                413,
                _error(
                    f"The request body is {length} bytes and this server takes at "
                    f"most {limit}; send a smaller one, or start the server with a "
                    "larger --max-body.",
                    "invalid_request_error",
                    "body_too_large",
                ),
            )
            self._discard(length)
            return
        super().do_POST()

    def _discard(self, length: int) -> None:
        """Let a client that sends its whole body before reading see the answer:
        drop what it sends, for at most LINGER_SECONDS (as a web server lingers)."""
        deadline = time.monotonic() + LINGER_SECONDS
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while length > 0 and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(min(length, 1 << 20))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:  # the client left, or was too slow: it has the answer
            pass

    def handle_completion(self, request, stop_words) -> None:
        try:
            super().handle_completion(request, stop_words)
        except ExpertReadError as e:  # the request needed a record that failed
            message = self.server_state.faults.failed(e)
            self._fail(500, _error(message, "server_error", "expert_read_error"))
        except RuntimeError:  # mlx_lm's: the generation thread is gone
            if self.response_generator.generation_available():
                raise
            message = "The server stopped generating; see its log."
            self._fail(503, _error(message, "server_error", "unavailable"))

    def _fail(self, status: int, body: dict) -> None:
        """End a completion whose 200 is out (streamed: an error event) or only
        buffered (replaced by `status`)."""
        if self.stream:
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()
        else:
            self._headers_buffer = []
            self._send_json(status, body)
        self.close_connection = True

    def handle_health_check(self) -> None:
        if not self.response_generator.generation_available():
            self._send_json(503, {"status": "unavailable"})
            return
        bad = self.server_state.faults.bad()
        if not bad:
            self._send_json(200, {"status": "ok"})
            return
        self._send_json(
            200,
            {
                "status": "degraded",
                "message": f"{len(bad)} expert records fail their read or "
                f"checksum; run `moestream verify {self.server_state.directory}`.",
                "bad_records": [b.as_dict() for b in bad],
            },
        )

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404:  # mlx_lm answers 404 to every generation error
            status_code = _status_of(sys.exc_info()[1], status_code)
        super()._set_completion_headers(status_code)

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        served = self.server_state.model_id
        if self.requested_model not in self.server_state.aliases:
            raise ValueError(
                f"Model {self.requested_model!r} is not served here; this server "
                f"serves {served!r} (GET /v1/models)."
            )
        self.requested_model = served

    def generate_response(self, *args: Any, **kwargs: Any) -> dict:
        response = super().generate_response(*args, **kwargs)
        top, chosen = kwargs.get("top_tokens"), kwargs.get("token_logprobs")
        if top and chosen:
            # mlx_lm names each token by the first of its unsorted top-n: name
            # the sampled one, and list the alternatives best first.
            ids = kwargs["tokens"]
            names = self.server_state.provider.tokenizer.convert_ids_to_tokens(ids)
            response["choices"][0]["logprobs"]["content"] = [
                {
                    "id": i,
                    "token": name,
                    "logprob": logprob,
                    "top_logprobs": sorted(t, key=lambda d: -d["logprob"]),
                }
                for i, name, logprob, t in zip(ids, names, chosen, top, strict=True)
            ]
        return response

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/metrics":
            self._send_text(self.server_state.metrics_text())
        elif page.answer(self, self.server_state, self.server_state.closing):
            pass  # the page, /stats and /stats/stream
        elif path.rstrip("/") == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self._model_card()]})
        elif path.startswith("/v1/models/"):
            if path.removeprefix("/v1/models/") in self.server_state.aliases:
                self._send_json(200, self._model_card())
            else:
                self._send_json(404, {"error": f"No model {path[11:]!r} here."})
        else:
            super().do_GET()

    def _model_card(self) -> dict:
        return {
            "id": self.server_state.model_id,
            "object": "model",
            "created": self.server_state.created,
            "owned_by": "moestream",
        }

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _error(message: str, kind: str, code: str) -> dict:
    """An error body in the OpenAI API's format."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _status_of(error: BaseException | None, default: int) -> int:
    if isinstance(error, RequestError):
        return error.status
    if isinstance(error, ExpertReadError):
        return 500
    if isinstance(error, RuntimeError):  # the generation thread is gone
        return 503
    return 500 if error is not None else default


class Server:
    """A running `moestream serve`: the model loaded, the port bound.

    with Server(out, RuntimeConfig(cache_experts=4), port=0) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="-")
    """

    def __init__(
        self,
        directory: str | Path,
        config: RuntimeConfig | None = None,
        options: ServerOptions | None = None,
        host: str = "127.0.0.1",
        port: int = 8080,
        log_level: str | None = None,
        pipeline: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.options = options or ServerOptions()
        self.rank, self.ranks = 0, 1
        self.closing = threading.Event()  # ends the page's stats streams
        logging.getLogger().addFilter(page.quiet_requests)  # no INFO per request
        if pipeline:  # one rank of mlx.launch: plan this rank's layers
            from ..pipeline import init, shard, stages, together

            group, cfg = init(), config or RuntimeConfig()
            self.rank, self.ranks = group.rank(), group.size()
            mine = together(group, lambda: stages(directory, group.size(), cfg))
            cut = shard(mine[self.rank])
            self.plan = together(
                group, lambda: plan_server(directory, cfg, self.options, cut)
            )
        else:
            self.plan = plan_server(directory, config or RuntimeConfig(), self.options)
        self.model_id = self.directory.resolve().name
        self.aliases = {self.model_id, "default_model", str(directory)}
        self.aliases.add(str(self.directory.resolve()))
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.faults = RecordFaults(self.directory)
        self.prompt_cache = LRUPromptCache(
            self.plan.prompt_cache_entries, self.plan.prompt_cache_bytes
        )
        self.provider = StreamingModelProvider(
            self._cli_args(log_level), self.model_id, self.plan.runtime, pipeline
        )
        self.generator = StreamingResponseGenerator(
            self.provider,
            self.prompt_cache,
            self.plan.runtime.context,
            self.plan.decode_concurrency,
            self.metrics,
            self.faults,
        )
        self._thread: threading.Thread | None = None
        self.provider.loaded.wait()
        try:
            if self.provider.load_error is not None:
                raise self.provider.load_error
            # the other ranks follow rank 0's requests (mlx_lm.server's way)
            self.httpd = self._listen(host, port) if self.rank == 0 else None
        except BaseException:
            self.generator.stop_and_join()
            raise

    def _listen(self, host: str, port: int) -> ThreadingHTTPServer:
        """Bind the port; a pipeline rank's end stops serving on it."""
        httpd = _bind(host, port, self)
        self.generator.on_fatal = lambda: threading.Thread(  # shutdown waits
            target=httpd.shutdown, daemon=True
        ).start()
        return httpd

    def _cli_args(self, log_level: str | None) -> argparse.Namespace:
        o = self.options
        c = self.plan.decode_concurrency
        return argparse.Namespace(
            model=str(self.directory),
            adapter_path=None,
            draft_model=None,
            num_draft_tokens=0,
            trust_remote_code=False,
            chat_template=chat_template_text(o.chat_template),
            use_default_chat_template=o.use_default_chat_template,
            chat_template_args=dict(o.chat_template_args),
            temp=o.temp,
            top_p=o.top_p,
            top_k=o.top_k,
            min_p=o.min_p,
            max_tokens=o.max_tokens,
            decode_concurrency=c,
            prompt_concurrency=min(o.prompt_concurrency, c),
            prefill_step_size=o.prefill_step_size,
            prompt_cache_size=self.plan.prompt_cache_entries,
            prompt_cache_bytes=None,  # our LRUPromptCache holds its own bound
            kv_bits=o.kv_bits,
            kv_group_size=o.kv_group_size,
            quantized_kv_start=o.quantized_kv_start,
            pipeline=False,
            allowed_origins=list(o.allowed_origins),
            log_level=log_level or "INFO",
        )

    @property
    def model(self):
        return self.provider.model

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def describe(self) -> str:
        return self.plan.describe(runtime_of(self.model).plan)

    def serve_forever(self) -> None:
        """Serve until stopped; a pipeline rank that met a bad record raises it."""
        if self.httpd is None:
            self.generator.join()  # until rank 0 stops
        else:
            self.httpd.serve_forever(poll_interval=0.2)
        if self.generator.fatal is not None:
            raise self.generator.fatal

    def start(self) -> Server:
        """Serve from a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop answering, finish the generation thread, free the model."""
        self.closing.set()
        if self._thread is not None and self.httpd is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        if self.httpd is not None:
            self.httpd.server_close()
        self.generator.stop_and_join()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def metrics_text(self) -> str:
        return render_metrics(
            self.metrics, self.model, self.plan.budget, self.prompt_cache, self.faults
        )


def _bind(host: str, port: int, state: Server) -> ThreadingHTTPServer:
    """The socket as mlx_lm.server's _run_http_server binds it (IPv4 or IPv6)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    fingerprint = get_system_fingerprint()

    class HTTPServer(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    return HTTPServer(
        address,
        lambda *a, **k: StreamingAPIHandler(
            state, *a, system_fingerprint=fingerprint, **k
        ),
    )
