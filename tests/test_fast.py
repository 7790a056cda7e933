"""The fast arithmetic (RuntimeConfig.arithmetic = "fast") on a CPU: the
streaming model equals a resident model with the same arithmetic
(runtime/fast.py's use_fast_arithmetic) bit for bit at every cache size, with
either engine; exact_arithmetic runs the same model on the exact path;
`moestream eval` reports both; the plan names it; bad settings are one line.
tests/test_device.py holds the same on the GPU, in every compute dtype."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.bench.models import Scale, write_synthetic
from moestream.cli import main as cli
from moestream.reference import resident_from_converted
from moestream.runtime import RuntimeConfig, native
from moestream.runtime.fast import use_fast_arithmetic
from moestream.runtime.loader import budget_for, plan_for
from moestream.runtime.switch import exact_arithmetic

STEPS = 6
# The tiny model's 48-token prompt routes 12 pairs per expert: fast from 4.
ROWS = 4
ENGINES = ["python", "native"] if native.available() else ["python"]
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 8


@pytest.fixture(scope="module")
def oracles(converted: Path) -> dict[str, list[mx.array]]:
    """The resident model's logits with each arithmetic, computed once."""
    exact = resident_from_converted(converted, "float32")
    fast = use_fast_arithmetic(resident_from_converted(converted, "float32"), ROWS)
    return {
        "exact": logits_stepwise(exact, PROMPT, STEPS),
        "fast": logits_stepwise(fast, PROMPT, STEPS),
    }


def same(ours: list[mx.array], theirs: list[mx.array]) -> bool:
    return all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cache_experts", [2, 5, 8])
def test_fast_streaming_equals_the_fast_resident_model(
    converted, oracles, engine, cache_experts
):
    """Prefill (48 tokens, 96 pairs over 8 experts) runs fast, grouped where
    the slots are fewer than the routed experts; decode runs exact."""
    model, _ = moestream.load(
        converted,
        cache_experts=cache_experts,
        engine=engine,
        arithmetic="fast",
        fast_rows=ROWS,
    )
    assert same(logits_stepwise(model, PROMPT, STEPS), oracles["fast"])
    s = moestream.stats(model)
    assert s.fast_calls == 2  # the prefill's call of each MoE layer
    if cache_experts < 8:
        assert s.grouped_calls > 0 and s.misses > 0
    with exact_arithmetic(model):
        assert same(logits_stepwise(model, PROMPT, STEPS), oracles["exact"])
    assert moestream.stats(model).fast_calls == 2


def test_eval_reports_the_fast_path_against_the_exact_one(converted, tmp_path):
    data = tmp_path / "val.txt"
    data.write_text(TEXT)
    got = {}
    for arithmetic in ("exact", "fast"):
        args = ["eval", converted, "--data", data, "--context", 24, "--json"]
        args += ["--num-samples", 3, "--cache-experts", 3, "--arithmetic", arithmetic]
        args += ["--set", "fast_rows=2"]  # 23 tokens: 5.75 pairs per expert
        r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        got[arithmetic] = json.loads(r.output.strip().splitlines()[-1])
    assert got["exact"]["kl_exact"] is None
    # the fast model's exact path is the exact model's, bit for bit
    assert got["fast"]["exact_perplexity"] == got["exact"]["perplexity"]
    assert got["fast"]["kl_exact"] >= 0 and got["fast"]["tokens"] == 3 * 23
    assert got["fast"]["stats"]["fast_calls"] == 3 * 2  # each sequence's 2 layers


def test_the_plan_names_the_fast_arithmetic(converted):
    r = CliRunner().invoke(cli, ["plan", str(converted), "--arithmetic", "fast"])
    assert r.exit_code == 0, r.output
    assert "fast arithmetic (calls of 16+ rows per expert" in r.output
    assert "a fast call's dequantized slots" in r.output
    plain = CliRunner().invoke(cli, ["plan", str(converted)])
    assert "fast arithmetic" not in plain.output
    assert "dequantized" not in plain.output


def test_bad_fast_settings_are_one_line(converted):
    with pytest.raises(ValueError, match="Unknown arithmetic 'quick'") as e:
        RuntimeConfig(arithmetic="quick")
    with pytest.raises(ValueError, match="mapped cannot run with arithmetic") as m:
        RuntimeConfig(backend="mapped", arithmetic="fast")
    with pytest.raises(ValueError, match="on a CPU computes in float32") as d:
        moestream.load(converted, arithmetic="fast", dtype="bfloat16")
    assert all("\n" not in str(x.value) for x in (e, m, d))


# 2 layers of 16 experts, top-2, D 256 -> F 256: a layer's 16 slots are 12.6 MB
# dequantized to float32, 1.8 MB at 4 bits; the rest of the model is small.
WIDE = Scale(2, 16, 2, 256, 256, heads=4, kv_heads=2, head_dim=64, vocab=512)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fast") / "wide"
    write_synthetic(out, WIDE)
    return out


def test_the_plan_counts_the_fast_dequantized_slots(wide):
    """One layer's slots dequantized to float32 (all three projections), twice
    (the dequantize's and gather_mm's temporaries), in the total and in what a
    budget leaves for slots."""
    exact = plan_for(wide, RuntimeConfig(dtype="float32", cache_experts=16))
    fast = plan_for(
        wide, RuntimeConfig(dtype="float32", cache_experts=16, arithmetic="fast")
    )
    assert exact.fast_scratch == 0
    assert fast.fast_scratch == 2 * 16 * 3 * 256 * 256 * 4
    # The exact kernel's blocked slots keep the bfloat16 scales and biases;
    # the fast arithmetic's row slots hold them as float32.
    assert fast.total == exact.total + fast.fast_scratch + 16 * (
        fast.slot_bytes - exact.slot_bytes
    )
    assert exact.slot_bytes < fast.slot_bytes
    assert "fast dequantized 24.0M" in fast.describe()
    rows = RuntimeConfig(dtype="float32").with_options(cpu_kernel=False)
    budget = budget_for(wide, 16, options=rows)  # 16 float32 row slots
    slots = {
        a: plan_for(
            wide, RuntimeConfig(dtype="float32", memory_budget=budget, arithmetic=a)
        ).capacity
        for a in ("exact", "fast")
    }
    # 16 row slots' bytes hold every (smaller) blocked slot, and 2 row slots
    # with their dequantized weights
    assert slots["exact"] == 16
    assert slots["fast"] == 16 * fast.slot_bytes // fast.per_slot == 2


@pytest.mark.parametrize("cache_experts", [16, 6])
def test_a_fast_prefill_stays_inside_the_plan(wide, cache_experts):
    """MLX's peak in a fast prefill, above what was allocated before it, fits
    the plan's transient share (KV cache, activations, staging and the fast
    dequantized slots): every layer's slots dequantized at once, or a
    projection's before its turn, would not."""
    model, _ = moestream.load(
        wide,
        cache_experts=cache_experts,
        arithmetic="fast",
        fast_rows=4,  # 64 tokens x 2 of 16 experts: 8 pairs per expert
        dtype="float32",
        context=64,
    )
    plan = moestream.runtime_of(model).plan
    prompt = mx.array([[(5 * i + 1) % 512 for i in range(64)]])
    mx.eval(model(prompt[:, :4]))  # first-use checks
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(prompt))
    mx.synchronize()
    assert moestream.stats(model).fast_calls == 2
    transient = plan.kv_cache + plan.activations + plan.staging + plan.fast_scratch
    assert mx.get_peak_memory() - before <= transient
