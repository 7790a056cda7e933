"""Every runtime option in one place: `load` keywords and run-moe flags."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# KV cache and activations are sized for this many tokens unless told otherwise.
DEFAULT_CONTEXT = 4096
DTYPES = ("auto", "float32", "float16", "bfloat16")
PREFETCH_READS = ("hint", "threads")
ENGINES = ("python", "native")
# (field, lowest, highest) of the numeric options.
BOUNDS = (
    ("context", 1, float("inf")),
    ("prefetch_extra", 0, float("inf")),
    ("split_min_bytes", 0, float("inf")),
    ("speculate_above", 0.0, 1.0),
    ("clean_decay", 0.0, 1.0),
    ("lrfu_decay", 0.0, 1.0),
)


@dataclass(frozen=True)
class RuntimeConfig:
    """How a converted model runs.

    memory_budget: bytes (or "8G") for the whole process: dense weights, expert
        slots, KV cache and activations for `context` tokens. Default: 80 % of RAM.
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
    record_trace: keep one event per MoE layer call in the stats (benchmarks).
    split_min_bytes: a decode call with misses splits its rows (hits first,
        misses after their reads) only when the misses are this large.
    speculate_above: a layer speculates while this decayed share of its decode
        calls missed nothing; clean_decay: that share's decay per call.
    lrfu_decay: the `lrfu` policy's decay of every use count per token.
    engine: "python" runs the reference path (one host sync per MoE layer);
        "native" resolves slots and reads misses inside MLX's stream (the
        compiled extension, CPU and CUDA), so decode never syncs per layer.
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
    # Smaller reads cost less than the split's extra calls (trained fixture,
    # 27 KB records: 0.60x resident split vs 0.72x whole at 25 %).
    split_min_bytes: int = 256 << 10
    # A speculative call that misses computes the missed rows twice.
    speculate_above: float = 0.8
    clean_decay: float = 0.9
    # A half-life of ~34 tokens: best of those replayed on the trained fixture.
    lrfu_decay: float = 0.98
    engine: str = "python"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"Unknown dtype {self.dtype}; use one of {', '.join(DTYPES)}."
            )
        if self.prefetch_reads not in PREFETCH_READS:
            raise ValueError(
                f"Unknown prefetch_reads {self.prefetch_reads!r}; use hint or threads."
            )
        from .pool import POLICIES  # pool reads this class's defaults

        if self.policy not in POLICIES:
            raise ValueError(
                f"Unknown cache policy {self.policy!r}; use one of "
                f"{', '.join(POLICIES)}."
            )
        if self.engine not in ENGINES:
            raise ValueError(
                f"Unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}."
            )
        for name, low, high in BOUNDS:
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")

    @property
    def rows_whole(self) -> bool:
        """`whole_calls`, with its default resolved for the current device."""
        if self.whole_calls is None:
            return mx.default_device() != mx.cpu
        return self.whole_calls

    @property
    def spare_slot(self) -> bool:
        return self.speculate or self.rows_whole
