"""RuntimeConfig.mapped: each blob mapped read-only and the CPU kernel reading
every routed record in place, no slots. The logits are the resident model's
bit for bit on every bit width, group sizes and stored float dtypes, cold
(a call's misses read while its kernel computes the other experts); its
counters say what the page cache held; a corrupt record fails its checksum
and a truncated blob (which a mapping would fault on) is refused at load,
each in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import BITS4, PROMPT, corrupt_layer, logits_stepwise
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.bench.sysio import drop_cache
from moestream.converter import convert
from moestream.formats import FormatError, Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import ExpertReadError, RuntimeConfig, config_from, native
from moestream.runtime.loader import BudgetError, execution_for, plan_for
from moestream.runtime.switch import StreamingSwitchGLU

pytestmark = pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native extension or its exact CPU kernel is not here",
)

# moe_intermediate_size 192: rows past a task of 64 (and of 32 lanes); every
# input dimension a multiple of group size 64 (128 where the hidden size is).
GEOMETRY = {"num_hidden_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 192}


def _converted(
    root: Path, bits: str, group_size: int, dtype: mx.Dtype, layout: str = "rows"
) -> Path:
    hf = tiny_qwen3_moe(root / "hf", dtype=dtype, **GEOMETRY)
    name = str(dtype).removeprefix("mlx.core.")
    out = root / "out"
    convert(str(hf), out, bits, group_size, dtype=name, progress=False, layout=layout)
    return hf


@pytest.mark.parametrize(
    "bits, group_size, dtype",
    [
        ("gate_proj=4,up_proj=4,down_proj=8", 64, mx.bfloat16),
        ("gate_proj=2,up_proj=3,down_proj=5", 32, mx.float16),
        ("gate_proj=6,up_proj=8,down_proj=4", 64, mx.float32),
    ],
    ids=["4-4-8-g64-bf16", "2-3-5-g32-f16", "6-8-4-g64-f32"],
)
def test_mapped_gives_the_resident_models_logits(
    tmp_path: Path, bits: str, group_size: int, dtype: mx.Dtype
):
    hf = _converted(tmp_path, bits, group_size, dtype)
    stored = load_manifest(tmp_path / "out").layers[0].segments
    assert {s.dtype for s in stored if s.name.endswith("scales")} == {
        str(dtype).removeprefix("mlx.core.")
    }
    out = tmp_path / "out"
    model, _ = moestream.load(out, backend="mapped")
    layers = [m for _, m in model.named_modules() if hasattr(m, "_mapped")]
    assert layers and all(m._mapped is not None and m.capacity == 0 for m in layers)
    for layer in load_manifest(out).layers:  # cold: misses read under the kernel
        drop_cache(out / layer.file)
    name = str(dtype).removeprefix("mlx.core.")
    reference = resident_model(hf, Recipe.parse(bits, group_size=group_size), name)
    ours = logits_stepwise(model, PROMPT, steps=6)  # a prefill of many pairs first
    theirs = logits_stepwise(reference, PROMPT, steps=6)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    # The kernel computed pairs whose records were still being read.
    assert moestream.stats(model).misses > 0


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mapped")
    _converted(root, "gate_proj=4,up_proj=4,down_proj=4", 64, mx.bfloat16)
    return root / "out"


def test_no_slots_are_planned(converted: Path):
    plan = plan_for(converted, RuntimeConfig(backend="mapped"))
    slots = plan_for(converted, RuntimeConfig())
    assert plan.mapped and plan.capacity == 0 and plan.pools == 0
    assert slots.pools > 0 and plan.total < slots.total
    assert (plan.dense, plan.kv_cache) == (slots.dense, slots.kv_cache)
    assert "experts mapped" in plan.describe()
    from moestream.plan import format_plan, plan_dict
    from moestream.runtime.loader import execution_for

    cfg = RuntimeConfig(backend="mapped")
    text = format_plan({"plan": plan_dict(execution_for(converted, cfg), cfg)})
    assert "backend cpu-mapped, experts mapped" in text
    assert "mapped: no slots, the page cache holds them" in text
    # records as rows: the plan names the layout the kernel reads faster
    assert "records as rows (convert-moe --layout blocked: faster)" in text
    with pytest.raises(BudgetError, match="more than the budget") as e:
        plan_for(converted, RuntimeConfig(backend="mapped", memory_budget="1M"))
    assert "\n" not in str(e.value)


def test_the_forecast_hits_what_the_page_cache_can_keep(converted: Path, monkeypatch):
    from mlx_lm.utils import load_config

    from moestream import plan as planning

    plan = plan_for(converted, RuntimeConfig(backend="mapped"))
    manifest, config = load_manifest(converted), load_config(converted)
    probe = planning.Probe(0.01, 1e-4, 0.2, 0.5, 4.0)
    half = manifest.expert_bytes // 2
    rows = planning.forecasts(manifest, config, plan, probe, page_cache=half)
    assert rows[0].hit_rate == pytest.approx(half / manifest.expert_bytes)
    assert [f.hit_rate for f in rows[1:]] == [0.75, 0.9, 0.95]
    (full,) = planning.forecasts(manifest, config, plan, probe, page_cache=2 * half + 1)
    assert full.hit_rate == 1.0 and full.misses_per_token == 0
    # what the system can give, less what the plan holds beyond this process
    monkeypatch.setattr(planning, "available_memory", lambda: plan.total + half)
    assert planning.page_cache_room(plan) == plan.process + half
    monkeypatch.setattr(planning, "available_memory", lambda: 0)
    assert planning.page_cache_room(plan) == 0


def test_mapped_hints_nothing_ahead_unless_asked(converted: Path):
    """Next-layer hints measured slower on mapped and on slots: off by
    default on both; prefetch=True still turns them on."""
    for backend in ("mapped", "slots"):
        assert not execution_for(converted, RuntimeConfig(backend=backend)).prefetch
        on = config_from(backend=backend, prefetch=True)
        assert execution_for(converted, on).prefetch


def test_a_prompts_outputs_do_not_stay_alive_in_every_layer(converted: Path):
    """What a mapped layer's next call waits for: after a prompt, a
    one-element array that waits for the prompt's output, not the output
    (`[batch, tokens, k, hidden]`, alive in every layer until its next call
    otherwise: 400 MB more for `small`'s 1024-token prompt); after a decode
    step, the step's output itself (no node added to a step). The logits are
    the same either way."""
    model, _ = moestream.load(converted, backend="mapped")
    switches = [
        m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)
    ]
    cache = make_prompt_cache(model)
    logits = model(PROMPT[:, :6], cache=cache)
    mx.eval(logits)
    assert switches and all(m._engine.last.size == 1 for m in switches)
    token = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
    mx.eval(model(token, cache=cache))
    for m in switches:
        assert m._engine.last.shape[-3] == 1 and m._engine.last.size > 1


@pytest.mark.parametrize(
    "options",
    [{"backend": "mapped"}, {"engine": "native", "cache_experts": 2}],
    ids=["mapped", "slots-in-place"],
)
def test_a_prompts_output_that_nothing_asks_for_is_never_computed(
    tmp_path: Path, options: dict
):
    """mlx-lm's generate_step evaluates a prompt's chunk for its caches alone,
    so the last layer's output feeds nothing it evaluates: that layer routes
    no expert for the chunk, and the next step neither waits for its output
    nor computes it. Held (the chunk's logits kept), it is computed when
    asked, after the next step, and equals the resident model's."""
    from mlx_lm.utils import load_config

    hf = _converted(tmp_path, BITS4, 64, mx.bfloat16, layout="blocked")
    converted = tmp_path / "out"  # blocked: a prompt past the slots is in place
    model, _ = moestream.load(converted, **options)
    caches = moestream.stats(model).native_layers
    last = max(caches)

    def routed() -> dict[int, int]:
        return {n: sum(native.take_uses(c)) for n, c in caches.items()}

    cache = make_prompt_cache(model)
    model(PROMPT[:, :6], cache=cache)  # its logits dropped
    mx.eval([c.state for c in cache])
    chunk = routed()
    assert chunk[last] == 0 and all(v > 0 for n, v in chunk.items() if n != last)
    mx.eval(model(PROMPT[:, 6:7], cache=cache))
    step = routed()  # the step's own calls (top-k experts each), no more
    top_k = load_config(converted)["num_experts_per_tok"]
    assert step[last] == step[min(step)] == top_k

    reference = resident_model(hf, Recipe.parse(BITS4, 64), "bfloat16")
    for held_first in (True, False):
        cache = make_prompt_cache(model)
        chunk = model(PROMPT[:, :6], cache=cache)
        mx.eval([c.state for c in cache])
        step = model(PROMPT[:, 6:7], cache=cache)
        mx.eval(step if held_first else chunk)
        theirs = logits_stepwise(reference, PROMPT[:, :6], steps=0)[0]
        assert mx.array_equal(chunk, theirs).item()
    assert moestream.stats(model).grouped_calls == 0


def test_counters_say_what_the_page_cache_held(converted: Path):
    model, _ = moestream.load(converted, backend="mapped")
    for layer in load_manifest(converted).layers:  # mapped, not yet touched
        drop_cache(converted / layer.file)
    prompt = mx.array(PROMPT[:4])
    logits_stepwise(model, prompt, steps=1)
    cold = moestream.stats(model)
    assert cold.misses > 0 and cold.bytes_read > 0
    moestream.stats(model).reset()
    logits_stepwise(model, prompt, steps=1)  # the same routing, now cached
    warm = moestream.stats(model)
    assert warm.hits > 0 and warm.misses == 0 and warm.bytes_read == 0


def test_a_corrupt_record_fails_its_checksum(tmp_path: Path):
    _converted(tmp_path, "gate_proj=4,up_proj=4,down_proj=4", 64, mx.bfloat16)
    out = tmp_path / "out"
    corrupt_layer(out, load_manifest(out).layers[1])
    model, _ = moestream.load(out, backend="mapped")
    with pytest.raises(ExpertReadError, match="fails its checksum") as e:
        logits_stepwise(model, PROMPT, steps=1)
    assert "\n" not in str(e.value) and "layer 1" in str(e.value)
    # Unverified (the user asked for no checks), the same blob runs.
    model, _ = moestream.load(out, backend="mapped", verify=False)
    logits_stepwise(model, PROMPT, steps=1)


def test_a_truncated_blob_is_refused_at_load(tmp_path: Path):
    _converted(tmp_path, "gate_proj=4,up_proj=4,down_proj=4", 64, mx.bfloat16)
    out = tmp_path / "out"
    blob = out / load_manifest(out).layers[0].file
    with open(blob, "r+b") as f:
        f.truncate(blob.stat().st_size - 4096)
    with pytest.raises(FormatError, match="truncated") as e:
        moestream.load(out, backend="mapped", verify=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"engine": "python"}, "engine='python'"),
        ({"cpu_kernel": False}, "cpu_kernel=False"),
        ({"cache_experts": 4}, "cache_experts"),
        ({"host_budget": "64M"}, "host_budget"),
    ],
)
def test_what_mapped_has_no_use_for_is_refused(options: dict, words: str):
    with pytest.raises(ValueError, match="mapped cannot run with") as e:
        config_from(backend="mapped", **options)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_mapped_refuses_a_dtype_the_kernel_does_not_compute(converted: Path):
    with pytest.raises(native.NativeEngineError, match="float32") as e:
        moestream.load(converted, backend="mapped", dtype="bfloat16")
    assert "\n" not in str(e.value)


def test_run_moe_mapped_generates_what_slots_generate(converted: Path):
    from click.testing import CliRunner

    from moestream.cli.run import main as run_main

    def run(*flags: str) -> dict:
        args = [str(converted), "-p", "def add", "--max-tokens", "10", "--json"]
        r = CliRunner().invoke(run_main, [*args, *flags], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads(r.output.strip().splitlines()[-1])

    mapped, slots = run("--backend", "mapped"), run("--cache-experts", "3")
    assert mapped["tokens"] == slots["tokens"] and mapped["text"] == slots["text"]
    assert mapped["stats"]["generation_tokens"] == len(mapped["tokens"])
    r = CliRunner().invoke(
        run_main,
        [str(converted), "-p", "x", "--backend", "mapped", "--cache-experts", "3"],
    )
    assert r.exit_code == 2
    assert re.fullmatch(r"error: mapped cannot run with cache_experts.*\n", r.output)


def test_mapped_is_the_default_where_slots_do_not_all_fit(converted: Path, monkeypatch):
    from moestream.runtime import loader, memory

    experts = load_manifest(converted).layers[0].num_experts
    default, _ = moestream.load(converted)  # every expert's slot fits here
    assert moestream.runtime_of(default).plan.capacity == experts
    assert not moestream.runtime_of(default).execution.mapped
    # As if the machine had memory for half the slots (the process's own
    # bytes held still: the slots are small beside their drift):
    monkeypatch.setattr(loader, "_process_bytes", lambda: 200 << 20)
    p = plan_for(converted, RuntimeConfig(cache_experts=experts // 2))
    half = loader._budget_holding(p.total - p.reserve + p.slot_bytes // 2)
    monkeypatch.setattr(memory, "default_budget", lambda need, process: half)
    model, _ = moestream.load(converted)
    runtime = moestream.runtime_of(model)
    assert runtime.execution.backend == "cpu-mapped" and runtime.plan.mapped
    assert plan_for(converted).mapped  # the plan command says the same
    # Asked for slots, a budget, or slots by count: slots.
    for options in (
        {"backend": "slots"},
        {"memory_budget": half},
        {"cache_experts": 4},
    ):
        plan = moestream.runtime_of(moestream.load(converted, **options)[0]).plan
        assert not plan.mapped and 0 < plan.capacity < experts, options
    slots, _ = moestream.load(converted, backend="slots")
    ours, theirs = (logits_stepwise(m, PROMPT, steps=4) for m in (model, slots))
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
