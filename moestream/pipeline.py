"""Pipeline a streamed model across processes (machines) on MLX distributed.

Each rank of `mx.distributed` runs a contiguous range of decoder layers: it
loads only their dense weights and streams only their experts. mlx-lm's
convention holds throughout: the last rank runs the first layers, rank 0 the
last; hidden states pass from rank r+1 to rank r, and an all_gather hands
rank 0's final hidden state to every rank, so every rank computes the same
logits and samples the same tokens (the seed must be the same everywhere).

Families with mlx-lm's `PipelineMixin` (qwen3_moe, deepseek_v3, glm4_moe...)
are cut by their own `pipeline()`. For the others one generic cut over
mlx-lm's model classes: the layers another rank runs become `Skipped`
placeholders (no weights; they keep their KV cache's offset with zero-width
entries, so mlx-lm's own forward, masks and `make_cache` run unchanged), and
the first and last layers of the range are wrapped in a `Boundary` that
receives, sends and gathers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .families import layer_index
from .formats import load_manifest
from .formats.dtypes import DTYPE_NAMES
from .generate import Sampling, generate, report
from .runtime.backend import ExecutionPlan
from .runtime.config import RuntimeConfig
from .runtime.loader import (
    MemoryPlan,
    dense_weights,
    execution_for,
    load,
    resolve_dtype,
    runtime_of,
)
from .units import count, peak_rss

T = TypeVar("T")
# Bytes of one rank's error message in the all_gather that shares it.
MESSAGE_BYTES = 1024


class PipelineError(ValueError):
    """A pipeline that cannot run: said the same on every rank."""


@dataclass(frozen=True)
class Stage:
    """What one rank runs: decoder layers `layers` of the model."""

    rank: int
    size: int
    layers: range
    split: tuple[int, ...]  # layers per rank, mlx-lm's order (rank 0: the last)


class _Group:
    """A stand-in for an mx.distributed group: what `pipeline()` asks of one."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def layer_costs(path: str | Path, config: RuntimeConfig | None = None) -> list[int]:
    """Bytes each decoder layer needs in memory: its dense weights and every
    expert, in the compute dtype (from the file headers: no weight is read)."""
    cfg = config or RuntimeConfig()
    manifest = load_manifest(path)
    compute = getattr(mx, resolve_dtype(cfg.dtype, manifest.dtype))
    n = _num_layers(Path(path))
    costs = [0] * n
    for name, w in dense_weights(Path(path), manifest).items():
        i = _layer_of(name)
        if i is not None and i < n:
            costs[i] += _widened(w.nbytes, DTYPE_NAMES[w.dtype], compute)
    for layer in manifest.layers:
        record = sum(_widened(s.nbytes, s.dtype, compute) for s in layer.segments)
        costs[layer_index(layer.module)] += layer.num_experts * record
    return costs


def _widened(nbytes: int, dtype: str, compute: mx.Dtype) -> int:
    """Float tensors are held in the compute dtype, the rest as stored."""
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype)
    return nbytes if size is None else nbytes // size * compute.size


def _layer_of(name: str) -> int | None:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _num_layers(directory: Path) -> int:
    from mlx_lm.utils import load_config

    config = load_config(directory)
    return {**config, **config.get("text_config", {})}["num_hidden_layers"]


def split_layers(costs: list[int], ranks: int) -> tuple[int, ...]:
    """Contiguous ranges, one per rank, that minimise the largest rank's bytes.

    Returned as mlx-lm's `pipeline(group, split)` takes it: layers per rank,
    rank 0 running the last ones.
    """
    if not 1 <= ranks <= len(costs):
        raise PipelineError(
            f"{count(ranks, 'rank')} cannot share "
            f"{count(len(costs), 'decoder layer')}; launch between 1 and "
            f"{len(costs)} processes."
        )
    lo, hi = max(costs), sum(costs)
    while lo < hi:  # the smallest largest-rank load that a greedy cut achieves
        mid = (lo + hi) // 2
        if _greedy(costs, ranks, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    parts = _greedy(costs, ranks, lo)
    assert parts is not None
    return tuple(reversed(parts))


def _greedy(costs: list[int], ranks: int, cap: int) -> list[int] | None:
    """Layers per part, in layer order, no part over `cap` (None: impossible)."""
    parts, i = [], 0
    for p in range(ranks):
        left = ranks - p - 1  # parts after this one, each needing a layer
        total, start = 0, i
        while i < len(costs) - left and (i == start or total + costs[i] <= cap):
            total += costs[i]
            i += 1
        if total > cap:
            return None
        parts.append(i - start)
    return parts if i == len(costs) else None


def stages(
    path: str | Path, size: int, config: RuntimeConfig | None = None
) -> list[Stage]:
    """The stage of every rank of a `size`-rank pipeline over OUT."""
    split = split_layers(layer_costs(path, config), size)
    out = []
    for rank in range(size):
        start = sum(split[rank + 1 :])
        out.append(Stage(rank, size, range(start, start + split[rank]), split))
    return out


def _inner(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if not isinstance(getattr(inner, "layers", None), list):
        raise PipelineError(
            f"{type(model).__module__} keeps its decoder layers elsewhere than "
            "model.model.layers; --pipeline does not run this family."
        )
    return inner


def shard(stage: Stage) -> Callable[[nn.Module], range]:
    """The `load(..., shard=)` hook that cuts a lazily built model to `stage`."""

    def cut(model: nn.Module) -> range:
        inner = _inner(model)
        if stage.size == 1:
            return range(len(inner.layers))
        if hasattr(inner, "pipeline"):  # mlx-lm's PipelineMixin
            inner.pipeline(_Group(stage.rank, stage.size), list(stage.split))
            return range(inner.start_idx, inner.end_idx)
        for i in range(len(inner.layers)):
            if i not in stage.layers:
                inner.layers[i] = Skipped()
        return stage.layers

    return cut


def connect(model: nn.Module, stage: Stage) -> None:
    """After `load`: wire a generically cut model's first and last layers."""
    inner = _inner(model)
    if stage.size == 1 or hasattr(inner, "pipeline"):
        return  # the mixin's forward sends and receives itself
    first, last = stage.layers[0], stage.layers[-1]
    rank, size = stage.rank, stage.size
    for i in {first, last}:
        inner.layers[i] = Boundary(
            inner.layers[i],
            recv_from=rank + 1 if i == first and rank < size - 1 else None,
            send_to=rank - 1 if i == last and rank > 0 else None,
            gather=i == last,
        )


class Skipped(nn.Module):
    """A decoder layer another rank runs: the hidden state passes through; its
    cache grows by zero-width entries so its offset (and masks) stay right."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = _cache_arg(args, kwargs)
        if cache is not None and hasattr(cache, "update_and_fetch"):
            empty = mx.zeros((x.shape[0], 1, x.shape[1], 0), x.dtype)
            cache.update_and_fetch(empty, empty)
        return x


class Boundary(nn.Module):
    """A rank's first or last layer: receive before it, send and gather after."""

    def __init__(
        self, layer: nn.Module, recv_from: int | None, send_to: int | None, gather: bool
    ):
        super().__init__()
        self.layer = layer
        self.recv_from, self.send_to, self.gather = recv_from, send_to, gather

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self.recv_from is not None:
            x = mx.distributed.recv_like(x, self.recv_from)
        h = self.layer(x, *args, **kwargs)
        if self.send_to is not None:
            h = mx.distributed.send(h, self.send_to)
            cache = _cache_arg(args, kwargs)
            if getattr(cache, "keys", None) is not None:  # prefill evaluates caches
                cache.keys = mx.depends(cache.keys, h)
        if self.gather:  # rank 0's result, kept in every rank's graph
            h = mx.distributed.all_gather(h)[: h.shape[0]]
        return h


def _cache_arg(args: tuple, kwargs: dict) -> Any:
    """mlx-lm's decoder layers take (x, mask, cache) or (x, mask, cache=...)."""
    if "cache" in kwargs:
        return kwargs["cache"]
    return args[1] if len(args) > 1 else None


# How MLX's distributed backends begin the errors of a lost peer.
LOST_PEER = re.compile(r"^\[(ring|jaccl|mpi|nccl)\]")


@contextlib.contextmanager
def lost_peers(group: mx.distributed.Group) -> Iterator[None]:
    """Turn a backend's error for a peer that went away into one clear line."""
    try:
        yield
    except RuntimeError as e:
        if not LOST_PEER.match(str(e)):
            raise
        raise PipelineError(
            f"rank {group.rank()}: the pipeline broke ({' '.join(str(e).split())}): "
            "another rank stopped; its own error says why."
        ) from e


@contextlib.contextmanager
def ended_by_launcher(rank: int) -> Iterator[None]:
    """mlx.launch ends the other ranks (SIGTERM) when one fails: say so in one
    line. A thread does it, since the main thread may be waiting in MLX."""
    read, write = os.pipe()
    os.set_blocking(write, False)

    def watch() -> None:
        while (got := os.read(read, 1)) and got[0] != signal.SIGTERM:
            pass  # another signal (Ctrl-C): the main thread handles it
        if got:  # not EOF, which is the run ending
            sys.stderr.write(
                f"error: rank {rank}: stopped by mlx.launch because another rank "
                "failed; that rank's error says why.\n"
            )
            sys.stderr.flush()
            os._exit(1)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    wakeup = signal.set_wakeup_fd(write)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGTERM, previous)
        os.close(write)
        thread.join()
        os.close(read)


def init() -> mx.distributed.Group:
    """The group `mlx.launch` set up (a group of one without a launcher)."""
    return mx.distributed.init()


def settle() -> None:
    """Wait for what mlx-lm still computes on its generation stream.

    mlx-lm computes one step ahead there (a turn's last step is still in
    flight when its text is out), and that step sends, receives and gathers.
    A collective of another stream would run beside it on the same sockets of
    the ring, their bytes interleaved (seen: a rank's received hidden state
    shifted by the other's 4-byte all-sum): every collective outside
    generation waits for it first, on every rank, so each socket carries one
    collective at a time, in the same order everywhere.
    """
    mx.synchronize(generation_stream)


def gather_text(group: mx.distributed.Group, text: str) -> list[str]:
    """Every rank's `text` (cut to MESSAGE_BYTES), on every rank."""
    settle()
    raw = text.encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
    out = mx.distributed.all_gather(mx.array(list(raw), mx.uint8), group=group)
    rows = out.reshape(group.size(), MESSAGE_BYTES).tolist()
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]


def share_line(group: mx.distributed.Group, line: str | None) -> str | None:
    """Rank 0's `line` (None: its input ended) on every rank; the other ranks'
    `line` is ignored. So only rank 0 reads the terminal, and every rank
    answers the same input whatever a launcher does with the others' stdin.
    The turn before may still be in flight: it ends first (`settle`)."""
    settle()
    raw = (line or "").encode() if group.rank() == 0 else b""
    n = -1 if line is None else len(raw)
    n = int(
        mx.distributed.all_sum(
            mx.array([n if group.rank() == 0 else 0]), group=group
        ).item()
    )
    if n <= 0:
        return None if n < 0 else ""
    mine = mx.array(list(raw), mx.int32) if group.rank() == 0 else mx.zeros(n, mx.int32)
    out = mx.distributed.all_sum(mine, group=group).tolist()
    return bytes(out).decode()


def check_same_model(group: mx.distributed.Group, path: str | Path) -> None:
    """Every rank has the same OUT: the digests of manifest.json (which holds
    every file's checksum) must agree."""
    digest = hashlib.sha256((Path(path) / "manifest.json").read_bytes()).hexdigest()
    digests = gather_text(group, digest)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise PipelineError(
            f"rank {odd[0]}'s converted folder differs from rank 0's (manifest.json "
            f"sha256 {digests[odd[0]][:12]} vs {digests[0][:12]}): copy the same "
            "converted folder to every machine."
        )


def agree(group: mx.distributed.Group, error: str) -> None:
    """Raise the first failing rank's error on every rank ('' means none)."""
    errors = gather_text(group, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        rank, message = bad[0]
        others = f" (and ranks {', '.join(str(r) for r, _ in bad[1:])})"
        raise PipelineError(f"rank {rank}{others if len(bad) > 1 else ''}: {message}")


def load_stage(
    path: str | Path,
    config: RuntimeConfig,
    group: mx.distributed.Group,
    tokenizer: TokenizerWrapper | None = None,
    tokenizer_config: dict | None = None,
    progress: bool = False,
) -> tuple[nn.Module, TokenizerWrapper, Stage]:
    """Load this rank's stage of OUT (`load`'s arguments); any rank's failure
    is raised on every rank."""
    check_same_model(group, path)

    def load_mine() -> tuple[nn.Module, TokenizerWrapper, Stage]:
        stage = stages(path, group.size(), config)[group.rank()]
        model, tok = load(
            path,
            config,
            tokenizer=tokenizer,
            tokenizer_config=tokenizer_config,
            progress=progress,
            shard=shard(stage),
        )
        connect(model, stage)
        return model, tok, stage

    return together(group, load_mine)


def together(group: mx.distributed.Group, fn: Callable[[], T]) -> T:
    """`fn()` on every rank; if it fails on any, its error is raised on all."""
    result, error = None, ""
    try:
        result = fn()
    except (ValueError, OSError) as e:
        error = " ".join(str(e).split())
    agree(group, error)
    return result


def rank_report(group: mx.distributed.Group, model: nn.Module, stage: Stage) -> list:
    """Each rank's layers, slots, peak memory and expert reads, on every rank."""
    settle()  # before reading the statistics of the step still in flight
    rt = runtime_of(model)
    s = rt.stats.collect()
    mine = {
        "rank": stage.rank,
        "layers": [stage.layers.start, stage.layers.stop - 1],
        "capacity": rt.plan.capacity,
        "peak_memory": peak_rss(),
        "bytes_read": s.bytes_read,
        "hits": s.hits,
        "misses": s.misses,
    }
    return [json.loads(t) for t in gather_text(group, json.dumps(mine))]


def shared_seed(group: mx.distributed.Group, seed: int | None) -> int:
    """`seed`, or one drawn on rank 0: every rank must sample alike."""
    import random

    mine = seed if seed is not None else random.SystemRandom().randrange(2**31)
    return int(gather_text(group, str(mine))[0])


def plan_stages(
    path: str | Path, size: int, config: RuntimeConfig | None = None
) -> list[tuple[Stage, MemoryPlan]]:
    """Each rank's stage and memory plan, without reading a weight."""
    return [(s, e.memory) for s, e in execution_stages(path, size, config)]


def execution_stages(
    path: str | Path, size: int, config: RuntimeConfig | None = None
) -> list[tuple[Stage, ExecutionPlan]]:
    """Each rank's stage and execution plan, without reading a weight."""
    cfg = config or RuntimeConfig()
    out = []
    for s in stages(path, size, cfg):
        try:
            out.append((s, execution_for(path, cfg, shard=shard(s))))
        except ValueError as e:
            raise PipelineError(f"rank {s.rank}: {e}") from e
    return out


def run_rank(
    path: str,
    encode: Callable[[TokenizerWrapper], list[int]],
    engine: dict,
    max_tokens: int,
    sampling: Sampling,
    seed: int | None,
    on_text: Callable[[str], None] | None = None,
    show_plan: bool = False,
) -> dict | None:
    """run-moe --pipeline on this rank: generate with every rank in step;
    rank 0 returns run-moe's report, with every rank's figures under "ranks"."""
    group = init()
    with ended_by_launcher(group.rank()), lost_peers(group):
        tok = _tokenizer(path, engine.get("verify", True))
        ids = encode(tok)
        config = RuntimeConfig(**engine, context=len(ids) + max_tokens)
        first = group.rank() == 0
        # before loading, as mlx_lm.generate seeds: every rank's load draws the
        # whole model's random numbers, so all end in one process's state
        mx.random.seed(shared_seed(group, seed))
        model, tok, stage = load_stage(path, config, group, tokenizer=tok)
        plan = runtime_of(model).plan.describe()
        plans = gather_text(group, f"rank {stage.rank}: {plan}")
        if show_plan and first:
            for line in plans:
                click.echo(line, err=True)
        gen = generate(
            model, tok, ids, max_tokens, sampling, on_text if first else None
        )
        ranks = rank_report(group, model, stage)
    if not first:
        return None
    result = report(model, gen)
    result["stats"]["ranks"] = ranks
    return result


def _tokenizer(path: str, verify: bool) -> TokenizerWrapper:
    """The tokenizer, its files checked first (as run-moe does)."""
    from mlx_lm.utils import load_config, load_tokenizer

    from .formats.verify import check_files

    manifest = load_manifest(path)
    if verify:
        check_files(Path(path), manifest, skip=manifest.dense_files)
    config = load_config(Path(path))
    return load_tokenizer(
        Path(path),
        {"trust_remote_code": False},
        eos_token_ids=config.get("eos_token_id"),
    )
