"""The streaming model equals mlx-lm's fully resident model bit for bit, with
either engine: native (the default where it is built) and python (the
reference path); native with its exact CPU kernel (RuntimeConfig.cpu_kernel, on
by default) and without (MLX's ops)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import PROMPT, generated, logits_stepwise

import moestream
from moestream.reference import resident_model
from moestream.runtime import native

# top_k, in between, all experts of the tiny model (8, top-2)
CACHE_SIZES = [2, 5, 8]
ENGINES = {"python": {"engine": "python"}}
if native.available():
    ENGINES["native"] = {"engine": "native"}
    ENGINES["native-mlx-ops"] = {"engine": "native", "cpu_kernel": False}


# native with MLX's ops: the kernel's reference path, in `make test-all` only
# (the python engine runs MLX's ops in `make test`, and test_cpu_kernel.py
# holds the kernel to them).
PARAMS = [
    pytest.param(n, marks=pytest.mark.slow) if n == "native-mlx-ops" else n
    for n in ENGINES
]


@pytest.fixture(params=PARAMS)
def engine(request) -> dict:
    """The load options of an engine."""
    return ENGINES[request.param]


def once(fixture_cache: dict, key, build):
    """build() the first time `key` is asked for, then what it gave."""
    if key not in fixture_cache:
        fixture_cache[key] = build()
    return fixture_cache[key]


@pytest.fixture(scope="module")
def built() -> dict:
    """What a test builds alike for each engine (a model and its resident
    logits), by the test's key: built once, then shared by both engines."""
    return {}


@pytest.mark.parametrize("cache_experts", CACHE_SIZES)
@pytest.mark.parametrize("policy", ["lrfu", "lru"])
def test_prefill_and_decode_logits_bit_identical(
    converted, resident_logits, cache_experts, policy, engine
):
    model, _ = moestream.load(
        converted, cache_experts=cache_experts, policy=policy, **engine
    )
    ours = logits_stepwise(model, PROMPT, steps=12)
    theirs = resident_logits(12)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype == mx.float32
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    s = moestream.stats(model)
    if cache_experts == 8:  # all fit: read at load, then no miss and no sync
        assert s.misses == 0
        # every call of both MoE layers, the prefill's too
        assert s.sync_free_calls == (1 + 12) * 2
        return
    assert s.misses > 0
    assert s.fill_bytes == s.bytes_read  # no host tier: every fill read the blob
    assert s.evictions > 0  # the small caches really did evict and reload
    assert s.grouped_calls > 0  # 48 prompt tokens route to more than 5 experts


def test_plan_memory_splits_the_budget(converted, monkeypatch):
    from mlx_lm.utils import load_config

    from moestream.formats import load_manifest
    from moestream.runtime import BudgetError, loader, memory
    from moestream.runtime.loader import plan_memory

    m, config = load_manifest(converted), load_config(converted)
    args = (m, config, 10 << 20, mx.float32, 100 << 20, 1024)
    scaled = plan_memory(*args, 1 << 30, None)
    assert scaled.reserve == loader.RESERVE_BYTES + int(0.03 * (1 << 30))
    monkeypatch.setattr(memory, "RESERVE_FRACTION", 0.0)
    base = plan_memory(*args, None, 1)
    fixed = base.total - base.pools
    plan = plan_memory(*args, fixed + 3 * base.slot_bytes + base.slot_bytes // 2, None)
    assert plan.capacity == 3 and plan.total <= plan.budget
    assert plan_memory(*args, 1 << 40, None).capacity == 8  # never more than E
    with pytest.raises(BudgetError, match=r"too small.*give --memory-budget"):
        plan_memory(*args, fixed + base.slot_bytes, None)  # top-2 needs 2 slots


def test_memory_budget_load_is_exact(converted, reference, engine):
    model, _ = moestream.load(converted, memory_budget="4G", **engine)
    plan = moestream.runtime_of(model).plan
    assert plan.capacity == 8 and plan.total <= plan.budget
    assert mx.array_equal(model(PROMPT), reference(PROMPT)).item()


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_generated_tokens_identical(converted, hf_dir, recipe, temp, engine):
    prompt = [5, 17, 33, 2, 90, 41]
    # seeded before each model is built, as mlx-lm's commands seed: the draws
    # of building it count (the resident model is built again for that)
    ours = generated(
        lambda: moestream.load(converted, cache_experts=3, **engine)[0],
        prompt,
        temp,
        seed=11,
    )
    theirs = generated(lambda: resident_model(hf_dir, recipe), prompt, temp, seed=11)
    assert ours == theirs
    assert len(set(ours)) > 1


def test_float32_conversion_is_exact(hf_dir, tmp_path, engine):
    from moestream.converter import convert
    from moestream.formats import Recipe
    from moestream.reference import resident_model

    convert(str(hf_dir), tmp_path / "f32", dtype="float32", progress=False)
    model, _ = moestream.load(tmp_path / "f32", cache_experts=2, **engine)
    ref = resident_model(hf_dir, Recipe(), dtype="float32")
    assert mx.array_equal(model(PROMPT), ref(PROMPT)).item()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_other_compute_dtypes_exact(converted, hf_dir, recipe, dtype, engine, built):
    """The stored bfloat16 (the GPU default), and float16 (rounded from it)."""
    model, _ = moestream.load(converted, cache_experts=3, dtype=dtype, **engine)
    theirs = once(
        built,
        ("dtype", dtype),
        lambda: logits_stepwise(
            resident_model(hf_dir, recipe, compute_dtype=dtype), PROMPT, 4
        ),
    )
    ours = logits_stepwise(model, PROMPT, 4)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == getattr(mx, dtype)
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True, "mlp_only_layers": []},
        {"torch_dtype": "float16", "num_experts": 6, "num_experts_per_tok": 3},
        {"torch_dtype": "float32", "shards": 1},
    ],
)
def test_variants_exact(tmp_path_factory, overrides, engine, built):
    """Tied embeddings, no dense layers, float16 sources, other expert counts."""

    def build() -> tuple:
        from builders.synthetic import tiny_qwen3_moe

        from moestream.converter import convert
        from moestream.formats import Recipe

        root = tmp_path_factory.mktemp("variant")
        more = dict(overrides)
        shards = more.pop("shards", 2)
        dtype = getattr(mx, more.get("torch_dtype", "bfloat16"))
        src = tiny_qwen3_moe(root / "hf", dtype=dtype, seed=5, shards=shards, **more)
        convert(str(src), root / "out", bits="down_proj=8", progress=False)
        ref = resident_model(src, Recipe.parse("down_proj=8"))
        return root / "out", logits_stepwise(ref, PROMPT, 3)

    out, theirs = once(built, ("variant", repr(overrides)), build)
    model, _ = moestream.load(out, cache_experts=3, **engine)
    for a, b in zip(logits_stepwise(model, PROMPT, 3), theirs, strict=True):
        assert mx.array_equal(a, b).item()


def test_mlx_lm_generate_accepts_the_model(converted, reference, engine):
    from mlx_lm import generate

    model, tokenizer = moestream.load(converted, cache_experts=2, **engine)
    ours = generate(model, tokenizer, "def add(a, b):", max_tokens=10)
    assert ours == generate(reference, tokenizer, "def add(a, b):", max_tokens=10)


def test_resident_from_converted_equals_source_reference(converted, reference):
    from moestream.reference import resident_from_converted

    resident = resident_from_converted(converted)
    assert mx.array_equal(resident(PROMPT), reference(PROMPT)).item()


def test_trained_demo_model_exact(tmp_path_factory, engine, built):
    """The bundled trained model (real routing, real tokenizer), 4 of 16 resident."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    from moestream.converter import convert
    from moestream.formats import Recipe

    src = Path(__file__).parent.parent / "examples" / "stdlib-moe"

    def build() -> tuple:
        out = tmp_path_factory.mktemp("demo") / "demo"
        convert(str(src), out, progress=False)
        tokens = load_tokenizer(out).encode("import os\n\ndef walk(top):\n")
        prompt = mx.array(tokens)[None]
        return out, prompt, logits_stepwise(resident_model(src, Recipe()), prompt, 24)

    out, prompt, theirs = once(built, "demo", build)
    # the native engine with its read-ahead asked for (off by default)
    ahead = {"prefetch": True} if engine["engine"] == "native" else {}
    model, tokenizer = moestream.load(out, cache_experts=4, **engine, **ahead)
    assert prompt.tolist()[0] == tokenizer.encode("import os\n\ndef walk(top):\n")
    ours = logits_stepwise(model, prompt, 24)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True))
    s = moestream.stats(model)
    assert 0 < s.hit_rate < 1
    assert (s.prefetched_used > 0) == (engine["engine"] == "native")  # trained routing
