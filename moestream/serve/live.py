"""What the serve page draws: snapshots of the runtime's stats, and their stream.

`snapshot(server)` reads a running server's counters (the same objects
/metrics reads) into one JSON-able dict; `stream_events` writes snapshots as
Server-Sent Events at a few Hz until the client goes, `count` events are
sent, or `stop` is set. Nothing here runs in the generation thread: the page
costs the hot path no branch, only the counters it already keeps.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_config

from ..families import get_family
from ..runtime import native, runtime_of, stats
from ..runtime.switch import StreamingSwitchGLU
from ..units import peak_rss

# The page's default rate, and the bounds a client may ask for (seconds).
INTERVAL = 0.25
MIN_INTERVAL, MAX_INTERVAL = 0.05, 10.0


class Served(Protocol):
    """What a snapshot reads of a server (moestream serve's Server)."""

    model_id: str
    rank: int
    ranks: int
    metrics: Any  # ServerMetrics
    plan: Any  # ServePlan
    prompt_cache: Any  # mlx-lm's LRUPromptCache

    @property
    def model(self) -> Any: ...


def streaming_layers(model: Any) -> list[StreamingSwitchGLU]:
    """The model's streaming MoE layers in layer order (this rank's only)."""
    found = [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]
    return sorted(found, key=lambda m: m.layer.layer)


def slots_visible(model: Any) -> bool:
    """Whether the host knows the slot tables: not where a GPU kernel resolves
    them (reading the device's table then would race the stream)."""
    return not runtime_of(model).execution.device_resolve


def layer_view(m: StreamingSwitchGLU, s: Any, visible: bool) -> dict:
    """One MoE layer: the expert in each slot (-1: free), each expert's uses."""
    n, cap = m.layer.num_experts, m.capacity
    uses = s.expert_uses.get(m.layer.layer)
    slots: list[int] | None = None
    if visible:
        table = m.slot_table()
        held = np.flatnonzero(table < cap)
        by_slot = np.full(cap, -1, np.int64)
        by_slot[table[held]] = held
        slots = by_slot.tolist()
    return {
        "layer": m.layer.layer,
        "experts": n,
        "capacity": cap,
        "slots": slots,
        "uses": [0] * n if uses is None else uses.tolist(),
        "misses": s.per_layer_misses.get(m.layer.layer, 0),
    }


def tier_view(s: Any) -> dict | None:
    """The native host tier's fill, if the model has one."""
    for obj in s.native:
        if not hasattr(obj, "table") and hasattr(obj, "record_bytes"):
            filled = native.tier_filled(obj)
            return {
                "records": obj.capacity,
                "filled": filled,
                "record_bytes": obj.record_bytes,
            }
    return None


def current_rss() -> int:
    """This process's resident memory now (Linux; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss()


def memory_view(server: Served) -> dict:
    """The plan's parts (what the budget holds) and what is resident now."""
    plan = runtime_of(server.model).plan
    rss = current_rss()
    return {
        "budget": server.plan.budget or 0,
        "planned": plan.total + server.plan.prompt_cache_bytes,
        "process": plan.process,
        "dense": plan.dense,
        "kv_cache": plan.kv_cache,
        "activations": plan.activations,
        "staging": plan.staging,
        "experts": plan.pools,
        "reserve": plan.reserve,
        "other": plan.process + plan.activations + plan.staging + plan.reserve,
        "prompt_cache_limit": server.plan.prompt_cache_bytes,
        "prompt_cache": server.prompt_cache.nbytes,
        "rss": rss,
        "peak_rss": max(rss, peak_rss()),  # the kernel's high-water mark lags
        "mlx_active": mx.get_active_memory(),
        "mlx_peak": mx.get_peak_memory(),
    }


def requests_view(server: Served) -> dict:
    m = server.metrics
    busy = m.busy_seconds
    return {
        "active": m.active,
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "generation_tokens": m.generation_tokens,
        "busy_seconds": busy,
        "tokens_per_second": m.generation_tokens / busy if busy else 0.0,
        "decode_concurrency": server.plan.decode_concurrency,
    }


def model_name(manifest: Any, fallback: str) -> str:
    """The model's name as its manifest records it: the hub id, else the name
    the source's config.json carried (a path's last part), else `fallback`."""
    source = manifest.source or {}
    named = source.get("repo_id") or source.get("name")
    if not named:
        return fallback
    named = str(named)
    return Path(named).name if named.startswith(("/", ".", "~")) else named


def model_view(model: Any, fallback: str) -> dict:
    """The header's line: the model's name, family and experts."""
    runtime = runtime_of(model)
    layers = runtime.manifest.layers
    config = _config(str(runtime.directory))
    return {
        "name": model_name(runtime.manifest, fallback),
        "family": runtime.manifest.model_type,
        "moe_layers": len(layers),
        "experts": max((x.num_experts for x in layers), default=0),
        "top_k": get_family(config).top_k(config),
    }


@functools.cache
def _config(directory: str) -> dict:
    return load_config(Path(directory))


def snapshot(server: Served) -> dict:
    """Everything the page draws, as of now; JSON-able."""
    out: dict[str, Any] = {
        "time": time.time(),
        "model": server.model_id,
        "rank": server.rank,
        "ranks": server.ranks,
        "requests": requests_view(server),
    }
    model = server.model
    if model is None:  # not loaded (yet)
        return out
    s = stats(model)
    visible = slots_visible(model)
    out["backend"] = runtime_of(model).execution.as_dict()
    out["experts"] = s.as_dict()
    out["slots_visible"] = visible
    out["layers"] = [layer_view(m, s, visible) for m in streaming_layers(model)]
    out["host_tier"] = tier_view(s)
    out["memory"] = memory_view(server)
    out["about"] = model_view(model, server.model_id)
    return out


def parse_query(query: str) -> tuple[float, int | None]:
    """`interval=S&count=N` of a stream request -> (interval, count or None)."""
    args = parse_qs(query)
    try:
        interval = float(args.get("interval", [INTERVAL])[0])
        count = int(args["count"][0]) if "count" in args else None
    except ValueError:
        raise ValueError(
            "interval must be seconds and count a whole number, "
            "e.g. /stats/stream?interval=0.25&count=10"
        ) from None
    if count is not None and count < 1:
        raise ValueError("count must be 1 or more.")
    return min(max(interval, MIN_INTERVAL), MAX_INTERVAL), count


def event(data: dict) -> bytes:
    """One Server-Sent Event whose data is `data` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def stream_events(
    write: Callable[[bytes], None],
    read: Callable[[], dict],
    interval: float = INTERVAL,
    count: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Write `read()` as an event every `interval` seconds until `count`
    events are sent, `stop` is set, or `write` fails (the client left).
    Returns the events sent."""
    stop = stop or threading.Event()
    sent = 0
    while not stop.is_set() and (count is None or sent < count):
        try:
            write(event(read()))
        except OSError:  # BrokenPipe, ConnectionReset: the page was closed
            break
        sent += 1
        if count is None or sent < count:
            stop.wait(interval)
    return sent
