"""One benchmark run in a fresh process (so peak memory is this run's alone).

    python -m moestream.bench.worker '{"out": ..., "capacity": 16, ...}'

Prints one JSON object: prefill and decode timings, cache and prefetch
counters, cache-policy replays of the decode trace, peak memory.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_config, load_tokenizer

from ..families import cast_floating
from ..formats import load_manifest
from ..formats.verify import check_files
from ..reference import resident_from_converted
from ..runtime.backend import on_gpu
from ..runtime.config import RuntimeConfig
from ..runtime.loader import budget_for, load, resolve_dtype, runtime_of
from ..units import peak_rss
from .replay import replay_all
from .routes import force_routes, load_trace, rewind_routes
from .sysio import read_bytes

# A fixed prompt (in-domain for code models), packaged with moestream: the
# benchmark's routing stays the same across commits.
PROMPT_FILE = "prompt.txt"


@dataclass(frozen=True)
class Job:
    out: str
    capacity: int | None  # None: mlx-lm's fully resident model
    cold: bool = False
    prompt_tokens: int = 512
    decode_tokens: int = 32
    # The streaming runs' options (slots, budget and context are set per run).
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    reference: str | None = None  # an mlx-lm directory of the same weights
    # Sampled, seeded decode: the same tokens in every run (the output is exact),
    # and routing that is not stuck in the loops greedy decode falls into.
    temp: float = 1.0
    seed: int = 0
    # A routing trace (.npz) forced into every MoE block's router (bench only).
    trace: str | None = None


# A warm run first runs the timed prompt's length and decodes this many
# tokens, untimed, as llama-bench's warm-up does (a prompt of the same length,
# then a token): the first call of a process pays for its buffers, page-table
# entries and first-use checks, which no later call does. On a GPU (cold runs
# too) it also compiles every kernel shape of the run (20-47 s).
WARMUP_TOKENS = 4


def prompt_ids(tokenizer: object, n: int) -> list[int]:
    """`n` token ids of the bench prompt (repeated if it is shorter)."""
    text = resources.files(__package__).joinpath(PROMPT_FILE).read_text()
    text = text[: 8 * n + 64]  # ~4 characters per token
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def run(job: Job) -> dict:
    out = Path(job.out)
    tokenizer = load_tokenizer(out, eos_token_ids=load_config(out).get("eos_token_id"))
    model, runtime = _model(job, tokenizer)
    prompt = mx.array(prompt_ids(tokenizer, job.prompt_tokens))
    if on_gpu() or not job.cold:
        warm = mx.array(prompt_ids(tokenizer, max(16, job.prompt_tokens)))
        for _ in generate_step(warm, model, max_tokens=WARMUP_TOKENS):
            pass
        rewind_routes(model)  # a forced trace starts over for the timed run
        _restart(job, runtime)
    mx.random.seed(job.seed)
    steps = generate_step(
        prompt,
        model,
        max_tokens=job.decode_tokens + 1,
        sampler=make_sampler(job.temp),
    )
    start = time.perf_counter()
    next(steps)  # prefill, and the first token
    prefill = time.perf_counter() - start
    _restart(job, runtime)
    disk, cpu = read_bytes(), os.times()
    start = time.perf_counter()
    tokens = [int(t) for t, _ in steps]
    n = len(tokens)
    decode = time.perf_counter() - start
    disk, end = read_bytes() - disk, os.times()
    user, system = end.user - cpu.user, end.system - cpu.system
    result = {
        "prefill_s": prefill,
        "prefill_tps": job.prompt_tokens / prefill,
        "decode_tps": n / decode,
        "decode_tokens": n,
        # from storage, as the kernel counts it (page-cache hits count nothing)
        "disk_bytes_per_token": disk / max(n, 1),
        # this process's CPU time a token (every thread, user and kernel),
        # and the kernel's share of it (page faults, the page cache, reads)
        "cpu_s_per_token": (user + system) / max(n, 1),
        "system_s_per_token": system / max(n, 1),
        "tokens": tokens,
        "peak_rss": peak_rss(),
        "device_peak": mx.get_peak_memory() if on_gpu() else None,
    }
    if runtime is not None:
        result.update(_streaming_result(job, runtime, n))
    return result


def _model(job: Job, tokenizer: object) -> tuple[object, object | None]:
    """The resident model (capacity None), or the streaming one and its runtime."""
    if job.capacity is None:
        return _forced(job, _resident(job)), None
    out = Path(job.out)
    context = job.prompt_tokens + job.decode_tokens + 1
    if job.runtime.verify:  # as load will: its read buffers stay in RSS
        check_files(out, load_manifest(out))
    # Mapped (asked for, or what auto picks): no slots; the budget that holds
    # `capacity` of them holds its window of records kept mapped instead.
    budget = budget_for(out, job.capacity, context, job.runtime)
    gc.collect()
    # The model's routers cannot predict forced routes: prefetch runs on the
    # trace's recorded predictions, or not at all when it has none.
    trace = load_trace(job.trace) if job.trace else None
    predicts = trace is None or trace.predicts
    options = job.runtime.with_options(
        # The budget alone, as a user gives it (it holds exactly `capacity`
        # slots), unless slots were asked for by name.
        cache_experts=job.capacity if job.runtime.backend == "slots" else None,
        memory_budget=budget,
        context=context,
        record_trace=True,
        prefetch=job.runtime.tuning.prefetch if predicts else False,
    )
    model, _ = load(out, options, tokenizer=tokenizer)
    if trace is not None:
        force_routes(model, trace, options.tuning.prefetch_extra)
    runtime = runtime_of(model)
    if job.cold:
        runtime.drop_cache()
    return model, runtime


def _forced(job: Job, model: nn.Module) -> nn.Module:
    """`model`, routing as `job.trace` says when there is one."""
    if job.trace:
        force_routes(model, load_trace(job.trace))
    return model


def _restart(job: Job, runtime: object | None) -> None:
    """Before a timed part: counters from zero, the page cache dropped if cold."""
    if runtime is None:
        return
    if job.cold:
        runtime.drop_cache()
    runtime.stats.reset()


def _streaming_result(job: Job, runtime: object, n: int) -> dict:
    """The streaming engine's counters, bytes per token, plan and replays."""
    s = runtime.stats.collect()  # the native engine's counters
    plan, t = runtime.plan, job.runtime.tuning
    # Mapped: no slots; the replays say what the row's slots would hit, and
    # the plan holds all but the experts.
    capacity = job.capacity if plan.mapped else plan.capacity
    return {
        **s.as_dict(),
        "bytes_per_token": s.bytes_read / max(n, 1),
        "fill_bytes_per_token": s.fill_bytes / max(n, 1),
        "budget": plan.budget or plan.total,
        "capacity": plan.capacity,
        "host_tier": plan.host_tier,
        "replay": replay_all(s.routing(), capacity, t.policy, t.lrfu_decay),
        "backend": runtime.execution.backend,
    }


def _resident(job: Job) -> nn.Module:
    if job.reference:
        model, _ = mlx_load(job.reference)
        stored = load_manifest(job.out).dtype
        cast_floating(model, getattr(mx, resolve_dtype("auto", stored)))
        mx.eval(model.parameters())
        return model
    return resident_from_converted(job.out)


def main() -> None:
    fields = json.loads(sys.argv[1])
    job = Job(**{**fields, "runtime": RuntimeConfig(**fields["runtime"])})
    print(json.dumps({"job": asdict(job), **run(job)}))


if __name__ == "__main__":
    main()
