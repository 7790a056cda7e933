"""Randomized eviction stress: every case bit-identical to mlx-lm's resident model.

Each case draws runtime options (every RuntimeConfig field), a batch of random
prompts, a chunking of the prefill and a number of decode steps, then compares
the logits of every step with `mx.array_equal` and the greedy tokens one by
one. A run draws a few option sets and its cases share them, so pools start
warm with whatever the previous cases left in them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import pytest
from builders.synthetic import HUB_LAYOUTS
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.formats import load_manifest
from moestream.reference import resident_model
from moestream.runtime import Tuning, config_from, native
from moestream.runtime.config import DTYPES, TUNING_FIELDS, USER_FIELDS
from moestream.runtime.pool import POLICIES

# Every runtime option the stress draws from, one line per RuntimeConfig field
# (test_every_field_is_drawn keeps it so).
RUNTIME_CHOICES: dict[str, list] = {
    "memory_budget": [None, "4G"],  # checked against cache_experts
    # 1 is below top-k (2): every decode step runs in groups, evicting experts
    # that are still routed in the same layer call; 8 holds every expert.
    "cache_experts": list(range(1, 9)),
    "dtype": list(DTYPES),
    "verify": [False, True],
    "context": [160, 4096],  # above the longest case (128 + 6 tokens)
    "policy": list(POLICIES),
    "prefetch": [None, False],  # True: the native engine only
    "prefetch_extra": [0, 2, 5],
    "record_trace": [False, True],
    "lrfu_decay": [0.5, Tuning.lrfu_decay],
    "engine": ["python", "native"] if native.available() else ["python"],
    "host_budget": [None],  # a GPU's tier: a CPU refuses it (test_native.py)
    "readers": [1, 3],
    "concurrency": [1, 2],
    "device_resolve": [False, True],  # a GPU's: no effect on a CPU
    "cpu_kernel": [None, False],  # True: the python engine too
    "kernel_threads": [0, 1],
    "kernel_spin_us": [0, Tuning.kernel_spin_us],
    "backend": ["auto", "slots", "mapped"] if native.available() else ["auto"],
    # fast: its own oracle, a resident model with the same arithmetic (test_fast.py)
    "arithmetic": ["exact"],
    "fast_rows": [Tuning.fast_rows],
}
FAST_CASES, SLOW_CASES = 30, 1000
FAST_SETS, SLOW_SETS = 8, 60  # option sets per run
VOCAB = 300  # below the tiny model's 320


def draw_options(rng: random.Random) -> dict:
    options = {k: rng.choice(v) for k, v in RUNTIME_CHOICES.items()}
    if options["concurrency"] > 1:  # a batch step needs concurrency x top-2 slots
        options["cache_experts"] = max(options["cache_experts"], 4)
    if options["backend"] == "mapped":  # what it has no use for is refused (tested)
        options.update(engine="native", cpu_kernel=None)
        options.update(cache_experts=None, memory_budget=None)
        options["dtype"] = "float32"  # the CPU kernel's
    return options


@dataclass
class Case:
    options: dict
    prompts: list[list[int]]
    chunks: list[int]  # prefill split, sizes summing to the prompt length
    decode_steps: int
    seed: int = 0

    @classmethod
    def draw(cls, rng: random.Random, seed: int, options: dict) -> Case:
        length = rng.choice([1, 2, 3, 5, 8, 17, 33, 64, 96, rng.randint(1, 128)])
        batch = rng.choice([1, 1, 1, 2, 3])
        if options.get("dtype") in ("bfloat16", "float16"):
            length, batch = min(length, 9), 1  # 8-40x slower on a CPU than float32
        prompts = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(batch)]
        cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randint(0, 2))))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        return cls(options, prompts, chunks, rng.randint(1, 6), seed)


@dataclass
class Stress:
    converted: object
    reference: object  # float32 compute
    # compute dtype -> mlx-lm's resident model computing in it
    other_dtypes: Callable[[str], object] | None = None
    models: dict = field(default_factory=dict)
    references: dict = field(default_factory=dict)
    cases: int = 0
    steps: int = 0

    def model(self, options: dict):
        key = tuple(sorted(options.items()))
        if key not in self.models:
            self.models[key] = moestream.load(self.converted, **options)[0]
        return self.models[key]

    def reference_for(self, dtype: str):
        if dtype in ("auto", "float32"):  # auto is float32 on a CPU
            return self.reference
        if dtype not in self.references:
            self.references[dtype] = self.other_dtypes(dtype)  # type: ignore[misc]
        return self.references[dtype]

    def run(self, case: Case) -> None:
        ours = self.model(case.options)
        a = logits_of(ours, case)
        b = logits_of(self.reference_for(case.options.get("dtype", "auto")), case)
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            assert mx.array_equal(x, y).item(), f"{case} differs at step {step}"
        self.cases += 1
        self.steps += len(a)


def logits_of(model, case: Case) -> list[mx.array]:
    """Chunked prefill, then greedy decode; logits of the last position each step."""
    cache = make_prompt_cache(model)
    tokens, pos, out = mx.array(case.prompts), 0, []
    for n in case.chunks:
        logits = model(tokens[:, pos : pos + n], cache=cache)
        pos += n
        out.append(logits)
    for _ in range(case.decode_steps):
        token = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
        out.append(model(token, cache=cache))
    mx.eval(out)
    return out


def stress(s: Stress, n: int, sets: int, seed: int) -> Stress:
    rng = random.Random(seed)
    options = [draw_options(rng) for _ in range(sets)]
    for i in range(n):
        s.run(Case.draw(rng, i, rng.choice(options)))
    return s


@pytest.fixture(scope="module")
def other_dtypes(hf_dir, recipe) -> Callable[[str], object]:
    return lambda dtype: resident_model(hf_dir, recipe, compute_dtype=dtype)


def test_every_field_is_drawn() -> None:
    assert set(RUNTIME_CHOICES) == {*USER_FIELDS, *TUNING_FIELDS}
    for name, values in RUNTIME_CHOICES.items():
        for v in values:
            config_from(**{name: v})  # each choice is valid


def test_stress_fast(converted, reference, other_dtypes) -> None:
    # seed 208 draws both engines, every backend and caches of 1 and 4-6 slots
    s = stress(Stress(converted, reference, other_dtypes), FAST_CASES, FAST_SETS, 208)
    assert s.cases == FAST_CASES
    print(f"stress: {s.cases} cases, {s.steps} steps, {len(s.models)} option sets")
    small = [m for k, m in s.models.items() if (dict(k)["cache_experts"] or 8) < 8]
    st = [moestream.stats(m) for m in small]
    assert sum(x.evictions for x in st) > 0 and sum(x.grouped_calls for x in st) > 0


@pytest.mark.slow
def test_stress_slow(converted, reference, other_dtypes) -> None:
    s = stress(Stress(converted, reference, other_dtypes), SLOW_CASES, SLOW_SETS, 2)
    assert s.cases == SLOW_CASES
    print(f"stress: {s.cases} cases, {s.steps} steps, {len(s.models)} option sets")


# ------------------------------------------------------------- adversarial


def test_capacity_one_evicts_experts_still_routed(converted, reference) -> None:
    """One slot, top-2: each decode step loads, uses, evicts and reloads in groups."""
    case = Case({"cache_experts": 1}, [[5, 9, 200, 17]], [4], decode_steps=12)
    s = Stress(converted, reference)
    s.run(case)
    st = moestream.stats(s.model(case.options))
    decode_calls = 12 * 2  # steps x MoE layers
    assert st.grouped_calls >= decode_calls  # every decode call overflowed
    assert st.evictions >= decode_calls


def test_batch_overflows_capacity_in_decode(converted, reference) -> None:
    """Three sequences x top-2 route up to 6 experts per step into 2 slots."""
    prompts = [[1, 2, 3], [250, 251, 252], [40, 80, 120]]
    Stress(converted, reference).run(Case({"cache_experts": 2}, prompts, [3], 8))


def test_prefill_chunks_overflow_capacity(converted, reference) -> None:
    rng = random.Random(7)
    prompt = [[rng.randrange(VOCAB) for _ in range(120)]]
    s = Stress(converted, reference)
    s.run(Case({"cache_experts": 3}, prompt, [50, 1, 69], 3))
    assert moestream.stats(s.model({"cache_experts": 3})).grouped_calls >= 2


@pytest.mark.parametrize("engine", RUNTIME_CHOICES["engine"])
def test_chained_calls_that_do_not_depend_on_each_other(
    converted, reference, engine
) -> None:
    """One-token prefill chunks are queued without a sync, and a chunk's MoE call
    does not depend on the previous chunk's: a miss of the later one must not
    overwrite a slot the earlier one has yet to read (the native engine did)."""
    for cache_experts in (3, 4):
        options = {"cache_experts": cache_experts, "engine": engine}
        Stress(converted, reference).run(Case(options, [[200, 172, 154]], [1] * 3, 6))


@pytest.mark.parametrize("engine", RUNTIME_CHOICES["engine"])
def test_grouped_chunk_after_an_unevaluated_one(converted, reference, engine) -> None:
    """A one-token chunk, then a chunk grouped on the host: the host must not
    write slots the earlier chunk, still unevaluated, has yet to read (the
    native engine did; the last of 5 lazy decode steps came out wrong)."""
    options = {"cache_experts": 4, "engine": engine}
    prompt = [238, 3, 272, 276, 224, 7, 261, 172, 198, 59, 15, 208, 225, 12, 189, 206]
    Stress(converted, reference).run(Case(options, [[*prompt, 170]], [4, 1, 12], 5))


def test_interleaved_sessions_share_one_pool(converted, reference) -> None:
    """Two conversations on one model, steps interleaved: the pool serves both."""
    model, _ = moestream.load(converted, cache_experts=2)
    sessions = [[3, 1, 4, 1, 5], [271, 82, 81, 8]]
    caches = [make_prompt_cache(model) for _ in sessions]
    ref_caches = [make_prompt_cache(reference) for _ in sessions]
    tokens = [mx.array([p]) for p in sessions]
    for _ in range(8):
        for i in range(len(sessions)):
            a = model(tokens[i], cache=caches[i])
            b = reference(tokens[i], cache=ref_caches[i])
            assert mx.array_equal(a, b).item()
            tokens[i] = mx.argmax(a[:, -1], axis=-1, keepdims=True)


@pytest.mark.skipif(not native.available(), reason="the native engine is not built")
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_prefetch_for_experts_evicted_before_use(converted, reference, policy) -> None:
    """Predictions for the next layer that go unused, or get evicted first, do no
    harm: prefetch only warms the page cache, slots change only on a miss."""
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(9)]]  # decode calls fit: fetch
    options = {"cache_experts": 3, "prefetch": True, "policy": policy}
    options["engine"] = "native"  # the python engine does not prefetch
    s = Stress(converted, reference)
    s.run(Case(options, prompts, [4, 5], decode_steps=10))
    st = moestream.stats(s.model(options))
    assert st.prefetched > st.prefetched_used  # some predictions were wasted
    assert st.evictions > 0


# ------------------------------------------------------------- every family

FAMILY_CASES = 40  # per family, slow run


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(HUB_LAYOUTS) - {"qwen3_moe"}))
def test_stress_every_family(family, tmp_path) -> None:
    """The same random cases on each family's tiny model (shared experts, biases,
    MXFP4 experts, hybrid attention): zero mismatches."""
    import json

    from builders.synthetic import tiny_model

    from moestream.converter import convert
    from moestream.families import get_family
    from moestream.formats import Recipe

    src = tiny_model(tmp_path / "hf", family, seed=3)
    bits = None if family == "gpt_oss" else "down_proj=6"  # MXFP4 kept as shipped
    convert(str(src), tmp_path / "out", bits=bits, progress=False)
    recipe = Recipe.parse(bits)
    reference = resident_model(src, recipe)
    config = json.loads((src / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    manifest = load_manifest(tmp_path / "out")
    experts = max(layer.num_experts for layer in manifest.layers)
    top_k = get_family(config).top_k(config)
    s = Stress(
        tmp_path / "out",
        reference,
        lambda dtype: resident_model(src, recipe, compute_dtype=dtype),
    )
    rng = random.Random(family)
    options = [draw_options(rng) for _ in range(8)]
    for i in range(FAMILY_CASES):
        case = Case.draw(rng, i, dict(rng.choice(options)))
        o = case.options
        least = min(experts, o["concurrency"] * top_k)  # or the plan refuses
        o["cache_experts"] = rng.randint(1 if o["concurrency"] == 1 else least, experts)
        # Slots here (families whose experts the CPU kernel does not cover
        # refuse mapped; test_mapped.py runs it).
        o["backend"] = "slots"
        case.prompts = [[t % vocab for t in p] for p in case.prompts]
        s.run(case)
    assert s.cases == FAMILY_CASES
