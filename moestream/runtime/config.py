"""How a converted model runs: the user's settings, and the developer's knobs.

`RuntimeConfig` holds what a user chooses (run-moe's, serve's and chat's
engine flags are generated from its fields); `Tuning` holds what the bench
and the tests set (`moestream bench --set readers=2`). Neither resolves a
default against the machine: `runtime.backend.resolve` does that once, at
load, and names the backend that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

# KV cache and activations are sized for this many tokens unless told otherwise.
DEFAULT_CONTEXT = 4096
DTYPES = ("auto", "float32", "float16", "bfloat16")
# What a user may ask for; the plan turns "auto" into the backend that runs.
BACKENDS = ("auto", "slots", "mapped")
# "exact": mlx-lm's kernels; "fast": prefill-sized expert calls on dequantized
# weights (runtime/fast.py).
ARITHMETICS = ("exact", "fast")
ENGINES = ("python", "native")
# Cache policies; runtime/pool.py and csrc's policy implement each.
POLICIES = ("lrfu", "lru")
# The fast arithmetic dequantizes every expert of a call's slots: worth it from
# about 14 rows per expert on the H200 at the medium bench model's geometry
# (scripts/gpu_fast.py: 1.46x the exact call's time at 8, 0.51x at 32).
FAST_ROWS_PER_EXPERT = 16
# (field, lowest, highest) of the numeric knobs.
BOUNDS = (
    ("prefetch_extra", 0, float("inf")),
    ("lrfu_decay", 0.0, 1.0),
    ("readers", 1, 256),
    ("kernel_threads", 0, 256),
    ("kernel_spin_us", 0, 100_000),
    ("fast_rows", 1, float("inf")),
)


@dataclass(frozen=True)
class Tuning:
    """Developer knobs: reference paths and tuning, reached by tests and the bench.

    engine: "native" (the extension) or "python" (the reference path);
        None: native wherever it is built and can run.
    cpu_kernel: False runs MLX's ops instead of the exact CPU kernel (the
        reference); True fails where the kernel is not exact; None: the kernel
        where a first-use check finds it equal to this MLX.
    device_resolve: False resolves a GPU call in a host function (the
        reference) instead of a device kernel.
    policy: which resident expert to evict ("lrfu" or "lru").
    lrfu_decay: the lrfu policy's decay of every use count per token.
    prefetch: the native engine's next-layer prediction and read-ahead on a
        CPU; off unless True (it measured slower: docs/options.md).
    prefetch_extra: experts predicted beyond the router's top-k.
    readers: reader threads of the host tier and of piecewise record reads.
    kernel_threads: threads of the CPU kernel; 0 uses every core.
    kernel_spin_us: how long the CPU kernel's idle threads wait awake before
        they sleep (a decode step's calls come microseconds apart, and a
        sleeping core is slow to wake); 0: they sleep at once.
    record_trace: keep one event per MoE layer call in the stats.
    fast_rows: with the fast arithmetic, the fewest (token, expert) pairs per
        expert of the layer that a call computes fast (fewer: exact).
    """

    engine: str | None = None
    cpu_kernel: bool | None = None
    device_resolve: bool = True
    policy: str = "lrfu"
    # A half-life of ~34 tokens: best of those replayed on the trained fixture.
    lrfu_decay: float = 0.98
    prefetch: bool | None = None
    prefetch_extra: int = 2
    readers: int = 8
    kernel_threads: int = 0
    # Measured in docs/profile-cpu.md (the pool).
    kernel_spin_us: int = 50
    record_trace: bool = False
    fast_rows: int = FAST_ROWS_PER_EXPERT

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(
                f"Unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}."
            )
        if self.policy not in POLICIES:
            raise ValueError(
                f"Unknown cache policy {self.policy!r}; use one of "
                f"{', '.join(POLICIES)}."
            )
        for name, low, high in BOUNDS:
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a converted model runs.

    memory_budget: bytes (or "8G") for the whole process: dense weights, expert
        slots, KV cache and activations for `context` tokens. Default: a slot
        for every expert if that fits in 80 % of the memory available at load;
        else that 80 %.
    cache_experts: resident expert slots per MoE layer, instead of as many as
        the budget allows; with a budget too, checked to fit it.
    host_budget: on a GPU, bytes (or "32G") of pinned host memory for expert
        records between the disk and its slots; outside `memory_budget`.
        Default: every record if that fits in half the memory available at
        load. A CPU has no host tier (the page cache is one): leave it unset.
    dtype: compute dtype; "auto" is float32 on a CPU, the stored dtype on a GPU.
    verify: check each expert record's checksum the first time it is read.
    context: tokens (prompt + generation) the KV cache and activations are sized for.
    concurrency: sequences decoded at once (a server's batch): the KV cache and
        activations are sized for that many, and each layer needs at least
        min(experts, concurrency x top-k) slots.
    backend: "slots" (experts copied into resident slots), "mapped" (on a CPU,
        experts computed in place from the page cache, as llama.cpp's mmap) or
        "auto" (mapped where a CPU's slots cannot hold every expert).
    arithmetic: "exact" (mlx-lm's kernels: the resident model's bits) or "fast"
        (prefill-sized expert calls on dequantized weights with tensor-core
        GEMMs; not mlx-lm's kernels, so its bits are not promised:
        `moestream eval` reports how far they are).
    """

    memory_budget: int | str | None = None
    cache_experts: int | None = None
    host_budget: int | str | None = None
    dtype: str = "auto"
    verify: bool = True
    context: int = DEFAULT_CONTEXT
    concurrency: int = 1
    backend: str = "auto"
    arithmetic: str = "exact"
    # Not a user setting: the developer's knobs (tests, the bench); a dict of
    # Tuning's fields (a command's --set, a bench job's JSON) becomes one.
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        if isinstance(self.tuning, dict):
            object.__setattr__(self, "tuning", Tuning(**self.tuning))
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise ValueError(
                f"concurrency must be a whole number of sequences, at least 1; "
                f"got {self.concurrency!r}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"Unknown dtype {self.dtype}; use one of {', '.join(DTYPES)}."
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"Unknown backend {self.backend!r}; use one of {', '.join(BACKENDS)}."
            )
        if self.arithmetic not in ARITHMETICS:
            raise ValueError(
                f"Unknown arithmetic {self.arithmetic!r}; use one of "
                f"{', '.join(ARITHMETICS)}."
            )
        if not self.context >= 1:
            raise ValueError(f"context must be at least 1 token, got {self.context}.")
        if self.backend == "mapped":
            self._check_mapped()

    def _check_mapped(self) -> None:
        """`mapped` with what it has no use for: one line each."""
        t = self.tuning
        clashes = [
            (t.engine == "python", "engine='python' (it copies into slots)"),
            (t.cpu_kernel is False, "cpu_kernel=False (the kernel reads the map)"),
            (self.cache_experts is not None, "cache_experts (it has no slots)"),
            (self.host_budget is not None, "host_budget (the page cache is its tier)"),
            (self.arithmetic == "fast", "arithmetic='fast' (it computes on slots)"),
        ]
        for clash, what in clashes:
            if clash:
                raise ValueError(f"mapped cannot run with {what}; leave one unset.")

    def with_options(self, **options: Any) -> RuntimeConfig:
        """A copy with `options` set, each a field of RuntimeConfig or of Tuning."""
        tuning = {k: options.pop(k) for k in list(options) if k in TUNING_FIELDS}
        unknown = set(options) - set(USER_FIELDS) - {"tuning"}
        if unknown:
            raise TypeError(
                f"Unknown runtime option {', '.join(sorted(unknown))}; use one of "
                f"{', '.join(USER_FIELDS + TUNING_FIELDS)}."
            )
        base = options.pop("tuning", self.tuning)
        return replace(self, **options, tuning=replace(base, **tuning))


USER_FIELDS = tuple(f.name for f in fields(RuntimeConfig) if f.name != "tuning")
TUNING_FIELDS = tuple(f.name for f in fields(Tuning))


def config_from(**options: Any) -> RuntimeConfig:
    """RuntimeConfig() with `options` set, user fields and Tuning's alike."""
    return RuntimeConfig().with_options(**options)
