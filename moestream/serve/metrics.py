"""The server's counters and their Prometheus text (/metrics)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import LRUPromptCache

from ..runtime import runtime_of, stats
from ..units import peak_rss
from .faults import RecordFaults
from .page import PATHS as PAGE_PATHS

# The paths /metrics counts responses of by name (others count as "other").
PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    *PAGE_PATHS,
)


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


Sample = tuple[dict, object]


class _Text:
    """Prometheus text format, one metric at a time."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, name: str, kind: str, help_: str, samples: list[Sample]) -> None:
        self.lines.append(f"# HELP moestream_{name} {help_}")
        self.lines.append(f"# TYPE moestream_{name} {kind}")
        for labels, value in samples:
            tag = ",".join(f'{k}="{v}"' for k, v in labels.items())
            self.lines.append(
                f"moestream_{name}{'{' + tag + '}' if tag else ''} {value}"
            )

    def one(self, name: str, kind: str, help_: str, value: object) -> None:
        self.add(name, kind, help_, [({}, value)])


def render_metrics(
    metrics: ServerMetrics,
    model: nn.Module | None,
    budget: int | None,
    prompt_cache: LRUPromptCache,
    faults: RecordFaults | None = None,
) -> str:
    """Prometheus text format: requests, tokens, speed, experts, faults, memory."""
    out = _Text()
    _requests(out, metrics)
    if faults is not None:
        _faults(out, faults)
    if model is not None:
        _experts(out, model, budget)
    out.one(
        "prompt_cache_sequences",
        "gauge",
        "Sequences in the prompt cache.",
        len(prompt_cache),
    )
    out.one(
        "prompt_cache_bytes",
        "gauge",
        "Bytes of KV in the prompt cache.",
        prompt_cache.nbytes,
    )
    out.one("peak_memory_bytes", "gauge", "Peak resident memory.", peak_rss())
    out.one(
        "mlx_peak_memory_bytes",
        "gauge",
        "Peak memory MLX allocated.",
        mx.get_peak_memory(),
    )
    return "\n".join(out.lines) + "\n"


def _requests(out: _Text, m: ServerMetrics) -> None:
    responses = sorted(m.responses.items())
    out.add(
        "http_requests_total",
        "counter",
        "HTTP responses by path and status.",
        [({"path": p, "code": c}, n) for (p, c), n in responses],
    )
    busy = m.busy_seconds
    gen = m.generation_tokens
    out.one("requests_active", "gauge", "Requests being answered.", m.active)
    out.one("prompt_tokens_total", "counter", "Prompt tokens.", m.prompt_tokens)
    out.one(
        "prompt_cached_tokens_total",
        "counter",
        "Prompt tokens found in the prompt cache.",
        m.cached_tokens,
    )
    out.one("generation_tokens_total", "counter", "Generated tokens.", gen)
    out.one(
        "busy_seconds_total",
        "counter",
        "Wall time with at least one request being answered.",
        f"{busy:.6f}",
    )
    out.one(
        "generation_tokens_per_second",
        "gauge",
        "Generated tokens per busy second (all requests together).",
        f"{gen / busy if busy else 0.0:.6f}",
    )


def _experts(out: _Text, model: nn.Module, budget: int | None) -> None:
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
        out.one(name, "counter", help_, value)
    out.one("expert_hit_rate", "gauge", "Hits / routed.", f"{s.hit_rate:.6f}")
    out.add(
        "expert_layer_misses_total",
        "counter",
        "Misses per MoE layer.",
        # dict() copies at once: the generation thread may add a layer
        [({"layer": k}, v) for k, v in sorted(dict(s.per_layer_misses).items())],
    )
    out.one(
        "expert_slots_per_layer",
        "gauge",
        "Resident expert slots in each MoE layer.",
        plan.capacity,
    )
    out.one("experts_per_layer", "gauge", "Experts per layer.", plan.num_experts)
    out.one(
        "memory_budget_bytes",
        "gauge",
        "The server's memory budget (0: none).",
        budget or 0,
    )


def _faults(out: _Text, faults: RecordFaults) -> None:
    bad = faults.bad()
    out.one(
        "expert_read_errors_total",
        "counter",
        "Expert records that failed their read or checksum while serving.",
        faults.read_errors,
    )
    out.one(
        "expert_read_failed_requests_total",
        "counter",
        "Requests that ended with an expert read error.",
        faults.failed_requests,
    )
    out.one(
        "expert_records_repaired_total",
        "counter",
        "Bad records whose bytes on disk passed their checksum again.",
        faults.repaired,
    )
    out.one("expert_bad_records", "gauge", "Records still bad on disk.", len(bad))
    out.add(
        "expert_bad_record",
        "gauge",
        "1 for each record still bad on disk.",
        [({"layer": b.layer, "expert": b.expert}, 1) for b in bad],
    )
