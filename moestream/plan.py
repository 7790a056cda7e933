"""moestream plan OUT: the memory plan run-moe would use, and a decode forecast.

The plan is `runtime.loader.plan_for`, the code `load` plans with, on the
lazily built model: no weight is read. The forecast comes from two short
probes of this machine:

- compute: the model's own mlx-lm graph, built from its config with random
  weights of the stored shapes and dtypes (top-k experts per layer, so every
  call computes k experts as a real decode does), decoding a few tokens with
  mlx-lm's `generate_step`: once as is (a layer holding every expert never
  syncs) and once with the host sync a streaming layer waits for;
- disk: whole expert records read at random from the blobs, cold (one at a
  time and all hinted at once, as `moestream bench` measures) and from the
  page cache.

Time per token = compute with a sync per MoE layer + missed bytes per token
over the read bandwidth, with the hit rate of uniform routing (slots / experts:
trained routing hits more, see README), or compute alone when every expert
has a slot.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_config

from .bench.harness import disk_bandwidth
from .families import (
    build_model,
    cast_floating,
    get_family,
    quantize_as_configured,
    replace_module,
    switch_modules,
)
from .formats import BlobReader, Manifest, load_manifest
from .formats.manifest import inside
from .runtime.config import RuntimeConfig
from .runtime.loader import MemoryPlan, dense_weights, plan_for, resolve_dtype

# Decode steps of the compute probe after one warm-up step, and its time cap.
PROBE_TOKENS = 16
PROBE_SECONDS = 2.0
PROBE_ROUNDS = 2
PROMPT_TOKENS = 16
# Records read by each disk probe.
DISK_RECORDS = 32


@dataclass(frozen=True)
class Probe:
    """What this machine measured: seconds per decode token and read GB/s."""

    token_s: float  # resident compute, no host sync (every expert in a slot)
    token_sync_s: float  # the same with one host sync per MoE layer
    late_call_s: float  # one more expert call of one token, evaluated alone
    disk_qd1_gbps: float
    disk_parallel_gbps: float
    page_cache_gbps: float


@dataclass(frozen=True)
class Forecast:
    hit_rate: float  # uniform routing: slots / experts
    misses_per_token: float
    late_calls_per_token: float  # MoE layers per token with a miss
    bytes_per_token: float
    warm_tps: float
    cold_tps: float


def plan_dict(plan: MemoryPlan, cfg: RuntimeConfig) -> dict[str, Any]:
    d = asdict(plan)
    d.update(
        pools=plan.pools,
        total=plan.total,
        residency=plan.capacity / plan.num_experts,
        context=cfg.context,
    )
    return d


def forecast(
    manifest: Manifest, config: dict, plan: MemoryPlan, probe: Probe
) -> Forecast:
    """Decode tok/s at `plan`'s slots, from `probe`'s measurements.

    Uniform routing: each of a token's k experts hits with probability
    slots / experts, and a layer misses unless all k hit. A layer that misses
    pays a second expert call for the missed rows and the reads of its misses.
    """
    if plan.capacity >= plan.num_experts:
        t = probe.token_s
        return Forecast(1.0, 0.0, 0.0, 0.0, 1 / t, 1 / t)
    k = get_family(config).top_k(config)
    layers = len(manifest.layers)
    hit = plan.capacity / plan.num_experts
    misses = (1 - hit) * k * layers
    late = (1 - hit**k) * layers
    record = statistics.mean(layer.record_nbytes for layer in manifest.layers)
    fixed = probe.token_sync_s + late * probe.late_call_s
    warm = fixed + misses * record / (probe.page_cache_gbps * 1e9)
    cold = fixed + misses * record / (probe.disk_parallel_gbps * 1e9)
    return Forecast(hit, misses, late, misses * record, 1 / warm, 1 / cold)


def run_probe(path: str | Path, dtype: str = "auto") -> Probe:
    directory = Path(path)
    manifest = load_manifest(directory)
    config = load_config(directory)
    model = probe_model(directory, manifest, config, dtype)
    vocab = {**config, **config.get("text_config", {})}["vocab_size"]
    switches = [m for m in model.modules() if isinstance(m, _TopK)]
    free, synced = [], []
    for _ in range(PROBE_ROUNDS):  # interleaved: the machine's load drifts
        for s in switches:
            s._sync = False
        free.append(_decode_seconds(model, vocab))
        for s in switches:
            s._sync = True
        synced.append(_decode_seconds(model, vocab))
    disk = disk_bandwidth(directory, DISK_RECORDS)
    return Probe(
        statistics.median(free),
        statistics.median(synced),
        _late_call_seconds(switches[0], config),
        disk["qd1"],
        disk["parallel"],
        page_cache_bandwidth(directory),
    )


def _late_call_seconds(switch: _TopK, config: dict) -> float:
    """One token's expert call on its own, evaluated: what a layer with
    misses adds for the missed rows."""
    hidden = {**config, **config.get("text_config", {})}["hidden_size"]
    x = mx.random.normal((1, 1, hidden)).astype(switch._dtype)
    k = switch._k
    slots = mx.arange(k).reshape(1, 1, k)
    times = []
    for _ in range(PROBE_TOKENS):
        start = time.perf_counter()
        mx.eval(switch._inner(x, slots))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _TopK(nn.Module):
    """A SwitchGLU holding only top-k random experts: each call computes all k
    (a real decode computes k experts), optionally after a host sync."""

    def __init__(self, inner: nn.Module, k: int, dtype: mx.Dtype):
        super().__init__()
        self._inner, self._k, self._sync = inner, k, False
        self._dtype = dtype

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._sync:
            np.array(indices)  # the host sync a streaming layer waits for
        return self._inner(x, mx.broadcast_to(mx.arange(self._k), indices.shape))


def probe_model(
    directory: Path, manifest: Manifest, config: dict, dtype: str = "auto"
) -> nn.Module:
    """The model's mlx-lm graph with random weights of the stored shapes and
    dtypes (the stored bytes are never read), experts cut to top-k."""
    k = get_family(config).top_k(config)
    compute = getattr(mx, resolve_dtype(dtype, manifest.dtype))
    model = build_model(config)
    weights = dense_weights(directory, manifest)  # mapped, never evaluated
    for layer in manifest.layers:
        for seg in layer.segments:
            shape, seg_dtype = (k, *seg.shape), getattr(mx, seg.dtype)
            weights[f"{layer.module}.{seg.name}"] = mx.zeros(shape, seg_dtype)
    quantize_as_configured(model, config, weights)
    model.load_weights(list(weights.items()), strict=False)
    cast_floating(model, compute)
    flat = tree_flatten(model.parameters())
    model.update(tree_unflatten([(n, _random_like(n, v)) for n, v in flat]))
    mx.eval(model.parameters())
    for spath, switch in switch_modules(model).items():
        replace_module(model, spath, _TopK(switch, k, compute))
    return model.eval()


def _random_like(name: str, v: mx.array) -> mx.array:
    """Random values of `v`'s shape and dtype that keep activations in a
    normal range (no overflow, no denormals: both slow a CPU down)."""
    if v.dtype == mx.uint32:
        return mx.random.randint(0, 1 << 30, v.shape).astype(mx.uint32)
    if not mx.issubdtype(v.dtype, mx.floating):
        return mx.zeros(v.shape, v.dtype)
    if name.endswith(".scales"):
        value = 0.002 + 0.01 * mx.abs(mx.random.normal(v.shape))
    elif v.ndim == 1:  # norm weights, biases
        value = mx.ones(v.shape)
    else:
        value = 0.02 * mx.random.normal(v.shape)
    return value.astype(v.dtype)


def _decode_seconds(model: nn.Module, vocab: int) -> float:
    """Median seconds per decode token of mlx-lm's generate_step, greedy."""
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, PROMPT_TOKENS))
    steps = generate_step(prompt, model, max_tokens=PROBE_TOKENS + 2)
    next(steps)  # prefill and the first token
    next(steps)  # warm-up
    times, start, last = [], time.perf_counter(), time.perf_counter()
    for _ in steps:
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if now - start > PROBE_SECONDS and len(times) >= 3:
            break
    return statistics.median(times)


def page_cache_bandwidth(directory: Path, records: int = DISK_RECORDS) -> float:
    """GB/s of reading whole expert records that are in the page cache."""
    manifest = load_manifest(directory)
    layer = max(manifest.layers, key=lambda x: x.num_experts * x.stride)
    experts = random.Random(1).sample(
        range(layer.num_experts), min(records, layer.num_experts)
    )
    with BlobReader(inside(directory, layer.file), layer) as blob:
        buf = memoryview(bytearray(layer.record_nbytes))
        for e in experts:  # into the page cache
            blob.readv(e, [buf])
        start = time.perf_counter()
        for e in experts:
            blob.readv(e, [buf])
        seconds = time.perf_counter() - start
    return len(experts) * layer.record_nbytes / 1e9 / seconds


def plan_and_forecast(
    path: str | Path, cfg: RuntimeConfig, probe: bool = True
) -> dict[str, Any]:
    """`moestream plan`'s result: the plan, and the probe and forecast."""
    directory = Path(path)
    plan = plan_for(directory, cfg)
    out: dict[str, Any] = {"plan": plan_dict(plan, cfg)}
    if probe:
        manifest = load_manifest(directory)
        measured = run_probe(directory, cfg.dtype)
        out["probe"] = asdict(measured)
        fc = forecast(manifest, load_config(directory), plan, measured)
        out["forecast"] = asdict(fc)
    return out


def format_plan(result: dict[str, Any]) -> str:
    from .units import human_bytes as h

    p = result["plan"]
    width = max(len(h(p[k])) for k in ("total", "dense", "process"))

    def row(name: str, value: int, note: str = "") -> str:
        return f"  {name:<12} {h(value):>{width}}" + (f"  {note}" if note else "")

    budget = p["budget"]
    lines = [
        f"memory plan (context {p['context']} tokens, "
        f"{p['concurrency']} sequence{'s' if p['concurrency'] > 1 else ''}):",
        row("process", p["process"], "this process now: Python, MLX, tokenizer"),
        row("dense", p["dense"], "attention, norms, embeddings, routers, shared"),
        row("KV cache", p["kv_cache"]),
        row("activations", p["activations"], "one prefill chunk"),
        row("staging", p["staging"], "a record being read, spare slot, buffers"),
        row("reserve", p["reserve"], "allocator slack: 32 MB + 3 % of the budget"),
        row(
            "experts",
            p["pools"],
            f"{p['capacity']} of {p['num_experts']} per layer "
            f"({100 * p['residency']:.0f} % resident), "
            f"{h(p['slot_bytes'])} per slot in every layer",
        ),
        row("total", p["total"], f"of a {h(budget)} budget" if budget else ""),
    ]
    if "forecast" in result:
        pr, fc = result["probe"], result["forecast"]
        lines += [
            "probe: compute "
            f"{1 / pr['token_s']:.1f} tok/s with every expert resident, "
            f"{1 / pr['token_sync_s']:.1f} with a host sync per MoE layer, "
            f"{1e3 * pr['late_call_s']:.2f} ms per late expert call; "
            f"disk {pr['disk_qd1_gbps']:.2f} GB/s one read at a time, "
            f"{pr['disk_parallel_gbps']:.2f} in parallel, page cache "
            f"{pr['page_cache_gbps']:.2f} GB/s",
        ]
        if fc["bytes_per_token"] == 0:
            lines.append(
                f"forecast: decode ~{fc['warm_tps']:.1f} tok/s (every expert "
                "resident: no reads, no host sync)"
            )
        else:
            lines.append(
                f"forecast: decode ~{fc['warm_tps']:.1f} tok/s warm, "
                f"~{fc['cold_tps']:.1f} tok/s cold, at hit rate "
                f"{fc['hit_rate']:.2f} (uniform routing; trained routing hits "
                f"more): {fc['misses_per_token']:.1f} misses in "
                f"{fc['late_calls_per_token']:.1f} layers, "
                f"{fc['bytes_per_token'] / 1e6:.2f} MB read per token"
            )
    return "\n".join(lines)
