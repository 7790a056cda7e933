"""moestream plan OUT: the memory plan run-moe would use, and a decode forecast.

The plan is `runtime.loader.plan_for`, the code `load` plans with, on the
lazily built model: no weight is read. The forecast comes from three short
probes of this machine:

- compute: the model's own mlx-lm graph, built from its config with random
  weights of the stored shapes and dtypes (top-k experts per layer, so every
  call computes k experts as a real decode does), decoding a few tokens with
  mlx-lm's `generate_step` (what a run with every expert in a slot costs);
- the engine: what one miss costs beyond its bytes (bookkeeping, the host
  sync of a layer that misses, the late rows, the slot copy), timed on a
  tiny synthetic model written to a temporary directory and run by
  `moestream.load` with top-k slots, against the same model fully resident;
- disk: whole expert records read at random from OUT's blobs, cold (one at a
  time and all hinted at once, as `moestream bench` measures) and from the
  page cache.

Time per token = compute + misses per token x (engine cost per miss +
record bytes / read bandwidth), at a hit rate: the uniform-routing one
(slots / experts, a floor: trained and even random-weight routing hit more)
and higher ones, since a run's hit rate is known only after it.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_config

from .bench.harness import disk_bandwidth
from .bench.models import Scale, write_synthetic
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
from .runtime.backend import ExecutionPlan
from .runtime.config import RuntimeConfig
from .runtime.loader import (
    MemoryPlan,
    available_memory,
    dense_weights,
    execution_for,
    load,
    resolve_dtype,
    runtime_of,
)
from .units import human_bytes as h

# Decode steps of the compute probe after one warm-up step, and its time cap.
PROBE_TOKENS = 16
PROBE_SECONDS = 1.5
PROMPT_TOKENS = 8
# Records read by each disk probe.
DISK_RECORDS = 32
# The engine probe's model: tiny records (their bytes cost nothing), and
# misses in every call at top-k slots.
ENGINE_SCALE = Scale(4, 32, 4, 256, 128, heads=4, kv_heads=2, head_dim=64, vocab=512)
ENGINE_TOKENS = 24
# Hit rates the forecast is given at, beside the uniform-routing one.
HIT_RATES = (0.5, 0.75, 0.9, 0.95)


@dataclass(frozen=True)
class Probe:
    """What this machine measured."""

    token_s: float  # seconds per decode token, every expert in a slot
    miss_s: float  # the engine's seconds per miss beyond its bytes
    disk_qd1_gbps: float
    disk_parallel_gbps: float
    page_cache_gbps: float


@dataclass(frozen=True)
class Forecast:
    hit_rate: float
    misses_per_token: float
    bytes_per_token: float
    warm_tps: float  # misses read from the page cache
    cold_tps: float  # misses read from the disk, hinted in parallel


def plan_dict(execution: ExecutionPlan, cfg: RuntimeConfig) -> dict[str, Any]:
    """The memory plan's figures and the backend's words, as one dict."""
    plan = execution.memory
    d = asdict(plan)
    d.update(
        pools=plan.pools,
        fast_scratch=plan.fast_scratch,
        total=plan.total,
        residency=plan.capacity / max(plan.num_experts, 1),
        context=cfg.context,
        host_tier=plan.host_tier,
        execution=execution.as_dict(),
    )
    return d


def forecast_at(hit: float, manifest: Manifest, config: dict, probe: Probe) -> Forecast:
    """Decode tok/s when a share `hit` of the routed experts is resident."""
    k = get_family(config).top_k(config)
    misses = (1 - hit) * k * len(manifest.layers)
    record = statistics.mean(layer.record_nbytes for layer in manifest.layers)
    base = probe.token_s + misses * probe.miss_s
    # A record in the page cache is never slower to read than from the disk;
    # on a loaded machine the two probes can say otherwise: take the faster.
    cached = max(probe.page_cache_gbps, probe.disk_parallel_gbps)
    warm = base + misses * record / (cached * 1e9)
    cold = base + misses * record / (probe.disk_parallel_gbps * 1e9)
    return Forecast(hit, misses, misses * record, 1 / warm, 1 / cold)


def forecasts(
    manifest: Manifest,
    config: dict,
    plan: MemoryPlan,
    probe: Probe,
    hit_rates: tuple[float, ...] = (),
    page_cache: int = 0,
) -> list[Forecast]:
    """At the uniform-routing hit rate, then at `hit_rates` (default: the
    higher of HIT_RATES); one row when every expert has a slot. Mapped, the
    page cache is the expert cache: uniform routing hits the share of the
    experts' bytes that `page_cache` bytes hold."""
    if plan.mapped:
        uniform = min(1.0, page_cache / max(manifest.expert_bytes, 1))
    else:
        uniform = plan.capacity / plan.num_experts
    if uniform >= 1:
        return [forecast_at(1.0, manifest, config, probe)]
    rates = hit_rates or tuple(h for h in HIT_RATES if h > uniform)
    return [forecast_at(h, manifest, config, probe) for h in (uniform, *rates)]


def run_probe(path: str | Path, dtype: str = "auto") -> Probe:
    directory = Path(path)
    manifest = load_manifest(directory)
    config = load_config(directory)
    vocab = {**config, **config.get("text_config", {})}["vocab_size"]
    token = _decode_seconds(probe_model(directory, manifest, config, dtype), vocab)
    disk = disk_bandwidth(directory, DISK_RECORDS)
    return Probe(
        token,
        engine_miss_seconds(dtype),
        disk["qd1"],
        disk["parallel"],
        page_cache_bandwidth(directory),
    )


def engine_miss_seconds(dtype: str = "auto") -> float:
    """Seconds the streaming engine spends per miss beyond reading its bytes,
    on a tiny synthetic model: top-k slots against every expert resident."""
    scale = ENGINE_SCALE
    with tempfile.TemporaryDirectory(prefix="moestream-probe-") as tmp:
        out = Path(tmp) / "model"
        write_synthetic(out, scale)
        median = {}
        for slots in (scale.experts, scale.top_k):
            model, _ = load(out, cache_experts=slots, context=64, dtype=dtype)
            stats = runtime_of(model).stats
            times = _decode_times(model, scale.vocab, ENGINE_TOKENS, stats.reset)
            median[slots] = statistics.median(times)
            misses = stats.misses / len(times)
            runtime_of(model).store.close()
    if not misses:
        return 0.0
    return max(0.0, (median[scale.top_k] - median[scale.experts]) / misses)


class _TopK(nn.Module):
    """A SwitchGLU holding only top-k random experts: each call computes all k,
    as a real decode computes k experts."""

    def __init__(self, inner: nn.Module, k: int):
        super().__init__()
        self._inner, self._k = inner, k

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
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
        replace_module(model, spath, _TopK(switch, k))
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
    """Median seconds per decode token, within PROBE_SECONDS."""
    return statistics.median(
        _decode_times(model, vocab, PROBE_TOKENS, seconds=PROBE_SECONDS)
    )


def _decode_times(
    model: nn.Module,
    vocab: int,
    tokens: int,
    after_warmup: Callable[[], None] | None = None,
    seconds: float = math.inf,
) -> list[float]:
    """Seconds of each decode step of mlx-lm's generate_step (sampled at
    temperature 1: random weights decoded greedily repeat one token)."""
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, vocab, PROMPT_TOKENS))
    mx.random.seed(0)
    steps = generate_step(
        prompt, model, max_tokens=tokens + 2, sampler=make_sampler(1.0)
    )
    next(steps)  # prefill and the first token
    next(steps)  # warm-up
    if after_warmup is not None:
        after_warmup()
    times, start = [], time.perf_counter()
    last = start
    for _ in steps:
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if now - start > seconds and len(times) >= 3:
            break
    return times


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
    path: str | Path,
    cfg: RuntimeConfig,
    probe: bool = True,
    hit_rates: tuple[float, ...] = (),
) -> dict[str, Any]:
    """`moestream plan`'s result: the plan, and the probe and forecasts."""
    directory = Path(path)
    execution = execution_for(directory, cfg)
    plan = execution.memory
    out: dict[str, Any] = {"plan": plan_dict(execution, cfg)}
    if probe:
        manifest = load_manifest(directory)
        measured = run_probe(directory, cfg.dtype)
        out["probe"] = asdict(measured)
        room = page_cache_room(plan) if plan.mapped else 0
        out["page_cache"] = room
        rows = forecasts(
            manifest, load_config(directory), plan, measured, hit_rates, room
        )
        out["forecast"] = [asdict(f) for f in rows]
    return out


def page_cache_room(plan: MemoryPlan) -> int:
    """Bytes the page cache can keep of a mapped model's experts: what the
    system can give now, less what the plan holds beyond this process."""
    return max(0, available_memory() - (plan.total - plan.process))


_STAGING = "records being read or mapped in: 2 of the largest, or 1 a kernel thread"


def _experts_note(p: dict[str, Any]) -> str:
    """The experts row's words: slots, or mapped (with its window)."""
    if p["mapped"] and p["window"]:
        return (
            f"mapped: {p['window']} of {p['num_experts']} records a layer kept "
            "mapped under the budget, the page cache holds the rest"
        )
    if p["mapped"]:
        return "mapped: no slots, the page cache holds them (--backend slots: slots)"
    return (
        f"{p['capacity']} of {p['num_experts']} per layer "
        f"({100 * p['residency']:.0f} % resident), "
        f"{h(p['slot_bytes'])} per slot in every layer"
    )


def format_plan(result: dict[str, Any]) -> str:
    p = result["plan"]
    width = max(len(h(p[k])) for k in ("total", "dense", "process"))

    def row(name: str, value: int, note: str = "") -> str:
        return f"  {name:<12} {h(value):>{width}}" + (f"  {note}" if note else "")

    budget = p["budget"]
    seqs = p["concurrency"]
    lines = [
        f"memory plan (context {p['context']} tokens"
        + (f", {seqs} sequences at once" if seqs > 1 else "")
        + "):",
        f"  {p['execution']['describe']}",
        row(
            "process",
            p["process"],
            "this process: Python, MLX, tokenizer; measured, rounded up to 32M",
        ),
        row("dense", p["dense"], "attention, norms, embeddings, routers, shared"),
        row("KV cache", p["kv_cache"]),
        row("activations", p["activations"], "a prefill chunk"),
        row("staging", p["staging"], _STAGING),
        row("reserve", p["reserve"], "allocator slack: 32 MB + 3 % of the budget"),
        row("experts", p["pools"], _experts_note(p)),
        *(
            [row("fast", p["fast_scratch"], "a fast call's dequantized slots")]
            if p["fast_scratch"]
            else []
        ),
        row("total", p["total"], f"of a {h(budget)} budget" if budget else ""),
    ]
    if p["host_records"]:  # the native engine's host tier: its own bound
        kind = "pinned host memory" if p["host_pinned"] else "host memory"
        bound = f", of {h(p['host_budget'])}" if p["host_budget"] else ""
        lines.append(
            row(
                "host tier",
                p["host_tier"],
                f"{p['host_records']} records of {h(p['host_record'])} in {kind}, "
                f"outside the total{bound}",
            )
        )
    if "forecast" in result:
        lines += _forecast_lines(result["probe"], result["forecast"])
    if p["mapped"] and "page_cache" in result:
        lines.append(
            f"the page cache can keep {h(result['page_cache'])} of the experts "
            "now (what the system can give, less the plan): the first row's hit "
            "rate"
        )
    return "\n".join(lines)


def _forecast_lines(pr: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The probes' figures and the forecast table of `moestream plan`."""
    lines = [
        f"probe: compute {1 / pr['token_s']:.2f} tok/s with every expert in a "
        f"slot; {1e3 * pr['miss_s']:.2f} ms per miss beyond its bytes; records "
        f"read cold at {pr['disk_qd1_gbps']:.2f} GB/s one at a time, "
        f"{pr['disk_parallel_gbps']:.2f} GB/s in parallel, "
        f"{pr['page_cache_gbps']:.2f} GB/s from the page cache"
    ]
    if rows[0]["misses_per_token"] == 0:
        lines.append(
            f"forecast: decode ~{rows[0]['warm_tps']:.2f} tok/s (every expert in a "
            "slot: no reads)"
        )
        return lines
    lines.append("forecast, decode tok/s by hit rate (the first: uniform routing):")
    lines.append("  hit rate  misses/token  MB/token  warm tok/s  cold tok/s")
    for f in rows:
        lines.append(
            f"  {f['hit_rate']:>8.3f}  {f['misses_per_token']:>12.1f}  "
            f"{f['bytes_per_token'] / 1e6:>8.2f}  {f['warm_tps']:>10.2f}  "
            f"{f['cold_tps']:>10.2f}"
        )
    return lines


def plan_ranks(path: str | Path, cfg: RuntimeConfig, ranks: int) -> dict[str, Any]:
    """`moestream plan --ranks N`: each pipeline rank's layers and memory plan."""
    from .pipeline import execution_stages

    return {
        "ranks": [
            {
                "rank": stage.rank,
                "layers": [stage.layers.start, stage.layers.stop - 1],
                "plan": plan_dict(execution, cfg),
            }
            for stage, execution in execution_stages(path, ranks, cfg)
        ]
    }


def format_ranks(result: dict[str, Any]) -> str:
    """One block per rank, in layer order (the last rank runs the first layers)."""
    blocks = []
    for r in sorted(result["ranks"], key=lambda r: r["layers"][0]):
        first, last = r["layers"]
        plan = format_plan({"plan": r["plan"]}).split("\n", 1)[1]
        blocks.append(f"rank {r['rank']}: layers {first}-{last}\n{plan}")
    return "\n".join(blocks)
