"""Every runtime option in one place: `load` keywords and run-moe flags."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# KV cache and activations are sized for this many tokens unless told otherwise.
DEFAULT_CONTEXT = 4096
DTYPES = ("auto", "float32", "float16", "bfloat16")
ENGINES = ("python", "native")
# Cache policies; runtime/pool.py implements each.
POLICIES = ("lrfu", "lru")
# (field, lowest, highest) of the numeric options.
BOUNDS = (
    ("context", 1, float("inf")),
    ("prefetch_extra", 0, float("inf")),
    ("lrfu_decay", 0.0, 1.0),
    ("readers", 1, 256),
    ("kernel_threads", 0, 256),
)


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
        trained routing, see README) or "lru" (the baseline replays compare to).
    prefetch: the native engine predicts the next layer's experts with its
        router applied to this layer's input and reads the missing ones ahead
        (into the host tier, else as kernel readahead; on a GPU with
        device_resolve, the resolving kernel posts them to the host tier's
        readers). None: on with the native engine, unless the host tier holds
        every record (read at load, so nothing is left to read ahead) or it
        is a GPU's with device_resolve and direct_io off (buffered, its reads
        ahead gained with the blobs in the page cache and lost beyond RAM;
        direct, they gained: docs/gpu.md). The python engine measured slower
        with it, warm and cold (docs/performance.md), and has none.
    prefetch_extra: predict this many experts beyond the router's top-k: more
        recall for some wasted reads.
    whole_calls: a prefill that routes to more experts than slots runs each
        group as the resident model's whole call, with other pairs sent to a
        zero slot past the pool (one more slot per layer), instead of
        computing each group's rows alone. Default: on a GPU, whose gather
        kernels choose their algorithm by the rows of a call.
    record_trace: keep one event per MoE layer call in the stats (benchmarks).
    lrfu_decay: the `lrfu` policy's decay of every use count per token.
    engine: "native" (slots resolved and misses read inside MLX's stream by the
        compiled extension, CPU and CUDA; no host sync per MoE layer), the
        default wherever it is built and can run (a CPU; a GPU if built with
        CUDA), or "python" (the bit-exact reference path, one host sync per
        MoE layer; the default elsewhere: macOS compiles nothing).
    host_budget: bytes (or "32G") of host memory for the native engine's
        host tier of expert records, between the blob and the slots; outside
        `memory_budget`. Its reader threads read a call's misses in parallel,
        and the next layer's predicted experts ahead of its router. On a GPU
        the tier is always there (pinned memory that the slot copies read over
        the bus); default: every record if that fits in half the memory
        available at load, else that half. On a CPU: none unless given (the
        page cache is the host tier there).
    readers: reader threads (shared by every loaded model) of the host tier
        and of record reads: one record's read is split into pieces over them.
    direct_io: the native engine reads expert records with O_DIRECT (Linux),
        past the page cache, into block-aligned buffers (the staging record,
        host tier records rounded up to 4 KiB). Use it for a model several
        times larger than the RAM left to it, with routing that misses: there
        the page cache holds little of the experts and its readahead reads
        records nobody asked for (docs/beyond-ram.md). Off (default) where
        the page cache holds a real share of the blobs (in RAM, or a model up
        to about twice the RAM left): its hits are free and direct reads lose
        there. Without a host tier it also
        drops the prediction's kernel readahead (it would fill a page cache
        nothing reads). On a GPU it also turns on reading ahead into the host
        tier (prefetch), which gained beyond host RAM, cold (docs/gpu.md).
        A filesystem that refuses O_DIRECT is an error at load.
    device_resolve: the native engine on a GPU: a kernel resolves each
        call's slots and host tier records from the device's copies of the
        slot table and the tier's table, so the CUDA stream waits on the host
        only for records the tier lacks (posted to a host thread that has
        them read) or still being read ahead. False: a host function in the
        stream resolves every call (the reference path).
    concurrency: sequences decoded at once (a server's batch): the KV cache and
        activations are sized for that many, and each layer needs at least
        min(experts, concurrency x top-k) slots, as a batch's decode step routes
        to up to that many experts.
    cpu_kernel: on a CPU, compute the routed experts of a call (SwitchGLU with
        SwiGLU, affine-quantized, float32) and the dense quantized matmuls
        (attention, router, lm_head) with the extension's kernel: MLX's own
        arithmetic bit for bit, output rows in vector lanes, over
        `kernel_threads` threads (docs/profile-cpu.md).
        None (default): on with the native engine, where a check at first use
        finds it equal to this MLX's ops; True: on (with either engine), or
        an error where it is not exact; False: MLX's ops (the reference path).
        Layers it does not cover (other activations, biases, other dtypes)
        run MLX's ops.
    kernel_threads: threads of the CPU kernel; 0 uses every core.
    mapped: on a CPU, the native engine maps each blob read-only and the CPU
        kernel computes every routed expert where its record lies in the page
        cache, copying nothing into slots (the page cache is then the expert
        cache, as llama.cpp's mmap makes it; memory_budget covers the rest).
        A call's absent records are read at once, in pieces over `readers`
        threads, while the kernel computes the call's experts already in
        memory, and the prediction reads ahead as with slots; each record's
        checksum is checked the first time it is routed. Needs the CPU kernel
        (float32, SwiGLU experts). None (default): on where a CPU's default
        slots cannot hold every expert (no memory_budget, cache_experts,
        host_budget or direct_io given) and the kernel covers every layer;
        docs/beyond-ram.md measures it against slots.
    """

    memory_budget: int | str | None = None
    cache_experts: int | None = None
    dtype: str = "auto"
    verify: bool = True
    context: int = DEFAULT_CONTEXT
    policy: str = "lrfu"
    prefetch: bool | None = None
    prefetch_extra: int = 2
    whole_calls: bool | None = None
    record_trace: bool = False
    # A half-life of ~34 tokens: best of those replayed on the trained fixture.
    lrfu_decay: float = 0.98
    engine: str | None = None
    host_budget: int | str | None = None
    readers: int = 8
    concurrency: int = 1
    device_resolve: bool = True
    direct_io: bool = False
    cpu_kernel: bool | None = None
    kernel_threads: int = 0
    mapped: bool | None = None

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
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(
                f"Unknown engine {self.engine!r}; use one of {', '.join(ENGINES)}."
            )
        if self.policy not in POLICIES:
            raise ValueError(
                f"Unknown cache policy {self.policy!r}; use one of "
                f"{', '.join(POLICIES)}."
            )
        if self.prefetch and self.engine_used == "python":
            raise ValueError(
                "The python engine does not prefetch (it measured slower with it); "
                "use engine='native' or leave prefetch unset."
            )
        if self.host_budget is not None and self.engine_used == "python":
            raise ValueError(
                "The host tier belongs to the native engine; use engine='native' "
                "or leave host_budget unset."
            )
        if self.direct_io and self.engine_used == "python":
            raise ValueError(
                "The python engine reads through the page cache; direct_io "
                "belongs to the native engine: use engine='native' or leave "
                "direct_io off."
            )
        if self.mapped:
            self._check_mapped()
        for name, low, high in BOUNDS:
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")

    def _check_mapped(self) -> None:
        """`mapped` with what it has no use for: one line each."""
        clashes = [
            (self.engine_used == "python", "engine='python' (it copies into slots)"),
            (self.cpu_kernel is False, "cpu_kernel=False (the kernel reads the map)"),
            (self.cache_experts is not None, "cache_experts (it has no slots)"),
            (self.host_budget is not None, "host_budget (the page cache is its tier)"),
            (self.direct_io, "direct_io (it reads through the page cache)"),
        ]
        for clash, what in clashes:
            if clash:
                raise ValueError(f"mapped cannot run with {what}; leave one unset.")

    @property
    def rows_whole(self) -> bool:
        """`whole_calls`, with its default resolved for the current device."""
        if self.whole_calls is None:
            return mx.default_device() != mx.cpu
        return self.whole_calls

    @property
    def engine_used(self) -> str:
        """`engine`, with its default resolved for the current device."""
        if self.engine is not None:
            return self.engine
        from . import native  # imports the extension, which needs mlx.core first

        gpu = mx.default_device() != mx.cpu
        runs = native.cuda_available() if gpu else native.available()
        return "native" if runs else "python"

    @property
    def prefetches(self) -> bool:
        """`prefetch`, with its default resolved for the engine."""
        return self.engine_used == "native" if self.prefetch is None else self.prefetch

    @property
    def spare_slot(self) -> bool:
        return self.rows_whole
