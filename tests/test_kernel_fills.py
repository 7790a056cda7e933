"""CPU slots filled by the kernel (ExpertCache.fill_in_kernel): a decode
call's miss whose record has been checked and lies in the page cache is not
read; the CPU kernel computes its pairs from the blob's mapping and writes
the slot as it reads (blocked records), or fills it from the mapping first
(row records). Bit-identical to mlx-lm's resident model on several bit
widths, group sizes and stored float dtypes; a fill no kernel took is made
by the layer's next call; what the kernel cannot read in place (a record
not yet checked, one with a failure) is read as before."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from builders.synthetic import tiny_qwen3_moe
from helpers import PROMPT, logits_stepwise
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.bench.sysio import drop_cache, read_in_order
from moestream.converter import convert
from moestream.formats import Recipe, load_manifest
from moestream.reference import resident_model
from moestream.runtime import (
    ExpertReadError,
    RuntimeConfig,
    Tuning,
    loader,
    memory,
    native,
)
from moestream.runtime.loader import BudgetError, plan_for
from moestream.runtime.switch import StreamingSwitchGLU

pytestmark = pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native extension or its exact CPU kernel is not here",
)

# An expert's hidden size of 192 is twelve blocks of 16 rows, past a task of
# 64; 256 lets groups of 128 divide it.
CASES = {
    "4-4-8-g64-bf16-blocked": (
        "gate_proj=4,up_proj=4,down_proj=8",
        64,
        mx.bfloat16,
        192,
        "blocked",
    ),
    "2-3-5-g32-f16-blocked": (
        "gate_proj=2,up_proj=3,down_proj=5",
        32,
        mx.float16,
        192,
        "blocked",
    ),
    "6-8-4-g128-f32-blocked": (
        "gate_proj=6,up_proj=8,down_proj=4",
        128,
        mx.float32,
        256,
        "blocked",
    ),
    "4-4-8-g64-bf16-rows": (
        "gate_proj=4,up_proj=4,down_proj=8",
        64,
        mx.bfloat16,
        192,
        "rows",
    ),
}
STEPS = 8
RESIDENT: dict[Path, object] = {}  # each case's resident model, by its output


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A conversion of one case and the resident model's logits."""
    bits, group_size, dtype, hidden, layout = CASES[request.param]
    root = tmp_path_factory.mktemp("fills")
    geometry = {"num_hidden_layers": 2, "mlp_only_layers": []}
    hf = tiny_qwen3_moe(
        root / "hf", dtype=dtype, moe_intermediate_size=hidden, **geometry
    )
    name = str(dtype).removeprefix("mlx.core.")
    out = root / "out"
    convert(str(hf), out, bits, group_size, dtype=name, progress=False, layout=layout)
    ref = resident_model(hf, Recipe.parse(bits, group_size=group_size), name)
    RESIDENT[out] = ref
    return out, logits_stepwise(ref, PROMPT, steps=STEPS)


def warm(out: Path) -> None:
    """Every blob in the page cache: a miss's record can be read in place."""
    for layer in load_manifest(out).layers:
        (out / layer.file).read_bytes()


def warm_in_order(out: Path) -> None:
    """Every blob read again in order, as a user's copy would leave it (a
    fault may then map records beside the one read with it)."""
    for layer in load_manifest(out).layers:
        read_in_order(out / layer.file)


def layers(model) -> list[StreamingSwitchGLU]:
    return [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]


def fill_in_kernel(model, on: bool) -> None:
    """The test hook: every layer's kernel fills (blocked records only), or none."""
    for m in layers(model):
        m._engine.cache.fill_in_kernel = on
        m._experts.fills = m._engine.cache if on else None


@pytest.mark.parametrize("verify", [True, False])
def test_kernel_fills_give_the_resident_models_logits(case, verify: bool):
    out, theirs = case
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, verify=verify)
    blocked = load_manifest(out).blocked
    assert all(m._engine.cache.fill_in_kernel == blocked for m in layers(model))
    if not blocked:  # the path rows would take, forced (it earns nothing there)
        fill_in_kernel(model, True)
    ours = logits_stepwise(model, PROMPT, steps=STEPS)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"
    stats = moestream.stats(model)
    # Checked records are left to the kernel; unchecked ones are read first.
    assert 0 < stats.kernel_fills < stats.misses


def mapped_kb(path: Path) -> int:
    """This process's resident kB of mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_records_filled_in_the_kernel_leave_the_process(case):
    """A record the kernel read in place is unmapped once its slot holds it:
    the process's resident memory stays its slots', as when records are read."""
    out, _ = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read, not mapped")
    warm_in_order(out)
    gc.collect()  # the models of the tests before, and their mappings
    model, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    logits_stepwise(model, PROMPT, steps=STEPS)
    assert moestream.stats(model).kernel_fills > 0
    # What stays mapped is at most a few pages the kernel mapped around an
    # access, never a record, nor the large folios a fault maps whole:
    # filled records do not pile up.
    for layer in load_manifest(out).layers:
        resident = mapped_kb((out / layer.file).resolve()) * 1024
        assert resident < layer.record_nbytes, (layer.layer, resident)


def test_the_same_logits_with_the_kernel_fills_off(case):
    """The reads into the slots, as before (the test hook turns them back on)."""
    out, theirs = case
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    fill_in_kernel(model, False)
    ours = logits_stepwise(model, PROMPT, steps=STEPS)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs, strict=True))
    stats = moestream.stats(model)
    assert stats.kernel_fills == 0 and stats.misses > 0


def slot_bytes(m: StreamingSwitchGLU) -> list[np.ndarray]:
    arrays = [module[name] for module, name in m._targets]
    mx.eval(arrays)
    return [np.array(a.view(mx.uint8)) for a in arrays]


def test_a_fill_no_kernel_took_is_made_by_the_next_call(case):
    """A fetch evaluated without its kernel leaves its slots waiting; the
    layer's next call fills them from the mapping before it resolves."""
    out, _ = case
    warm(out)
    waiting, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    filled, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    fill_in_kernel(waiting, True)
    fill_in_kernel(filled, False)
    a, b = layers(waiting)[0], layers(filled)[0]
    before = slot_bytes(a)
    ids = mx.array([[3, 5]], mx.uint32)
    mx.eval(native.fetch(a._engine.cache, ids, None, -1))
    mx.eval(native.fetch(b._engine.cache, ids, None, -1))
    assert moestream.stats(waiting).kernel_fills == 2
    assert all(np.array_equal(x, y) for x, y in zip(before, slot_bytes(a), strict=True))
    assert not all(
        np.array_equal(x, y) for x, y in zip(slot_bytes(a), slot_bytes(b), strict=True)
    )
    mx.eval(native.fetch(a._engine.cache, ids, None, -1))  # two hits: settles first
    assert all(
        np.array_equal(x, y) for x, y in zip(slot_bytes(a), slot_bytes(b), strict=True)
    )


def test_a_slot_many_pairs_read_is_filled_before_the_call(case):
    """A decode call whose expert has enough pairs for the panels (a batch of
    sequences): its slot is filled from the mapping first, then read as any
    other; the same output as the slots read in the fetch."""
    out, _ = case
    warm(out)
    outputs = []
    for on in (True, False):
        model, _ = moestream.load(out, engine="native", cache_experts=6, verify=False)
        fill_in_kernel(model, on)
        m = layers(model)[0]
        x = mx.random.normal((3, 128), key=mx.random.key(1))
        ids = mx.array([[3, 5], [3, 5], [5, 3]], mx.uint32)  # 3 pairs an expert
        outputs.append(m._experts(x, native.fetch(m._engine.cache, ids, None, -1)))
        mx.eval(outputs[-1])
        assert moestream.stats(model).kernel_fills == (2 if on else 0)
    assert mx.array_equal(*outputs).item()


def test_a_failing_record_is_read_and_says_so(case):
    """An injected read failure is never skipped by an in-place fill."""
    out, _ = case
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    fill_in_kernel(model, True)
    cache = layers(model)[0]._engine.cache
    cache.inject_read_failures(6, 2)  # the read and its retry
    with pytest.raises(ExpertReadError):
        mx.eval(native.fetch(cache, mx.array([[6, 7]], mx.uint32), None, -1))
    assert moestream.stats(model).kernel_fills <= 1


def test_only_cpu_slots_fill_in_the_kernel(case):
    out, _ = case
    model, _ = moestream.load(out, engine="native", backend="mapped")
    with pytest.raises(ValueError, match="only CPU slots"):
        layers(model)[0]._engine.cache.fill_in_kernel = True


def test_a_prefill_past_the_slots_reads_the_records_in_place(case):
    """A call with more pairs than slots (the prompt) on blocked records:
    one kernel call computes every pair from its record in place, cold and
    checked, writing no slot; the resident model's logits (the test above),
    and the records leave the process's page tables after it."""
    out, theirs = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read into slots, a group at a time")
    for layer in load_manifest(out).layers:
        drop_cache(out / layer.file)
    gc.collect()
    model, _ = moestream.load(out, engine="native", cache_experts=2)
    before = [slot_bytes(m) for m in layers(model)]
    tables = [m.slot_table().copy() for m in layers(model)]
    ours = logits_stepwise(model, PROMPT, steps=0)  # the prefill alone
    assert mx.array_equal(ours[0], theirs[0]).item()
    stats = moestream.stats(model)
    assert stats.in_place_calls == len(layers(model)) and stats.grouped_calls == 0
    assert stats.misses > 0 and stats.kernel_fills == 0
    for m, table, slots in zip(layers(model), tables, before, strict=True):
        # what orders the layer's next call after this one is not the
        # prefill's output, which would stay alive in every layer until then
        assert m._engine.last.size == 1
        assert np.array_equal(m.slot_table(), table)
        assert all(
            np.array_equal(a, b) for a, b in zip(slots, slot_bytes(m), strict=True)
        )
    for layer in load_manifest(out).layers:
        resident = mapped_kb((out / layer.file).resolve()) * 1024
        assert resident < layer.record_nbytes, (layer.layer, resident)


def test_an_in_place_call_says_which_read_failed(case):
    """A record the in-place call cannot read raises ExpertReadError, and
    leaves nothing mapped that the next call would trip on."""
    out, _ = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read into slots, a group at a time")
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, verify=False)
    m = layers(model)[0]
    x = mx.random.normal((4, 128), key=mx.random.key(2))
    ids = mx.array([[0, 6], [1, 6], [2, 3], [4, 5]], mx.uint32)
    m._engine.cache.inject_read_failures(6, 2)  # the read and its retry
    with pytest.raises(ExpertReadError, match="expert 6"):
        mx.eval(m._in_place(x, ids))
    again = m._in_place(x, ids)
    mx.eval(again)
    fill_in_kernel(model, False)  # the same pairs through slots: the same output
    assert mx.array_equal(again, m._grouped(x, ids, m._experts)).item()


def test_an_in_place_call_is_in_the_trace(case):
    """With the trace recorded (as `moestream bench` and `run-moe --trace`
    load), the prompt still runs in place, and each layer's call is one
    event: the router's experts, the hits those in slots, the bytes every
    routed record's (each computed from its record; a record's first use
    reads it once more, to check it), adding up to the counters."""
    out, theirs = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read into slots, a group at a time")
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, record_trace=True)
    tables = [m.slot_table().copy() for m in layers(model)]
    ours = logits_stepwise(model, PROMPT, steps=0)
    assert mx.array_equal(ours[0], theirs[0]).item()
    stats = moestream.stats(model)
    assert stats.in_place_calls == len(layers(model)) and stats.grouped_calls == 0
    events = stats.events
    assert len(events) == len(layers(model))
    for e, m, table in zip(events, layers(model), tables, strict=True):
        routed = set(e["experts"])
        record = m._layer.record_nbytes
        assert e["step"] == 0 and e["tokens"] == PROMPT.size
        assert e["hits"] == sum(table[x] < m.capacity for x in routed)
        assert e["hits"] + e["misses"] == len(routed)
        assert e["bytes_read"] == 2 * len(routed) * record  # cold: checked first
    assert sum(e["misses"] for e in events) == stats.misses > 0
    assert sum(e["bytes_read"] for e in events) == stats.bytes_read


def test_the_plan_counts_a_mapped_record_a_kernel_thread(case):
    """A prefill past the slots maps one record per kernel thread at once:
    the memory plan's staging share counts that many of the largest records
    where more than the reads' two, and the prefill gives the resident
    model's logits on one thread or several."""
    out, theirs = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read into slots, a group at a time")
    largest = max(layer.record_nbytes for layer in load_manifest(out).layers)
    for threads, records in ((1, 2), (2, 2), (5, 5)):
        model, _ = moestream.load(
            out, engine="native", cache_experts=2, kernel_threads=threads
        )
        assert moestream.runtime_of(model).plan.staging == records * largest
        ours = logits_stepwise(model, PROMPT, steps=0)
        assert mx.array_equal(ours[0], theirs[0]).item()
        assert moestream.stats(model).in_place_calls == len(layers(model))


def two_turns(model) -> mx.array:
    """The prompt, three greedy tokens, then a second prompt (a chat's next
    turn) on the same cache: the second prompt's logits."""
    cache = make_prompt_cache(model)
    token = mx.argmax(model(PROMPT, cache=cache)[:, -1], axis=-1, keepdims=True)
    for _ in range(3):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
    turn = mx.array([[(11 * i + 7) % 100 for i in range(12)]])
    out = model(turn, cache=cache)
    mx.eval(out)
    return out


def test_an_in_place_call_computes_the_slots_experts_from_their_slots(case):
    """A prompt past the slots after decode steps, when slots hold experts:
    those are computed from their slots (no record mapped, nothing counted
    read for them), the others from their records, and the logits are the
    resident model's."""
    out, _ = case
    if not load_manifest(out).blocked:
        pytest.skip("row records are read into slots, a group at a time")
    warm(out)
    model, _ = moestream.load(out, engine="native", cache_experts=2, record_trace=True)
    ours = two_turns(model)
    assert mx.array_equal(ours, two_turns(RESIDENT[out])).item()
    n = len(layers(model))
    events = moestream.stats(model).events
    assert moestream.stats(model).in_place_calls == 2 * n
    turn = events[-n:]
    assert sum(e["hits"] for e in turn) > 0
    for i, (e, m) in enumerate(zip(turn, layers(model), strict=True)):
        before = {x for earlier in events[i:-n:n] for x in earlier["experts"]}
        fresh = len(set(e["experts"]) - before)  # first use: read to check
        assert e["bytes_read"] == (e["misses"] + fresh) * m._layer.record_nbytes


def test_a_mapped_layer_under_a_budget_keeps_only_its_window_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The mapped backend under --memory-budget: past the rest of the plan,
    the budget holds each layer's window of records kept in the page tables,
    the most recently routed. A prompt past the window reads the others one
    a thread and lets them go; after every call the records out of the window
    leave. Over blocked records it is the default under a budget that does
    not hold a slot for every expert. The logits are the resident model's
    through a prompt, decode steps and a second prompt; a budget that holds
    fewer records than a decode step routes to is one line."""
    geometry = {"num_hidden_layers": 2, "mlp_only_layers": []}
    hf = tiny_qwen3_moe(tmp_path / "hf", moe_intermediate_size=1024, **geometry)
    out = tmp_path / "out"
    convert(
        str(hf),
        out,
        "gate_proj=4,up_proj=4,down_proj=4",
        64,
        dtype="bfloat16",
        progress=False,
        layout="blocked",
    )
    recipe = Recipe.parse("gate_proj=4,up_proj=4,down_proj=4", group_size=64)
    theirs = two_turns(resident_model(hf, recipe, "bfloat16"))
    warm(out)
    measured = memory._process_bytes()  # the plan's and load's alike
    monkeypatch.setattr(loader, "_process_bytes", lambda: measured)
    base = plan_for(out, RuntimeConfig(backend="mapped"))
    record = base.slot_bytes  # one record in every layer
    layers_of = load_manifest(out).layers
    for window in (0, 3):  # without a budget every record stays mapped
        # under a budget over blocked records, mapped is the default
        budget = base.total + (window + 0.5) * record  # (reserves differ a little)
        options = {"memory_budget": int(budget)} if window else {}
        model, _ = moestream.load(
            out, backend="auto" if window else "mapped", **options
        )
        assert moestream.runtime_of(model).plan.mapped
        assert moestream.runtime_of(model).plan.window == window
        assert mx.array_equal(two_turns(model), theirs).item()
        kept = window or layers_of[0].num_experts
        for x in layers_of:
            resident = mapped_kb((out / x.file).resolve()) * 1024
            # (a record's pages leave with 64 KB either side)
            assert resident <= kept * x.record_nbytes + (kept + 1) * (128 << 10)
            assert window or resident >= kept * x.record_nbytes
        del model
        gc.collect()
    # a prompt past the window maps a record a kernel thread, as past slots
    largest = max(x.record_nbytes for x in layers_of)
    cfg = RuntimeConfig(backend="mapped", memory_budget=base.total + 8 * record)
    for threads, records in ((1, 2), (5, 5)):
        plan = plan_for(out, replace(cfg, tuning={"kernel_threads": threads}))
        assert plan.staging == records * largest
    slots, _ = moestream.load(
        out, backend="slots", memory_budget=base.total + 3 * record
    )
    assert not moestream.runtime_of(slots).plan.mapped
    with pytest.raises(BudgetError, match="fewer than the 2 a decode step routes to"):
        moestream.load(out, backend="mapped", memory_budget=base.total + record)


def _peak_rise(run) -> int:
    """How far this process's peak resident memory rose above where it
    stood while `run()` ran (Linux: /proc/self/clear_refs resets the peak)."""
    Path("/proc/self/clear_refs").write_text("5")

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise AssertionError(key)

    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


def test_a_mapped_prompt_wider_than_its_window_maps_a_record_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A prompt routed past its window whose records are checked the first
    time (or read cold) maps them in, checks and computes them a record a
    kernel thread, as the slots' in-place prompt does: its peak resident
    memory rises no more than the same prompt's once every record is
    checked, not by the layer's records; no fault maps a huge page's worth
    of records at once. The logits are the resident model's."""
    geometry = {"num_hidden_layers": 1, "mlp_only_layers": []}
    width = {"hidden_size": 256, "moe_intermediate_size": 2048}
    hf = tiny_qwen3_moe(
        tmp_path / "hf", num_experts=48, num_experts_per_tok=8, **geometry, **width
    )
    out = tmp_path / "out"
    recipe = "gate_proj=4,up_proj=4,down_proj=4"
    convert(
        str(hf), out, recipe, 64, dtype="bfloat16", progress=False, layout="blocked"
    )
    blob = (out / load_manifest(out).layers[0].file).resolve()
    warm_in_order(out)
    measured = memory._process_bytes()
    monkeypatch.setattr(loader, "_process_bytes", lambda: measured)
    base = plan_for(out, RuntimeConfig(backend="mapped"))
    record = base.slot_bytes
    tuning = Tuning(kernel_threads=2)
    model, _ = moestream.load(
        out,
        backend="mapped",
        memory_budget=int(base.total + 10.5 * record),
        tuning=tuning,
    )
    window = moestream.runtime_of(model).plan.window  # (reserves differ a little)
    assert 10 <= window <= 12
    prompt = mx.array([[(7 * i + 3) % 300 for i in range(96)]])
    outs, rises = [], []

    def run() -> None:
        outs.append(model(prompt, cache=make_prompt_cache(model)))
        mx.eval(outs[-1])

    limit = mx.set_cache_limit(0)  # freed buffers leave: both peaks are live
    try:
        for _ in range(2):  # records checked the first time, then checked
            rises.append(_peak_rise(run))
    finally:
        mx.set_cache_limit(limit)
    # (the first may leave the window's records mapped, then a thread's each)
    layer = load_manifest(out).layers[0]
    assert rises[0] <= rises[1] + (window + 4) * layer.record_nbytes, rises
    # decode steps: what stays mapped is the window's records, each page on
    # its own
    cache = make_prompt_cache(model)
    token = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1, keepdims=True)
    for _ in range(6):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1, keepdims=True)
    mx.eval(token)
    kept = window * layer.record_nbytes + (window + 1) * (128 << 10)
    assert mapped_kb(blob) * 1024 <= kept, (mapped_kb(blob), kept)
    ref = resident_model(hf, Recipe.parse(recipe, group_size=64), "bfloat16")
    theirs = ref(prompt, cache=make_prompt_cache(ref))
    for ours in outs:
        assert mx.array_equal(ours, theirs).item()
