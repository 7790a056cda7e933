"""The benchmark: streaming at several expert budgets vs mlx-lm fully resident.

Every run is a fresh process (`moestream.bench.worker`) so its peak memory is
its own; runs are interleaved across repeats and reported as medians, because
the machine is noisy. Decode runs use a short prompt; prefill is timed in
separate runs with the long prompt.
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..formats import BlobReader, load_manifest
from ..formats.manifest import inside
from ..runtime.config import RuntimeConfig
from .routes import check_trace, load_trace, prefetch_note
from .worker import Job

DECODE_PROMPT_TOKENS = 16
# RuntimeConfig fields each run sets itself (slots, budget, context, trace).
PER_RUN = {"cache_experts", "memory_budget", "context", "record_trace"}


@dataclass(frozen=True)
class BenchConfig:
    out: Path
    budgets: tuple[float, ...] = (100, 50, 25, 12.5, 10)  # % of expert bytes
    modes: tuple[str, ...] = ("warm", "cold")
    decode_tokens: int = 32
    prompt_tokens: int = 512  # prefill runs; 0 skips prefill
    repeats: int = 3
    prefill_repeats: int = 1
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    verify_cost: bool = True  # one extra row: 25 % cold without checksums
    reference: Path | None = None  # mlx-lm directory of the same weights
    # More streaming rows at each budget, side by side with `runtime`: a label
    # and the RuntimeConfig fields it changes, e.g. ("policy=lru", {...}).
    compare: tuple[tuple[str, dict], ...] = ()
    # A routing trace (.npz) every run's MoE blocks route by (routes.py).
    trace: Path | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ("warm", "cold")]
        if bad or not self.budgets or any(not 0 < b <= 100 for b in self.budgets):
            raise ValueError(
                "--budgets takes percentages in (0, 100] and --modes warm,cold."
            )
        for label, fields in self.compare:
            fixed = sorted(PER_RUN.intersection(fields))
            if fixed:
                raise ValueError(
                    f"--compare {label}: the bench sets {', '.join(fixed)} per run; "
                    "compare other fields."
                )
            self.runtime.with_options(**fields)  # validates each variant now
        if (
            self.trace
            and self.runtime.tuning.prefetch
            and not load_trace(self.trace).predicts
        ):
            raise ValueError(
                f"--trace {self.trace} forces routes the model's routers cannot "
                "predict and records no predictions (`ahead`): leave --prefetch "
                "unset (the bench turns it off)."
            )


@dataclass
class Row:
    name: str
    budget_pct: float | None
    mode: str
    job: Job
    variant: str = ""  # the `compare` label; "" for the base options
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)

    def median(self, key: str, runs: str = "decode") -> float:
        values = [r[key] for r in getattr(self, runs) if key in r]
        return statistics.median(values) if values else float("nan")


def capacity_for(pct: float, num_experts: int, top_k: int) -> int:
    """Slots per layer holding `pct` % of a layer's experts (at least top-k)."""
    return min(num_experts, max(top_k, round(pct / 100 * num_experts)))


def plan_rows(cfg: BenchConfig) -> list[Row]:
    manifest = load_manifest(cfg.out)
    config = json.loads((Path(cfg.out) / "config.json").read_text())
    experts = max(layer.num_experts for layer in manifest.layers)
    top_k = int(config.get("num_experts_per_tok", 1))
    if cfg.trace:  # fail here in one line, not in every worker
        runtimes = [
            cfg.runtime,
            *(cfg.runtime.with_options(**f) for _, f in cfg.compare),
        ]
        extras = [r.tuning.prefetch_extra for r in runtimes]
        check_trace(load_trace(cfg.trace), experts, top_k, extras)
    base = Job(
        out=str(cfg.out),
        capacity=None,
        prompt_tokens=DECODE_PROMPT_TOKENS,
        decode_tokens=cfg.decode_tokens,
        runtime=cfg.runtime,
        reference=str(cfg.reference) if cfg.reference else None,
        trace=str(cfg.trace) if cfg.trace else None,
    )
    rows = [Row("resident", None, "-", base)]
    variants = [("", cfg.runtime)]
    variants += [(label, cfg.runtime.with_options(**f)) for label, f in cfg.compare]
    for pct in cfg.budgets:
        cap = capacity_for(pct, experts, top_k)
        for mode in cfg.modes:
            for label, runtime in variants:
                job = replace(base, capacity=cap, cold=mode == "cold", runtime=runtime)
                name = f"{pct:g} %" + (f" {label}" if label else "")
                rows.append(Row(name, pct, mode, job, label))
    if cfg.verify_cost and "cold" in cfg.modes:
        cap = capacity_for(25, experts, top_k)
        job = replace(
            base, capacity=cap, cold=True, runtime=replace(cfg.runtime, verify=False)
        )
        rows.append(Row("25 % no-verify", 25, "cold", job))
    return rows


def run_job(job: Job) -> dict:
    # faulthandler: a worker killed by a signal writes its Python stack first
    argv = [sys.executable, "-X", "faulthandler", "-m", "moestream.bench.worker"]
    proc = subprocess.run(
        [*argv, json.dumps(asdict(job))], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(worker_failure(proc.returncode, proc.stderr))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_failure(code: int, stderr: str) -> str:
    """One line for a worker that failed: its last error line, or, where a
    signal killed it, the signal and the innermost Python frame faulthandler
    wrote."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if code >= 0:
        return f"benchmark run failed: {(lines or ['(no output)'])[-1]}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    frames = [line for line in lines if line.startswith("File ")]
    where = f" in {frames[0]}" if frames else ""
    return (
        f"benchmark run killed by {name}{where}: the worker crashed, no result; "
        "run the bench again"
    )


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = print) -> dict:
    rows = plan_rows(cfg)
    disk = disk_bandwidth(cfg.out)
    progress(
        f"disk under {cfg.out}: cold random reads {disk['qd1']:.2f} GB/s one at a "
        f"time, {disk['parallel']:.2f} GB/s in parallel"
    )
    for r in range(cfg.repeats):
        for row in rows:
            row.decode.append(run_job(row.job))
            progress(f"repeat {r + 1}/{cfg.repeats} {row.name} {row.mode}: decode ok")
    if cfg.prompt_tokens:
        for r in range(cfg.prefill_repeats):
            for row in rows:
                job = replace(row.job, prompt_tokens=cfg.prompt_tokens, decode_tokens=0)
                row.prefill.append(run_job(job))
                progress(f"prefill {r + 1}/{cfg.prefill_repeats} {row.name} {row.mode}")
    return summarize(cfg, rows, disk)


def summarize(cfg: BenchConfig, rows: list[Row], disk: dict) -> dict:
    ref = rows[0]
    out = []
    for row in rows:
        entry = _row_entry(row, ref)
        if row.job.capacity is not None:
            entry.update(_streaming_entry(cfg, row, ref, disk))
            entry["x_full"] = x_full(rows, row)
            # The host tier is host memory with its own bound (host_budget).
            host = max(r.get("host_tier") or 0 for r in row.decode + row.prefill)
            entry["peak_over_budget"] = entry["peak_rss"] / (entry["budget"] + host)
        out.append(entry)
    return {"config": _jsonable(asdict(cfg)), "disk_gbps": disk, "rows": out}


def x_full(rows: list[Row], row: Row) -> float | None:
    """Decode speed over the same variant and mode with every expert in a slot
    (the same kernels, nothing to read): a GPU's honest yardstick, where
    mlx-lm's resident model runs slower than our 100 % slots."""
    full = [
        r
        for r in rows
        if r.budget_pct == 100 and r.variant == row.variant and r.mode == row.mode
    ]
    if not full:
        return None
    return row.median("decode_tps") / full[0].median("decode_tps")


def _row_entry(row: Row, ref: Row) -> dict:
    """What every row reports: speed against the resident row, memory, tokens."""
    tps = row.median("decode_tps")
    runs = row.decode + row.prefill
    prefill = row.median("prefill_tps", "prefill")
    return {
        "row": row.name,
        "variant": row.variant,
        "mode": row.mode,
        "capacity": row.job.capacity,
        "decode_tps": tps,
        "decode_ratio": tps / ref.median("decode_tps"),
        # Per repeat, each over the same repeat's resident run: the spread.
        "decode_ratios": [
            r["decode_tps"] / ref.decode[i]["decode_tps"]
            for i, r in enumerate(row.decode)
        ],
        "prefill_tps": prefill,
        "prefill_ratio": prefill / ref.median("prefill_tps", "prefill"),
        "peak_rss": max(r["peak_rss"] for r in runs),
        "device_peak": max((r.get("device_peak") or 0 for r in runs), default=0)
        or None,
        "tokens_match": all(r["tokens"] == ref.decode[0]["tokens"] for r in row.decode),
    }


def _streaming_entry(cfg: BenchConfig, row: Row, ref: Row, disk: dict) -> dict:
    """A streaming row's cache, reads and roofline."""
    tps = row.median("decode_tps")
    bpt = row.median("bytes_per_token")
    bound = 1 / ref.median("decode_tps")
    if row.mode == "cold":
        bound = max(bound, bpt / (disk["parallel"] * 1e9))
    replay = [r["replay"] for r in row.decode]
    return {
        "hit_rate": row.median("hit_rate"),
        "host_hit_rate": row.median("host_hit_rate")
        if row.decode[0].get("host_tier")
        else None,
        "lru": statistics.median(r["lru"] for r in replay),
        "policy": statistics.median(r[row.job.runtime.tuning.policy] for r in replay),
        "belady": statistics.median(r["belady"] for r in replay),
        "mb_per_token": bpt / 1e6,
        "disk_mb_per_token": row.median("disk_bytes_per_token") / 1e6,
        "fill_mb_per_token": row.median("fill_bytes_per_token") / 1e6,
        "prefetch_recall": row.median("prefetch_recall"),
        "prefetch_precision": row.median("prefetch_precision"),
        "wasted_mb_per_token": row.median("prefetch_wasted_bytes")
        / 1e6
        / cfg.decode_tokens,
        "budget": max(r["budget"] for r in row.decode + row.prefill),
        "roofline_s": bound,
        "vs_roofline": (1 / tps) / bound,
    }


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def disk_bandwidth(out: Path, records: int = 48) -> dict[str, float]:
    """Cold random-read GB/s of whole expert records under `out`."""
    manifest = load_manifest(out)
    layer = max(manifest.layers, key=lambda x: x.num_experts * x.stride)
    rng = random.Random(0)
    result = {}
    with BlobReader(inside(Path(out), layer.file), layer) as blob:
        buf = memoryview(bytearray(layer.record_nbytes))
        for name in ("qd1", "parallel"):
            blob.drop_cache()
            experts = rng.sample(
                range(layer.num_experts), min(records, layer.num_experts)
            )
            start = time.perf_counter()
            if name == "parallel":
                for e in experts:  # as the runtime does: hint all, then read
                    blob.willneed(e)
            for e in experts:
                blob.readv(e, [buf])
            result[name] = (
                len(experts) * layer.record_nbytes / 1e9 / (time.perf_counter() - start)
            )
        blob.drop_cache()
    return result


COLUMNS = [
    ("row", "row", "{}"),
    ("mode", "mode", "{}"),
    ("capacity", "slots", "{}"),
    ("decode_tps", "decode tok/s", "{:.2f}"),
    ("decode_ratio", "x resident", "{:.3f}"),
    ("decode_ratios", "spread", "{}"),
    ("x_full", "x our 100 %", "{:.3f}"),
    ("prefill_tps", "prefill tok/s", "{:.2f}"),
    ("prefill_ratio", "x resident", "{:.3f}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("host_hit_rate", "host tier hit", "{:.3f}"),
    ("lru", "LRU replay", "{:.3f}"),
    ("policy", "policy replay", "{:.3f}"),
    ("belady", "Belady", "{:.3f}"),
    ("mb_per_token", "MB/tok", "{:.1f}"),
    ("disk_mb_per_token", "disk MB/tok", "{:.1f}"),
    ("fill_mb_per_token", "slot fill MB/tok", "{:.1f}"),
    ("prefetch_recall", "pf recall", "{:.2f}"),
    ("prefetch_precision", "pf precision", "{:.2f}"),
    ("wasted_mb_per_token", "pf wasted MB/tok", "{:.1f}"),
    ("peak_rss", "peak MB", "{}"),
    ("peak_over_budget", "peak/budget", "{:.3f}"),
    ("device_peak", "device peak MB", "{}"),
    ("vs_roofline", "x roofline", "{:.2f}"),
    ("tokens_match", "same tokens", "{}"),
]


def format_table(result: dict) -> str:
    head = [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in result["rows"]:
        cells = []
        for key, _, fmt in COLUMNS:
            v = entry.get(key)
            if v is None:
                cells.append("")
            elif key in ("peak_rss", "device_peak"):
                cells.append(str(round(v / 2**20)))
            elif key == "decode_ratios":
                cells.append(f"{min(v):.3f}-{max(v):.3f}" if v else "")
            else:
                cells.append(fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    d = result["disk_gbps"]
    lines.append(
        f"\ndisk: {d['qd1']:.2f} GB/s one read at a time, {d['parallel']:.2f} GB/s "
        "in parallel (cold random expert records); roofline = max(resident time "
        "per token, missed MB per token / parallel disk bandwidth) for cold rows."
    )
    if result["config"].get("trace"):
        path = result["config"]["trace"]
        lines.append(f"routes forced from {path}; {prefetch_note(load_trace(path))}.")
    return "\n".join(lines)


def main(cfg: BenchConfig, as_json: bool) -> dict:
    result = run_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1) if as_json else format_table(result))
    return result
