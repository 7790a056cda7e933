"""The memory plan: how `--memory-budget` splits between the process, dense
weights, KV cache, activations, staging, a reserve and the expert slots."""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from ..families import get_family
from ..formats import ExpertLayer, Manifest
from ..units import human_bytes

# mlx-lm's generate_step prefills in chunks of this many tokens.
PREFILL_STEP = 2048
# Kept free under a budget for malloc slack and fragmentation that no allocator
# counter sees (measured: peak RSS ran 1-5 % over MLX's own peak plus process).
RESERVE_BYTES = 32 << 20
RESERVE_FRACTION = 0.03


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
    staging: int  # a record being widened, the spare slots
    reserve: int  # allocator slack and fragmentation outside MLX's accounting
    slot_bytes: int  # one slot in every MoE layer
    capacity: int
    num_experts: int

    @property
    def pools(self) -> int:
        return self.slot_bytes * self.capacity

    @property
    def total(self) -> int:
        fixed = self.process + self.dense + self.kv_cache + self.activations
        return fixed + self.staging + self.reserve + self.pools

    def describe(self) -> str:
        h = human_bytes
        return (
            f"memory plan: process {h(self.process)} + dense {h(self.dense)} + KV "
            f"{h(self.kv_cache)} + activations {h(self.activations)} + staging "
            f"{h(self.staging)} + reserve {h(self.reserve)} + experts "
            f"{h(self.pools)} ({self.capacity}/{self.num_experts} per layer) = "
            f"{h(self.total)}" + (f" of {h(self.budget)}" if self.budget else "")
        )


def plan_memory(
    manifest: Manifest,
    config: dict,
    dense: int,
    compute: mx.Dtype,
    process: int,
    context: int,
    budget: int | None,
    cache_experts: int | None,
    spare_slot: bool = False,
) -> MemoryPlan:
    top_k = get_family(config).top_k(config)
    config = _text_config(config)
    num_experts = max(layer.num_experts for layer in manifest.layers)
    slot = sum(_slot_nbytes(layer, compute) for layer in manifest.layers)
    kv = _kv_bytes(config, context, compute)
    act = _activation_bytes(config, context, top_k)
    staging = max(layer.record_nbytes for layer in manifest.layers)
    staging += slot if spare_slot else 0  # the spare zero slot of whole groups
    if cache_experts is None and budget is None:
        budget = int(0.8 * _physical_memory())
    reserve = RESERVE_BYTES + int(RESERVE_FRACTION * (budget or 0))
    plan = MemoryPlan(
        budget,
        process,
        dense,
        kv,
        act,
        staging,
        reserve,
        slot,
        num_experts,
        num_experts,
    )
    if cache_experts is not None:
        if not cache_experts >= 1:
            raise BudgetError(
                f"--cache-experts must be at least 1, got {cache_experts}."
            )
        capacity = min(cache_experts, num_experts)
        need = plan.total - plan.pools + capacity * slot
        if budget is not None and need > budget:
            raise BudgetError(
                f"{capacity} expert slots per layer need {human_bytes(need)} in all, "
                f"more than --memory-budget {human_bytes(budget)}; give fewer "
                "--cache-experts or a larger budget."
            )
    else:
        free = budget - (plan.total - plan.pools)
        capacity = min(num_experts, max(free, 0) // max(slot, 1))
        if capacity < top_k:
            fixed = plan.total - plan.pools
            raise BudgetError(
                f"Memory budget {human_bytes(budget)} is too small: process, dense "
                f"weights, KV cache and activations need {human_bytes(fixed)}, and "
                f"{top_k} expert slots per layer {human_bytes(top_k * slot)}; give "
                f"--memory-budget {human_bytes(fixed + top_k * slot, up=True)} or more."
            )
    return MemoryPlan(
        budget, process, dense, kv, act, staging, reserve, slot, capacity, num_experts
    )


def _slot_nbytes(layer: ExpertLayer, compute: mx.Dtype) -> int:
    float_size = compute.size
    return sum(
        s.nbytes // 2 * float_size
        if s.dtype in ("bfloat16", "float16")
        else s.nbytes // 4 * float_size
        if s.dtype == "float32"
        else s.nbytes
        for s in layer.segments
    )


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
    heads = config.get("num_attention_heads", 1)
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size", 0)
    inter = max(inter) if isinstance(inter, list) else inter  # hunyuan: per layer
    hidden = config["hidden_size"]
    per_token = heads * tokens + k * (3 * inter + hidden) + 8 * hidden
    return 4 * (tokens * per_token + 2 * config.get("vocab_size", 0))


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _text_config(config: dict) -> dict:
    """Vision-language checkpoints (qwen3_5_moe) keep the text model's sizes apart."""
    return {**config, **config.get("text_config", {})}
