"""moestream serve OUT: mlx_lm.server's OpenAI API in front of a streaming model.

mlx_lm.server does the work: its APIHandler (HTTP, SSE, tools, logprobs),
ResponseGenerator and BatchGenerator (continuous batching), LRUPromptCache.
What is ours: moestream's load behind its ModelProvider, a memory plan that
counts the sequences decoded at once and the prompt cache, a context bound per
request, /v1/models for the one served model, and /metrics.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import click
import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import (
    APIHandler,
    ModelProvider,
    ResponseGenerator,
    get_system_fingerprint,
)
from mlx_lm.utils import load_config

from . import web
from .errors import user_errors
from .families import get_family
from .options import CONTEXT, engine_options, logging_options
from .runtime import BudgetError, RuntimeConfig, load, runtime_of, stats
from .runtime.loader import PREFILL_STEP, MemoryPlan, Shard, budget_for, plan_for
from .units import human_bytes, parse_size, peak_rss

log = logging.getLogger(__name__)

# RuntimeConfig fields that are not serve flags of their own: --trace FILE sets
# record_trace, and --decode-concurrency (mlx_lm.server's name) concurrency.
ENGINE_EXCLUDED = ("record_trace", "concurrency")
# mlx_lm.server's log lines (it logs each request at info, its default level).
LOG_FORMAT = "%(asctime)s - %(levelname)s - %(message)s"

# Without --decode-concurrency: as many sequences at once as the budget holds,
# up to this many (each one more routes a decode step to up to top-k more experts).
DEFAULT_DECODE_CONCURRENCY = 4


# The paths /metrics counts responses of by name (others count as "other").
PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    *web.PATHS,
)


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerOptions:
    """mlx_lm.server's options that apply to a moestream model (same names).

    decode_concurrency: sequences decoded at once; None: as many as the memory
        budget holds, up to DEFAULT_DECODE_CONCURRENCY.
    prompt_cache_bytes: bound of the prompt cache; None: `prompt_cache_size`
        sequences of `context` tokens, or half of what the budget leaves after
        the minimum for decoding, whichever is less.
    chat_template: a Jinja template, or a file that holds one.
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    chat_template: str = ""
    use_default_chat_template: bool = False
    chat_template_args: dict = field(default_factory=dict)
    decode_concurrency: int | None = None
    prompt_concurrency: int = 8
    prefill_step_size: int = PREFILL_STEP
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    allowed_origins: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        if self.decode_concurrency is not None and self.decode_concurrency < 1:
            raise ValueError("--decode-concurrency must be at least 1.")
        if self.prompt_concurrency < 1:
            raise ValueError("--prompt-concurrency must be at least 1.")
        if not 1 <= self.prefill_step_size <= PREFILL_STEP:
            raise ValueError(
                f"--prefill-step-size must be 1 to {PREFILL_STEP}: the memory plan "
                f"sizes a prefill chunk's activations for {PREFILL_STEP} tokens."
            )
        if self.prompt_cache_size < 0:
            raise ValueError("--prompt-cache-size must be 0 or more.")


def chat_template_text(value: str) -> str:
    """--chat-template: the template itself, or a file that holds it."""
    try:
        if value and Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a template's text too long for a file name
        pass
    return value


@dataclass(frozen=True)
class ServePlan:
    """How the server's memory budget splits between the model and its caches."""

    runtime: RuntimeConfig  # what `load` gets: the budget less the prompt cache
    decode_concurrency: int
    prompt_cache_entries: int
    prompt_cache_bytes: int
    kv_per_sequence: int
    budget: int | None

    def describe(self, plan: MemoryPlan) -> str:
        h = human_bytes
        return (
            f"server plan: {self.decode_concurrency} sequences decoded at once, "
            f"prompt cache of up to {self.prompt_cache_entries} sequences in "
            f"{h(self.prompt_cache_bytes)} ({h(self.kv_per_sequence)} per "
            f"{self.runtime.context} tokens); model "
            + plan.describe().removeprefix("memory plan: ")
        )


def plan_server(
    directory: str | Path,
    config: RuntimeConfig,
    options: ServerOptions,
    shard: Shard | None = None,
) -> ServePlan:
    """Fit decode concurrency and the prompt cache into `config`'s budget.

    A concurrency that was asked for is refused when it does not fit; the
    default one is lowered until it does. Reads no weight.
    """
    base = plan_for(directory, replace(config, concurrency=1), shard)  # BudgetError
    kv1 = base.kv_cache
    budget = base.budget  # the default budget when none was given
    entries = options.prompt_cache_size
    model_config = load_config(Path(directory))
    top_k = get_family(model_config).top_k(model_config)
    asked = options.decode_concurrency
    if options.kv_bits is not None:  # mlx_lm.server serves these one at a time
        asked = 1
    candidates = [asked] if asked else range(DEFAULT_DECODE_CONCURRENCY, 0, -1)
    error: BudgetError | None = None
    for c in candidates:
        runtime = replace(config, concurrency=c)
        slots = config.cache_experts or min(base.num_experts, c * top_k)
        try:
            need = budget_for(directory, slots, config.context, runtime, shard)
        except BudgetError as e:  # too few --cache-experts for c sequences
            error = e
            continue
        if budget is None:  # --cache-experts without a budget: nothing to fit
            cache = options.prompt_cache_bytes or max(entries * kv1, 1)
            return ServePlan(runtime, c, entries, cache, kv1, None)
        spare = budget - need
        cache = options.prompt_cache_bytes
        if cache is None:
            cache = max(min(entries * kv1, spare // 2), 1)
        if need + cache <= budget:
            runtime = replace(runtime, memory_budget=budget - cache)
            return ServePlan(runtime, c, entries, cache, kv1, budget)
        error = BudgetError(
            f"Memory budget {human_bytes(budget)} is too small to serve: {c} "
            f"sequences at once need {human_bytes(need)} and the prompt cache "
            f"{human_bytes(cache)}; give --memory-budget "
            f"{human_bytes(need + cache, up=True)} or more, or a smaller "
            "--decode-concurrency, --prompt-cache-bytes or --context."
        )
    assert error is not None
    raise error


class StreamingModelProvider(ModelProvider):
    """mlx_lm.server's ModelProvider, loading the one converted model it serves."""

    def __init__(
        self,
        cli_args: argparse.Namespace,
        model_id: str,
        config: RuntimeConfig,
        pipeline: bool = False,
    ) -> None:
        super().__init__(cli_args)
        self.model_id = model_id
        self.runtime_config = config
        self._model_map[model_id] = cli_args.model
        self.pipeline = pipeline
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise RequestError(400, "Adapters and draft models are not served here.")
        if model_path != self.cli_args.model:
            raise RequestError(404, f"Model {model_path!r} is not served here.")
        self.reset()
        gc.collect()
        mx.clear_cache()
        if self.pipeline:  # this rank's layers; mlx-lm shares the requests
            from .pipeline import init, load_stage

            model, tokenizer, _ = load_stage(
                model_path, self.runtime_config, init(), None, self._tokenizer_config
            )
        else:
            model, tokenizer = load(
                model_path, self.runtime_config, tokenizer_config=self._tokenizer_config
            )
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))

    def load_default(self) -> None:
        """Load in the generation thread, as mlx_lm.server does; tell the caller."""
        try:
            super().load_default()
        except Exception as e:  # reported by Server.start, which then stops
            self.load_error = e
        finally:
            self.loaded.set()


class ServerMetrics:
    """Request and token counters of a server; read by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.active = 0
        self._busy = 0.0
        self._busy_since = 0.0

    def response(self, path: str, status: int) -> None:
        with self._lock:
            self.responses[(path, status)] += 1

    def start(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += max(cached_tokens, 0)
            if self.active == 0:
                self._busy_since = time.perf_counter()
            self.active += 1

    def token(self) -> None:
        with self._lock:
            self.generation_tokens += 1

    def stop(self) -> None:
        with self._lock:
            self.active -= 1
            if self.active == 0:
                self._busy += time.perf_counter() - self._busy_since

    @property
    def busy_seconds(self) -> float:
        """Wall time during which at least one request was being answered."""
        with self._lock:
            now = time.perf_counter() - self._busy_since if self.active else 0.0
            return self._busy + now


class _Counted:
    """A request's responses, counted; `done` runs once, however it ends."""

    def __init__(self, responses, metrics: ServerMetrics, done) -> None:
        self._responses = responses
        self._metrics = metrics
        self._done = done

    def __iter__(self):
        return self

    def __next__(self):
        try:
            response = next(self._responses)
        except BaseException:
            self.close()
            raise
        self._metrics.token()
        return response

    def close(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def __del__(self) -> None:  # a handler that stopped early drops us
        self.close()


class StreamingResponseGenerator(ResponseGenerator):
    """mlx_lm.server's generator: at most `concurrency` requests in flight (each
    holds a KV cache), every request within `context` tokens, and counted."""

    def __init__(
        self,
        provider: StreamingModelProvider,
        prompt_cache: LRUPromptCache,
        context: int,
        concurrency: int,
        metrics: ServerMetrics,
    ) -> None:
        self.context = context
        self.metrics = metrics
        self._admit = threading.BoundedSemaphore(concurrency)
        super().__init__(provider, prompt_cache)  # starts the generation thread

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

        return ctx, _Counted(responses, self.metrics, done)

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
        path = getattr(self, "path", "").partition("?")[0]  # unset: a bad request line
        self.server_state.metrics.response(path if path in PATHS else "other", code)
        super().send_response(code, message)

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
        elif web.answer(self, self.server_state, self.server_state.closing):
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


def _status_of(error: BaseException | None, default: int) -> int:
    if isinstance(error, RequestError):
        return error.status
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
        if pipeline:  # one rank of mlx.launch: plan this rank's layers
            from .pipeline import init, shard, stages, together

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
        self.aliases = {
            self.model_id,
            "default_model",
            str(directory),
            str(self.directory.resolve()),
        }
        self.created = int(time.time())
        self.metrics = ServerMetrics()
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
        )
        self._thread: threading.Thread | None = None
        self.provider.loaded.wait()
        try:
            if self.provider.load_error is not None:
                raise self.provider.load_error
            # the other ranks follow rank 0's requests (mlx_lm.server's way)
            self.httpd = _bind(host, port, self) if self.rank == 0 else None
        except BaseException:
            self.generator.stop_and_join()
            raise

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
        if self.httpd is None:
            self.generator.join()  # until rank 0 stops
            return
        self.httpd.serve_forever(poll_interval=0.2)

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
        return render_metrics(self)


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


def render_metrics(server: Server) -> str:
    """Prometheus text format: requests, tokens, speed, experts, memory."""
    m = server.metrics
    model = server.model
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list) -> None:
        lines.append(f"# HELP moestream_{name} {help_}")
        lines.append(f"# TYPE moestream_{name} {kind}")
        for labels, value in samples:
            tag = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"moestream_{name}{'{' + tag + '}' if tag else ''} {value}")

    responses = sorted(m.responses.items())
    metric(
        "http_requests_total",
        "counter",
        "HTTP responses by path and status.",
        [({"path": p, "code": c}, n) for (p, c), n in responses],
    )
    busy = m.busy_seconds
    gen = m.generation_tokens
    metric("requests_active", "gauge", "Requests being answered.", [({}, m.active)])
    metric("prompt_tokens_total", "counter", "Prompt tokens.", [({}, m.prompt_tokens)])
    metric(
        "prompt_cached_tokens_total",
        "counter",
        "Prompt tokens found in the prompt cache.",
        [({}, m.cached_tokens)],
    )
    metric("generation_tokens_total", "counter", "Generated tokens.", [({}, gen)])
    metric(
        "busy_seconds_total",
        "counter",
        "Wall time with at least one request being answered.",
        [({}, f"{busy:.6f}")],
    )
    metric(
        "generation_tokens_per_second",
        "gauge",
        "Generated tokens per busy second (all requests together).",
        [({}, f"{gen / busy if busy else 0.0:.6f}")],
    )
    if model is not None:
        s = stats(model)
        plan = runtime_of(model).plan
        for name, value, help_ in (
            ("expert_hits_total", s.hits, "Routed experts found in a slot."),
            ("expert_misses_total", s.misses, "Routed experts read from disk."),
            ("expert_evictions_total", s.evictions, "Experts evicted from a slot."),
            ("expert_bytes_read_total", s.bytes_read, "Bytes of expert records read."),
            ("expert_fill_bytes_total", s.fill_bytes, "Bytes copied into slots."),
            ("prefetched_total", s.prefetched, "Experts read ahead."),
            ("prefetch_bytes_total", s.prefetch_bytes, "Bytes read ahead."),
        ):
            metric(name, "counter", help_, [({}, value)])
        metric(
            "expert_hit_rate", "gauge", "Hits / routed.", [({}, f"{s.hit_rate:.6f}")]
        )
        metric(
            "expert_layer_misses_total",
            "counter",
            "Misses per MoE layer.",
            # dict() copies at once: the generation thread may add a layer
            [({"layer": k}, v) for k, v in sorted(dict(s.per_layer_misses).items())],
        )
        metric(
            "expert_slots_per_layer",
            "gauge",
            "Resident expert slots in each MoE layer.",
            [({}, plan.capacity)],
        )
        metric(
            "experts_per_layer", "gauge", "Experts per layer.", [({}, plan.num_experts)]
        )
        metric(
            "memory_budget_bytes",
            "gauge",
            "The server's memory budget (0: none).",
            [({}, server.plan.budget or 0)],
        )
    metric(
        "prompt_cache_sequences",
        "gauge",
        "Sequences in the prompt cache.",
        [({}, len(server.prompt_cache))],
    )
    metric(
        "prompt_cache_bytes",
        "gauge",
        "Bytes of KV in the prompt cache.",
        [({}, server.prompt_cache.nbytes)],
    )
    metric("peak_memory_bytes", "gauge", "Peak resident memory.", [({}, peak_rss())])
    metric(
        "mlx_peak_memory_bytes",
        "gauge",
        "Peak memory MLX allocated.",
        [({}, mx.get_peak_memory())],
    )
    return "\n".join(lines) + "\n"


def _json_object(ctx, param, value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"x\": 1}'")
    return parsed


def _size(ctx, param, value: str | None) -> int | None:
    try:
        return None if value is None else parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int, help="0: any free.")
@engine_options(exclude=ENGINE_EXCLUDED)
@click.option(
    "--allowed-origins",
    default="*",
    show_default=True,
    help="CORS origins, comma-separated.",
)
@click.option(
    "--chat-template", default="", help="Chat template (Jinja text or a file)."
)
@click.option(
    "--use-default-chat-template",
    is_flag=True,
    help="The tokenizer's default template when the model has none.",
)
@click.option(
    "--chat-template-args",
    default="{}",
    callback=_json_object,
    help="JSON object of apply_chat_template arguments, e.g. "
    "'{\"enable_thinking\":false}'.",
)
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=float,
    help="Default sampling temperature.",
)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option(
    "--max-tokens",
    default=512,
    show_default=True,
    type=int,
    help="Default tokens to generate.",
)
@click.option(
    "--decode-concurrency",
    default=None,
    type=int,
    help="Sequences decoded at once, the engine's concurrency (default: as many "
    f"as fit, up to {DEFAULT_DECODE_CONCURRENCY}).",
)
@click.option(
    "--prompt-concurrency",
    default=8,
    show_default=True,
    type=int,
    help="Prompts prefilled at once (at most --decode-concurrency).",
)
@click.option("--prefill-step-size", default=PREFILL_STEP, show_default=True, type=int)
@click.option(
    "--prompt-cache-size",
    default=10,
    show_default=True,
    type=int,
    help="Sequences kept in the prompt cache.",
)
@click.option(
    "--prompt-cache-bytes",
    default=None,
    callback=_size,
    help="Bound of the prompt cache, e.g. 1G (default: within the budget).",
)
@click.option(
    "--kv-bits",
    default=None,
    type=int,
    help="Quantize the KV cache (requests then run one at a time).",
)
@click.option("--kv-group-size", default=64, show_default=True, type=int)
@click.option(
    "--quantized-kv-start",
    default=DEFAULT_QUANTIZED_KV_START,
    show_default=True,
    type=int,
)
@click.option(
    "--trace",
    "trace_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Record every MoE layer call and write it as run-moe --trace does "
    "when the server stops (it grows with every token served).",
)
@click.option(
    "--pipeline",
    is_flag=True,
    help="Run as one rank of a pipeline started by mlx.launch: rank 0 serves "
    "HTTP, every rank runs its share of the layers.",
)
@logging_options("info", fmt=LOG_FORMAT)
def serve_cmd(
    model_dir: str,
    host: str,
    port: int,
    trace_file: str | None,
    pipeline: bool,
    engine: dict,
    **flags: Any,
) -> None:
    """Serve a converted model OUT with an OpenAI-compatible API (mlx_lm.server's).

    POST /v1/chat/completions and /v1/completions (streaming or not), GET
    /v1/models, /health and /metrics (Prometheus). The engine flags are
    run-moe's; --memory-budget bounds the whole server, prompt cache included.
    """
    flags["allowed_origins"] = tuple(flags["allowed_origins"].split(","))

    def start() -> Server:
        options = ServerOptions(**flags)
        config = RuntimeConfig(**engine, record_trace=bool(trace_file))
        if pipeline and trace_file:
            raise ValueError("--pipeline does not take --trace yet.")
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        return Server(model_dir, config, options, host, port, level, pipeline)

    server = user_errors(start)
    if server.rank == 0:
        click.echo(server.describe(), err=True)
        click.echo(
            f"serving {server.model_id!r} at {server.url}/v1 (Ctrl-C stops)", err=True
        )
    if server.rank == 0 and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(
            "note: mlx_lm.server only implements basic security checks; "
            "keep it behind a trusted network.",
            err=True,
        )
    # Stop on SIGTERM as on Ctrl-C; the caller's handler is back afterwards.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if trace_file:  # before close, which lets go of the model
            from .trace import write_trace

            calls = write_trace(server.model, trace_file)
            click.echo(f"trace: {calls} MoE layer calls -> {trace_file}", err=True)
        server.close()
    click.echo("stopped", err=True)
