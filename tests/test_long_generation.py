"""Long generation with bounded memory: pools, staging, threads and RSS stay flat."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import moestream
from moestream.runtime import native
from moestream.runtime.switch import StreamingSwitchGLU

KV_WINDOW = 64  # a rotating KV cache: the KV part itself cannot grow
WARMUP = 150  # tokens before the first sample: KV full, every slot filled


def pool_bytes(model) -> int:
    """Bytes of every streaming layer's slot arrays (the engine's internals)."""
    return sum(
        v.nbytes
        for _, m in model.named_modules()
        if isinstance(m, StreamingSwitchGLU)
        for _, v in tree_flatten(m._inner.parameters())
    )


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample(model) -> dict:
    rt = moestream.runtime_of(model)
    return {
        "pool": pool_bytes(model),
        "staging": rt.store.staging.nbytes,
        "threads": threading.active_count(),
        "stats_fields": len(vars(rt.stats)) + len(rt.stats.per_layer_misses),
        "active": mx.get_active_memory(),
        "rss": rss(),
    }


# The resident model's tokens by run length (seed 3, the prompt below).
RESIDENT_TOKENS: dict[int, list[int]] = {}


def long_run(
    converted, reference, tokens: int, every: int, engine: str | None = None
) -> list[dict]:
    model, _ = moestream.load(converted, cache_experts=3, engine=engine)
    prompt = mx.array([5, 17, 33, 2, 90, 41])

    def steps(m):
        return generate_step(
            prompt,
            m,
            max_tokens=tokens,
            max_kv_size=KV_WINDOW,
            sampler=make_sampler(0.8),
        )

    samples, ours = [], []
    mx.random.seed(3)
    for i, (t, _) in enumerate(steps(model)):
        ours.append(t)
        if i + 1 >= WARMUP and (i + 1 - WARMUP) % every == 0:
            samples.append(sample(model))
    if tokens not in RESIDENT_TOKENS:  # the same for every engine: drawn once
        mx.random.seed(3)
        RESIDENT_TOKENS[tokens] = [t for t, _ in steps(reference)]
    theirs = RESIDENT_TOKENS[tokens]
    assert len(ours) == tokens and ours == theirs  # exact all the way
    assert moestream.stats(model).evictions > tokens  # the pool really churned
    return samples


def assert_flat(samples: list[dict]) -> None:
    first = samples[0]
    for s in samples[1:]:
        for key in ("pool", "staging", "threads", "stats_fields"):
            assert s[key] == first[key], (key, samples)
        # MLX's buffer cache and malloc arenas breathe a little; no trend allowed
        assert s["active"] - first["active"] <= 256 << 10, ("active", samples)
        assert s["rss"] - first["rss"] <= 4 << 20, ("rss", samples)


@pytest.mark.parametrize("engine", ["python"] + (["native"] * native.available()))
def test_generation_memory_flat_short(converted, reference, engine) -> None:
    samples = long_run(converted, reference, tokens=350, every=50, engine=engine)
    assert len(samples) == 5
    assert_flat(samples)


@pytest.mark.slow
def test_generation_2000_tokens_memory_flat(converted, reference) -> None:
    samples = long_run(converted, reference, tokens=2000, every=250)
    assert len(samples) == 8
    assert_flat(samples)


def test_repeated_loads_release_file_descriptors(converted) -> None:
    """A process that loads models again and again (a server reloading, a test
    suite) must not run out of descriptors: each blob's fd goes with its model."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    model, _ = moestream.load(converted, cache_experts=2)
    del model
    before = open_fds()
    for _ in range(10):  # any leak shows at the first load
        model, _ = moestream.load(converted, cache_experts=2)
        mx.eval(model(mx.array([[1, 2, 3]])))
        del model
    assert open_fds() == before  # 2 blobs per load leaked before the fix
