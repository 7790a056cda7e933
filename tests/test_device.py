"""Exactness on the accelerator (was scripts/gpu_exactness.py, gpu_diagnose.py).

Marked `device`: skipped where MLX has no GPU. The same comparisons as
test_exactness.py, pinned to the GPU: streaming vs mlx-lm's resident model,
prefill and step-by-step decode, at several cache sizes and compute dtypes
(float16 slots cast from the stored bfloat16 on the device);
the resident model against itself (GPU kernels deterministic), and prefetch.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.formats import load_manifest
from moestream.reference import resident_from_converted, resident_model

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="MLX has no GPU here"),
]
DECODE_STEPS = 8


@pytest.fixture(autouse=True)
def on_gpu():
    with mx.stream(mx.gpu):
        yield


@pytest.mark.parametrize("cache_experts", [2, 5, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_streaming_exact_on_gpu(converted, hf_dir, recipe, dtype, cache_experts):
    ref = resident_model(hf_dir, recipe, compute_dtype=dtype)
    theirs = logits_stepwise(ref, PROMPT, DECODE_STEPS)
    model, _ = moestream.load(converted, cache_experts=cache_experts, dtype=dtype)
    ours = logits_stepwise(model, PROMPT, DECODE_STEPS)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.array_equal(a, b).item()


def test_resident_deterministic_and_prefetch_exact_on_gpu(converted):
    ref = logits_stepwise(resident_from_converted(converted), PROMPT, DECODE_STEPS)
    again = logits_stepwise(resident_from_converted(converted), PROMPT, DECODE_STEPS)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, again, strict=True))
    for cache_experts, prefetch in [(8, False), (3, False), (3, True)]:
        engine = "native" if prefetch else "python"  # python does not prefetch
        model, _ = moestream.load(
            converted, cache_experts=cache_experts, prefetch=prefetch, engine=engine
        )
        ours = logits_stepwise(model, PROMPT, DECODE_STEPS)
        for a, b in zip(ours, ref, strict=True):
            assert mx.array_equal(a, b).item(), (cache_experts, prefetch)


@pytest.mark.parametrize("cache_experts, host_records", [(2, None), (5, None), (3, 4)])
def test_native_engine_exact_on_gpu(
    converted, hf_dir, recipe, cache_experts, host_records
):
    """The CUDA engine: slot lookup in a host function of the stream, misses
    read through the pinned host tier (the default one, and one of 4 records
    that evicts), copies over the bus; the 48-token prompt runs grouped."""
    ref = resident_model(hf_dir, recipe, compute_dtype="bfloat16")  # GPU's auto
    theirs = logits_stepwise(ref, PROMPT, DECODE_STEPS)
    layers = load_manifest(converted).layers
    budget = None
    if host_records is not None:
        budget = host_records * max(layer.record_nbytes for layer in layers)
    model, _ = moestream.load(
        converted,
        cache_experts=cache_experts,
        engine="native",
        host_budget=budget,
        dtype="bfloat16",
    )
    ours = logits_stepwise(model, PROMPT, DECODE_STEPS)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    assert s.native_calls > 0 and s.grouped_calls > 0 and s.misses > 0
    assert model.moestream.plan.host_pinned
    if host_records is None:  # every record, read at load: each fill from it
        assert s.host_hits == s.misses and s.host_misses == 0
    else:
        assert s.host_misses > 0 and s.host_evictions > 0
