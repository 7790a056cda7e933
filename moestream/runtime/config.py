"""Every runtime option in one place: `load` keywords and run-moe flags."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .pool import POLICIES

# KV cache and activations are sized for this many tokens unless told otherwise.
DEFAULT_CONTEXT = 4096
DTYPES = ("auto", "float32", "float16", "bfloat16")
PREFETCH_READS = ("hint", "threads")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a converted model runs.

    memory_budget: bytes (or "8G") for the whole process: dense weights, expert
        slots, KV cache and activations for `context` tokens. Default: what a
        slot for every expert needs, if that fits in 80 % of the memory
        available at load (free plus reclaimable); else that 80 %.
        Under a budget, MLX's cache of freed buffers and glibc's mmap
        threshold are bounded so freed memory does not pile up (process-wide).
    cache_experts: resident expert slots per MoE layer, instead of as many as
        the budget allows; with a budget too, checked to fit it.
    dtype: compute dtype; "auto" is float32 on a CPU, the stored dtype on a GPU.
    verify: check each expert record's checksum the first time it is read.
    context: tokens (prompt + generation) the KV cache and activations are sized for.
    policy: which resident expert to evict: "lrfu" (decayed use count; best on
        trained routing, see README), "lfuda" or "lru".
    prefetch: predict the next layer's experts with its router applied to this
        layer's input and start reading the missing ones in the background.
    prefetch_extra: predict this many experts beyond the router's top-k: more
        recall for some wasted reads (the disk is idle most of a token). Cold
        decode at 12.5 % on the small synthetic model: 0.85x resident with 0,
        0.95x with 2, 0.86x with 4.
    prefetch_reads: how predicted records are read ahead: "hint" asks the
        kernel (`posix_fadvise(WILLNEED)`, into the page cache); "threads" reads
        them with two reader threads into a ring of 2 x (top-k + extra) record
        buffers, copied into slots when routed. Measured in the README.
    speculate: start each decode layer's experts on the slots resident now,
        before the host has read the routing; missing experts meanwhile point
        to a zero slot (one more slot per layer). After the one host sync,
        misses are read and their rows computed and spliced in (or, with
        `whole_calls`, the call is run again). Removes the host sync from the
        critical path of every layer that misses nothing.
    whole_calls: never split a call's rows across expert calls: a prefill that
        routes to more experts than slots runs each group as the resident
        model's whole call with other pairs sent to the zero slot, and a
        speculative call with misses is run again whole. Default: on a GPU,
        whose gather kernels choose their algorithm by the rows of a call.
    record_trace: keep every routed expert id in the stats (benchmarks).
    concurrency: sequences decoded at once (a server's batch): the KV cache and
        activations are sized for that many, and each layer needs at least
        min(experts, concurrency x top-k) slots, as a batch's decode step routes
        to up to that many experts.
    """

    memory_budget: int | str | None = None
    cache_experts: int | None = None
    dtype: str = "auto"
    verify: bool = True
    context: int = DEFAULT_CONTEXT
    policy: str = "lrfu"
    prefetch: bool = True
    prefetch_extra: int = 2
    prefetch_reads: str = "hint"
    speculate: bool = True
    whole_calls: bool | None = None
    record_trace: bool = False
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise ValueError(
                f"concurrency must be a whole number of sequences, at least 1; "
                f"got {self.concurrency!r}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"Unknown dtype {self.dtype}; use one of {', '.join(DTYPES)}."
            )
        if self.prefetch_reads not in PREFETCH_READS:
            raise ValueError(
                f"Unknown prefetch_reads {self.prefetch_reads!r}; use hint or threads."
            )
        if self.policy not in POLICIES:
            raise ValueError(
                f"Unknown cache policy {self.policy!r}; use one of "
                f"{', '.join(POLICIES)}."
            )

    @property
    def rows_whole(self) -> bool:
        """`whole_calls`, with its default resolved for the current device."""
        if self.whole_calls is None:
            return mx.default_device() != mx.cpu
        return self.whole_calls

    @property
    def spare_slot(self) -> bool:
        return self.speculate or self.rows_whole
