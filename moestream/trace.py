"""Traces of a run (`run-moe --trace FILE`): JSON lines, one per MoE layer call.

The first line describes the run: {"moestream_trace": 1, "model", "capacity",
"num_experts", "top_k", "policy", "record_bytes": {layer: bytes}}. Every
other line is one `RuntimeStats.events` entry: {"layer", "step" (that
layer's call since the model was loaded: the prompt's chunks, then one per
decoded token), "tokens", "experts" (routed, flattened), "hits", "misses"
(distinct experts), "prefetched" (experts prefetched for this call),
"bytes_read"}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn
import numpy as np

from .families import get_family
from .runtime.loader import runtime_of

TRACE_VERSION = 1
EVENT_KEYS = ("layer", "step", "tokens", "experts", "hits", "misses", "bytes_read")


@dataclass
class Trace:
    meta: dict[str, Any]
    events: list[dict[str, Any]]

    def layers(self) -> list[int]:
        return sorted({e["layer"] for e in self.events})

    def routing(self, layer: int) -> np.ndarray:
        """Layer `layer`'s routed experts, one row per token, in call order."""
        rows = [
            np.array(e["experts"], np.int64).reshape(e["tokens"], -1)
            for e in self.events
            if e["layer"] == layer
        ]
        k = self.meta.get("top_k", 1)
        return np.concatenate(rows) if rows else np.zeros((0, k), np.int64)


def trace_meta(model: nn.Module) -> dict[str, Any]:
    rt = runtime_of(model)
    config = json.loads((rt.directory / "config.json").read_text())
    return {
        "moestream_trace": TRACE_VERSION,
        "model": str(rt.directory),
        "capacity": rt.plan.capacity,
        "num_experts": rt.plan.num_experts,
        "top_k": get_family(config).top_k(config),
        "policy": rt.config.tuning.policy,
        "record_bytes": {str(x.layer): x.record_nbytes for x in rt.manifest.layers},
    }


def write_trace(model: nn.Module, path: str | Path) -> int:
    """Write the events recorded by `model` (loaded with record_trace) to
    `path` (a temporary name, then renamed); return how many."""
    stats = runtime_of(model).stats
    if not stats.recording:
        raise ValueError("The model was not loaded with record_trace=True.")
    events = stats.events
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(trace_meta(model)) + "\n")
            for e in events:
                f.write(json.dumps(e) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(events)


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace file; ValueError names what is wrong."""
    try:
        lines = Path(path).read_text().splitlines()
        meta = json.loads(lines[0]) if lines else {}
        events = [json.loads(line) for line in lines[1:] if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a moestream trace ({e}).") from None
    if not isinstance(meta, dict) or meta.get("moestream_trace") != TRACE_VERSION:
        raise ValueError(
            f"{path} is not a moestream trace (version {TRACE_VERSION}); write one "
            "with run-moe --trace FILE."
        )
    for n, e in enumerate(events, start=2):
        if not isinstance(e, dict) or any(k not in e for k in EVENT_KEYS):
            raise ValueError(f"{path} line {n}: not a trace event.")
    if not events:
        raise ValueError(f"{path} holds no events.")
    return Trace(meta, events)
