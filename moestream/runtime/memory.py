"""The memory plan: how a budget splits between the process, the dense
weights, the KV cache, activations, staging, a reserve and the expert slots
(and, with the fast arithmetic, one layer's slots dequantized).

Everything here is arithmetic on the manifest and the model's config, so
`plan`, `run-moe`, `serve` and the bench size memory with the same numbers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import mlx.core as mx

from ..families import get_family
from ..formats import BLOCK_ROWS, ExpertLayer, Manifest, Segment
from ..units import count, human_bytes, peak_rss

# mlx-lm's generate_step prefills in chunks of this many tokens.
PREFILL_STEP = 2048
# Kept free under a budget for malloc slack and fragmentation that no allocator
# counter sees (measured: peak RSS ran 1-5 % over MLX's own peak plus process).
RESERVE_BYTES = 32 << 20
RESERVE_FRACTION = 0.03
# The process's own size is measured and rounded up to a multiple of
# PROCESS_STEP, at least PROCESS_FLOOR: the few MB it moves between runs, and
# between `plan` and `run-moe` (measured 83-89 MB on a CPU), move no slot.
PROCESS_STEP = 32 << 20
PROCESS_FLOOR = 128 << 20
# Host staging records, each the size of the largest record: a call's misses
# are read through this many at once (csrc/record_reader.h kStagingRecords).
# A prefill past the CPU slots maps one record per kernel thread instead
# (csrc/cpu_experts.cpp run_in_place): the plan counts the larger.
STAGING_RECORDS = 2


class BudgetError(ValueError):
    """A memory budget the model cannot run in."""


@dataclass(frozen=True)
class MemoryPlan:
    """How `--memory-budget` splits; every figure in bytes."""

    budget: int | None
    process: int
    dense: int
    kv_cache: int
    activations: int
    staging: int  # records being read and widened (STAGING_RECORDS)
    reserve: int  # allocator slack and fragmentation outside MLX's accounting
    slot_bytes: int  # one slot in every MoE layer
    capacity: int
    num_experts: int
    concurrency: int = 1  # sequences the KV cache and activations are sized for
    # The native engine's host tier (RuntimeConfig.host_budget): records of
    # `host_record` bytes in host memory (pinned on a GPU), outside `budget`.
    host_records: int = 0
    host_record: int = 0
    host_budget: int | None = None
    host_pinned: bool = False
    mapped: bool = False  # the cpu-mapped backend: no slots (capacity 0)
    # Mapped under a budget: the records a layer keeps in the page tables
    # (csrc/mapped_window.h), `slot_bytes` each in every layer; 0: all.
    window: int = 0
    # The fast arithmetic (runtime/fast.py), per slot of the largest layer:
    # its projections' weights dequantized to the compute dtype, twice. A fast
    # call dequantizes its layer's slots, one layer and one projection at a
    # time, and the dequantize and gather_mm make temporaries of their own
    # (on a CPU, one more copy of a projection's weights, transposed; what
    # they measured: docs/memory-budget.md). `fast_scratch`.
    dequant_slot: int = 0
    # The attention scores' part of `activations` (`[heads, L, S]` float32 of
    # a prefill chunk): MLX's attention writes them; the CPU kernel's exact
    # attention does not, and the loader lets MLX's cache use that room.
    scores: int = 0

    @property
    def host_tier(self) -> int:
        return self.host_records * self.host_record

    @property
    def pools(self) -> int:
        return self.slot_bytes * (self.window if self.mapped else self.capacity)

    @property
    def fast_scratch(self) -> int:
        """The fast arithmetic's dequantized weights: one layer's slots, twice."""
        return self.dequant_slot * self.capacity

    @property
    def per_slot(self) -> int:
        """What one more slot in every layer adds to the total."""
        return self.slot_bytes + self.dequant_slot

    def total_with(self, capacity: int) -> int:
        """The total with `capacity` slots in every layer instead."""
        return self.total + (capacity - self.capacity) * self.per_slot

    @property
    def total(self) -> int:
        fixed = self.process + self.dense + self.kv_cache + self.activations
        return fixed + self.staging + self.reserve + self.pools + self.fast_scratch

    def describe(self) -> str:
        h = human_bytes
        seqs = f" ({self.concurrency} sequences)" if self.concurrency > 1 else ""
        return (
            f"memory plan: process {h(self.process)} + dense {h(self.dense)} + KV "
            f"{h(self.kv_cache)}{seqs} + activations {h(self.activations)} + staging "
            f"{h(self.staging)} + reserve {h(self.reserve)} + experts "
            + (
                f"{h(self.pools)} mapped ({self.window}/{self.num_experts} per layer)"
                if self.window
                else "mapped (the page cache holds them)"
                if self.mapped
                else f"{h(self.pools)} ({self.capacity}/{self.num_experts} per layer)"
            )
            + (
                f" + fast dequantized {h(self.fast_scratch)}"
                if self.fast_scratch
                else ""
            )
            + f" = {h(self.total)}"
            + (f" of {h(self.budget)}" if self.budget else "")
            + self.describe_host()
        )

    def describe_host(self) -> str:
        if not self.host_records:
            return ""
        kind = "pinned " if self.host_pinned else ""
        bound = f" of {human_bytes(self.host_budget)}" if self.host_budget else ""
        return (
            f"; host tier {human_bytes(self.host_tier)}{bound} ({kind}host memory, "
            f"{self.host_records} records of {human_bytes(self.host_record)})"
        )


def _budget_holding(unreserved: int, growth: float = 0.0) -> int:
    """The smallest budget whose reserve and remainder hold `unreserved` bytes."""
    need = (1 + growth) * (unreserved + RESERVE_BYTES)
    budget = math.ceil(need / (1 - RESERVE_FRACTION))
    while budget - reserve_for(budget) < (1 + growth) * unreserved:  # rounding
        budget += 1
    while budget - 1 - reserve_for(budget - 1) >= (1 + growth) * unreserved:
        budget -= 1
    return budget


def mapped_window(plan: MemoryPlan, config: dict) -> int:
    """The records each layer of a mapped plan keeps mapped under its budget
    (`slot_bytes` one in every layer): what the budget holds past the rest,
    at least a decode step's experts."""
    budget = plan.budget or 0
    window = min(plan.num_experts, (budget - plan.total) // plan.slot_bytes)
    least = min(plan.num_experts, plan.concurrency * get_family(config).top_k(config))
    if window < least:
        more = human_bytes(plan.total + least * plan.slot_bytes, up=True)
        raise BudgetError(
            f"--memory-budget {human_bytes(budget)} keeps "
            f"{count(window, 'expert record')} a layer mapped, fewer than the "
            f"{least} a decode step routes to; give --memory-budget {more} or "
            "more, or no budget (the page cache holds the experts)."
        )
    return window


def reserve_for(budget: int | None) -> int:
    """The reserve a budget keeps: RESERVE_BYTES + RESERVE_FRACTION of it."""
    return RESERVE_BYTES + int(RESERVE_FRACTION * (budget or 0))


def least_budget(plan: MemoryPlan, capacity: int) -> int:
    """The smallest --memory-budget that holds `plan` with `capacity` slots per
    layer, the reserve's share of that budget included."""
    return _budget_holding(plan.total_with(capacity) - plan.reserve)


def _text_config(config: dict) -> dict:
    """Vision-language checkpoints (qwen3_5_moe) keep the text model's sizes apart."""
    return {**config, **config.get("text_config", {})}


def plan_memory(
    manifest: Manifest,
    config: dict,
    dense: int,
    compute: mx.Dtype,
    process: int,
    context: int,
    budget: int | None,
    cache_experts: int | None,
    concurrency: int = 1,
    fast: bool = False,
    blocked: bool = False,
    staging_records: int = STAGING_RECORDS,
) -> MemoryPlan:
    """Split `budget`; `concurrency` sequences decode at once, and each layer
    needs a slot for every expert one step of theirs can route to; `fast`:
    the fast arithmetic's dequantized slots are counted too; `blocked`: the
    CPU kernel's blocked slots, which keep stored scales and biases;
    `staging_records`: records read or mapped in at once."""
    top_k = get_family(config).top_k(config)
    config = _text_config(config)
    num_experts = max((x.num_experts for x in manifest.layers), default=0)
    least = min(num_experts, concurrency * top_k)
    slot = sum(_slot_nbytes(layer, compute, blocked) for layer in manifest.layers)
    kv = concurrency * _kv_bytes(config, context, compute)
    act = concurrency * _activation_bytes(config, context, top_k)
    staging = staging_records * max(
        (x.record_nbytes for x in manifest.layers), default=0
    )
    dequant = max((_dequant_nbytes(x, compute) for x in manifest.layers), default=0)
    dequant = dequant if fast else 0
    if cache_experts is None and budget is None:
        fixed = process + dense + kv + act + staging
        budget = default_budget(fixed + num_experts * (slot + dequant), process)
    reserve = reserve_for(budget)
    plan = MemoryPlan(
        budget, process, dense, kv, act, staging, reserve, slot,
        capacity=num_experts, num_experts=num_experts, concurrency=concurrency,
        dequant_slot=dequant, scores=concurrency * _score_bytes(config, context),
    )  # fmt: skip
    if cache_experts is not None:
        capacity = _capacity_given(plan, cache_experts, least)
    else:
        capacity = _capacity_fitting(plan, least)
    return replace(plan, capacity=capacity)


def _capacity_given(plan: MemoryPlan, cache_experts: int, least: int) -> int:
    """--cache-experts, checked against the budget and the concurrency."""
    if not cache_experts >= 1:
        raise BudgetError(f"--cache-experts must be at least 1, got {cache_experts}.")
    capacity = min(cache_experts, plan.num_experts)
    if plan.concurrency > 1 and capacity < least:
        raise BudgetError(
            f"{plan.concurrency} sequences decoded at once route to up to {least} "
            f"experts per layer, more than {count(capacity, 'slot')}; give "
            f"--cache-experts {least} or more, or decode fewer at once."
        )
    need = plan.total_with(capacity)
    if plan.budget is not None and need > plan.budget:
        least = human_bytes(least_budget(plan, capacity), up=True)
        raise BudgetError(
            f"{count(capacity, 'expert slot')} per layer need {human_bytes(need)} "
            f"in all, more than --memory-budget {human_bytes(plan.budget)}; give "
            f"--memory-budget {least} or more, or fewer --cache-experts."
        )
    return capacity


def _capacity_fitting(plan: MemoryPlan, least: int) -> int:
    """The slots per layer that the budget leaves room for, at least `least`."""
    budget, slot = plan.budget or 0, plan.per_slot
    fixed = plan.total_with(0)
    capacity = min(plan.num_experts, max(budget - fixed, 0) // max(slot, 1))
    if capacity < least:
        seqs = f" for {plan.concurrency} sequences" if plan.concurrency > 1 else ""
        fixed -= plan.reserve
        suggest = human_bytes(least_budget(plan, least), up=True)
        raise BudgetError(
            f"Memory budget {human_bytes(budget)} is too small: process, dense "
            f"weights, KV cache and activations{seqs} need {human_bytes(fixed)}, "
            f"{count(least, 'expert slot')} per layer {human_bytes(least * slot)}, "
            f"and the reserve {human_bytes(RESERVE_BYTES)} + "
            f"{RESERVE_FRACTION:.0%} of the budget; give --memory-budget "
            f"{suggest} or more."
        )
    return capacity


def blocks_rows(layer: ExpertLayer) -> bool:
    """Whether every segment of `layer` is 2-D with whole blocks of rows: its
    slots can be blocked (where the CPU kernel computes every call)."""
    segments = layer.segments
    return all(len(s.shape) == 2 and s.shape[0] % BLOCK_ROWS == 0 for s in segments)


def kept_as_stored(layer: ExpertLayer, seg: Segment) -> bool:
    """Whether blocked slots keep `seg` as its records store it: a projection's
    scales and biases, both bfloat16 or both float16 (the kernel widens them
    as it reads, exactly, as it reads mapped records)."""
    projection, _, name = seg.name.rpartition(".")
    pair = {s.name: s.dtype for s in layer.segments if s.projection == projection}
    stored = {pair.get(f"{projection}.{n}") for n in ("scales", "biases")}
    return name in ("scales", "biases") and stored in ({"bfloat16"}, {"float16"})


def _slot_nbytes(layer: ExpertLayer, compute: mx.Dtype, blocked: bool = False) -> int:
    """One expert's slot bytes: floats in the compute dtype, except what
    blocked slots keep as stored (`blocked`: the CPU kernel's slots)."""
    float_size = compute.size
    blocked = blocked and blocks_rows(layer)
    return sum(
        s.nbytes
        if blocked and kept_as_stored(layer, s)
        else s.nbytes // 2 * float_size
        if s.dtype in ("bfloat16", "float16")
        else s.nbytes // 4 * float_size
        if s.dtype == "float32"
        else s.nbytes
        for s in layer.segments
    )


def _dequant_nbytes(layer: ExpertLayer, compute: mx.Dtype) -> int:
    """Twice one expert's projection weights dequantized to `compute` (what the
    fast arithmetic makes of a slot, and its temporaries): a quantized weight's
    uint32 words hold 32 / bits values each."""
    values = 0
    for s in layer.segments:
        if not s.name.endswith(".weight"):
            continue
        n = math.prod(s.shape)
        values += n * 32 // s.bits if s.dtype == "uint32" and s.bits else n
    return 2 * values * compute.size


def _kv_bytes(config: dict, context: int, compute: mx.Dtype) -> int:
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layers = config["num_hidden_layers"]
    steps = -(-context // 256) * 256  # mlx-lm's KVCache grows in 256-token steps
    return 2 * layers * kv_heads * head_dim * steps * compute.size


def _activation_bytes(config: dict, context: int, k: int) -> int:
    """Transient memory of a prefill chunk, in float32: attention scores, the
    routed rows (`k` per token) of the MoE, a few hidden-size buffers, and the
    logits."""
    tokens = min(PREFILL_STEP, context)
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size", 0)
    inter = max(inter) if isinstance(inter, list) else inter  # hunyuan: per layer
    hidden = config["hidden_size"]
    per_token = k * (3 * inter + hidden) + 8 * hidden
    scores = _score_bytes(config, context)
    return scores + 4 * (tokens * per_token + 2 * config.get("vocab_size", 0))


def _score_bytes(config: dict, context: int) -> int:
    """A prefill chunk's attention scores, `[heads, tokens, tokens]` float32
    (the chunk's keys at most its own length: the plan's estimate)."""
    tokens = min(PREFILL_STEP, context)
    return 4 * config.get("num_attention_heads", 1) * tokens * tokens


def default_budget(need_all: int, process: int) -> int:
    """The budget when none is given: what a slot for every expert needs
    (`need_all` bytes, plus the reserve), when that fits in 80 % of the memory
    this process may take now (its own plus what the system has available);
    else that 80 %, and the slots get what is left."""
    ceiling = int(0.8 * (process + available_memory()))
    return min(_budget_holding(need_all), ceiling)


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Memory the system can give now without swapping (Linux MemAvailable:
    free plus reclaimable page cache); physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _physical_memory()


def _process_bytes() -> int:
    """This process's size for the plan (interpreter, libraries, tokenizer):
    its resident memory now, rounded up to PROCESS_STEP, at least PROCESS_FLOOR."""
    return max(PROCESS_FLOOR, -(-_resident_bytes() // PROCESS_STEP) * PROCESS_STEP)


def _resident_bytes() -> int:
    """Resident memory of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak is the closest figure
        return peak_rss()
