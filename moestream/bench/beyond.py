"""A model larger than the RAM left to it: moestream and llama.cpp's mmap
under a balloon, against the disk's measured limit.

1. The disk: O_DIRECT reads of whole expert records, one at a time and
   several in flight (the limit is the best of those).
2. In RAM, no balloon: moestream with every expert in slots, warm (the
   compute time per token of the roofline), and llama.cpp warm; once in each
   repeat, beside that repeat's balloon rows.
3. Under the balloon (MemAvailable held near `floor`, so the page cache has
   about that much room; or without one, for a model larger than the whole
   machine's RAM): every row cold (page cache dropped first), then the same
   row again warm (what the page cache kept). Decoding is sampled
   (moestream, temperature 1) or random ids (llama-bench's tg), so routing
   does not repeat.

Roofline per run: max(compute s/token in RAM, disk bytes/token / limit), the
compute term measured in the same repeat; a row's ratio is the median of its
runs'.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from ..formats import load_manifest
from ..formats.manifest import inside
from ..runtime.config import Tuning
from .balloon import FLOOR, Balloon, available
from .harness import DECODE_PROMPT_TOKENS, capacity_for, run_job
from .llama_cpp import LlamaJob, run_llama_bench
from .routes import check_trace, load_trace, uniform_trace, write_trace
from .sysio import direct_read_gbps
from .worker import Job


@dataclass(frozen=True)
class BeyondConfig:
    out: Path
    gguf: Path | None  # None: moestream's rows only
    exe: Path | None
    budgets: tuple[float, ...] = (25, 50)  # % of experts in slots
    decode_tokens: int = 128
    repeats: int = 1
    threads: int = 2
    floor: int = FLOOR  # MemAvailable the balloon holds the machine at
    llama_extra: tuple[str, ...] = ()
    ngl: int | None = None  # llama.cpp -ngl (its CUDA build)
    # llama.cpp -ncmoe: layers whose experts stay on the CPU
    n_cpu_moe: int | None = None
    runtime_fields: tuple[tuple[str, dict], ...] = ()  # --compare variants
    # A routing trace (.npz) every moestream run's MoE blocks route by
    # (routes.py; e.g. `uniform_trace`: routing that misses). Prefetch runs
    # on its recorded predictions (`ahead`), or is off when it has none.
    trace: Path | None = None
    # The in-RAM rows (the roofline's compute term); off: the roofline is the
    # disk's alone.
    in_ram: bool = True
    # For a model whose experts do not all fit in RAM: its in-RAM row holds
    # each layer's first N experts in slots and routes every token uniformly
    # among them, the same arithmetic per token as every expert resident.
    compute_experts: int | None = None
    # False: no balloon (a model larger than the machine's whole RAM).
    balloon: bool = True


def measure_disk(out: Path) -> dict:
    manifest = load_manifest(out)
    layer = manifest.layers[len(manifest.layers) // 2]
    path = inside(out, layer.file)
    result = {}
    for threads in (1, 4, 8):
        total = 64 * layer.record_nbytes
        result[f"qd{threads}"] = direct_read_gbps(
            path, layer.record_nbytes, total, threads
        )
    result["limit"] = max(result.values())
    result["record_bytes"] = layer.record_nbytes
    return result


def moestream_job(cfg: BeyondConfig, pct: float, cold: bool, runtime: dict) -> Job:
    config = json.loads((cfg.out / "config.json").read_text())
    cap = capacity_for(pct, config["num_experts"], config["num_experts_per_tok"])
    job = Job(
        str(cfg.out),
        cap,
        cold=cold,
        prompt_tokens=DECODE_PROMPT_TOKENS,
        decode_tokens=cfg.decode_tokens,
        trace=str(cfg.trace) if cfg.trace else None,
    )
    return replace(job, runtime=job.runtime.with_options(**runtime))


def compute_job(cfg: BeyondConfig, folder: Path) -> Job:
    """The in-RAM row's job, the roofline's compute term: every expert in
    slots, or with `compute_experts` N, each layer's first N with every token
    routed uniformly among them (their trace written into `folder`)."""
    if cfg.compute_experts is None:
        return moestream_job(cfg, 100, False, {})
    config = json.loads((cfg.out / "config.json").read_text())
    n, k = cfg.compute_experts, config["num_experts_per_tok"]
    if not k <= n <= config["num_experts"]:
        raise ValueError(
            f"--compute-experts {n}: give {k} (the model's top-k) to "
            f"{config['num_experts']} (its experts per layer)."
        )
    path = folder / f"compute-{n}.npz"
    tokens = DECODE_PROMPT_TOKENS + cfg.decode_tokens + 1
    ids = uniform_trace(config.get("num_hidden_layers", 1), tokens, k, n)
    write_trace(path, ids, meta={"geometry": {"num_experts": n}})
    return Job(
        str(cfg.out),
        n,
        prompt_tokens=DECODE_PROMPT_TOKENS,
        decode_tokens=cfg.decode_tokens,
        trace=str(path),
    )


def llama_job(cfg: BeyondConfig, cold: bool) -> LlamaJob:
    return LlamaJob(
        str(cfg.exe),
        str(cfg.gguf),
        decode_tokens=cfg.decode_tokens,
        threads=cfg.threads,
        cold=cold,
        ngl=cfg.ngl,
        n_cpu_moe=cfg.n_cpu_moe,
        extra=cfg.llama_extra,
    )


def _moe(job: Job) -> dict:
    r = run_job(job)
    return {
        "tps": r["decode_tps"],
        "disk": r["disk_bytes_per_token"],
        "read": r["bytes_per_token"],
        "missed": r["fill_bytes_per_token"],
        "rss": r["peak_rss"],
        "hit": r.get("hit_rate"),
        "tokens": r["tokens"],
        "cpu": r["cpu_s_per_token"],
        "system": r["system_s_per_token"],
    }


def _llama(job: LlamaJob) -> dict:
    r = run_llama_bench(job)
    return {
        "tps": r["tps"],
        "disk": r["disk_bytes_per_token"],
        "read": None,
        "missed": None,
        "rss": r["peak_rss"],
        "hit": None,
        "cpu": None,  # llama-bench's own process: not counted
        "system": None,
    }


def plan(cfg: BeyondConfig) -> list[tuple[str, str, Callable[[], dict]]]:
    """(name, mode, run) of the rows under the balloon: each cold, then warm."""
    rows = []
    variants = [("", {}), *cfg.runtime_fields]
    for pct in cfg.budgets:
        for label, fields in variants:
            name = f"moestream {pct:g} %" + (f" {label}" if label else "")
            for cold in (True, False):
                job = moestream_job(cfg, pct, cold, fields)
                rows.append((name, "cold" if cold else "warm", lambda j=job: _moe(j)))
    for cold in (True, False) if cfg.gguf else ():
        job = llama_job(cfg, cold)
        rows.append(
            ("llama.cpp mmap", "cold" if cold else "warm", lambda j=job: _llama(j))
        )
    return rows


def run_beyond(cfg: BeyondConfig, progress: Callable[[str], None] = print) -> dict:
    if cfg.trace:  # fail here in one line, not in every worker
        config = json.loads((cfg.out / "config.json").read_text())
        routes = load_trace(cfg.trace)
        variants = [{}, *(f for _, f in cfg.runtime_fields)]
        extras = [f.get("prefetch_extra", Tuning.prefetch_extra) for f in variants]
        check_trace(
            routes, config["num_experts"], config["num_experts_per_tok"], extras
        )
    if cfg.gguf:  # llama.cpp loads it (a token), before an hour of rows
        _llama(replace(llama_job(cfg, False), decode_tokens=1))
    with tempfile.TemporaryDirectory() as folder:
        ram_job = compute_job(cfg, Path(folder))
        disk = measure_disk(cfg.out)
        progress(f"disk: {json.dumps(disk)}")
        results, held = _repeats(cfg, ram_job, progress)
    return summarize(results, disk, held)


def _balloon(cfg: BeyondConfig) -> Balloon | nullcontext:
    if not cfg.balloon:
        return nullcontext()
    return Balloon(leave=cfg.floor + (512 << 20), floor=cfg.floor)


def _repeats(
    cfg: BeyondConfig, ram_job: Job, progress: Callable[[str], None]
) -> tuple[dict, int]:
    # Each repeat measures its own compute term in RAM (no balloon) beside its
    # balloon rows: a machine whose speed drifts over the run moves both.
    # llama.cpp's in-RAM row comes after the balloon rows, with no page cache
    # of the GGUF left to them.
    name = "moestream 100 %"
    if cfg.compute_experts is not None:
        name = f"moestream {cfg.compute_experts} experts"
    where = "balloon" if cfg.balloon else "no balloon"
    results: dict[tuple[str, str, str], list[dict]] = {}

    def record(name: str, mode: str, where: str, run: Callable[[], dict]) -> None:
        results.setdefault((name, mode, where), []).append(run())
        progress(f"{where} {name} {mode}: {available() >> 20} MB available")

    held = 0
    for _ in range(cfg.repeats):
        if cfg.in_ram:
            record(name, "warm", "in RAM", lambda: _moe(ram_job))
        with _balloon(cfg) as balloon:
            size = balloon.held if balloon else 0
            progress(f"balloon holds {size >> 20} MB, {available() >> 20} MB left")
            for row, mode, run in plan(cfg):
                record(row, mode, where, run)
            held = max(held, size)
        if cfg.gguf and cfg.in_ram and cfg.compute_experts is None:
            record(
                "llama.cpp mmap",
                "warm",
                "in RAM",
                lambda: _llama(llama_job(cfg, False)),
            )
    return results, held


def summarize(results: dict, disk: dict, held: int) -> dict:
    """Each run's roofline from its own repeat's compute term (the in-RAM
    run of the same index), then medians over the repeats."""
    compute: dict[str, list[float]] = {}
    for (name, _, where), runs in results.items():
        if where == "in RAM":
            compute[name.split()[0]] = [1 / r["tps"] for r in runs]
    limit = disk["limit"] * 1e9
    out = []
    for (name, mode, where), runs in results.items():
        tps = statistics.median(r["tps"] for r in runs)
        dpt = _median(runs, "disk")
        # an engine with no in-RAM row (--no-in-ram; llama.cpp beside
        # --compute-experts): the disk's term alone
        terms = compute.get(name.split()[0]) or [0.0] * len(runs)
        bounds = [max(c, r["disk"] / limit) for c, r in zip(terms, runs, strict=True)]
        ratios = [b * r["tps"] for b, r in zip(bounds, runs, strict=True)]
        # The same against the records the slots missed (one a miss), as if
        # each came from the disk and nothing else did: reads ahead that no
        # slot took are not credited to the roofline here.
        missed = _median(runs, "missed")
        strict = None
        if missed is not None:
            strict = statistics.median(
                max(c, r["missed"] / limit) * r["tps"]
                for c, r in zip(terms, runs, strict=True)
            )
        out.append(
            {
                "row": name,
                "mode": mode,
                "memory": where,
                "decode_tps": tps,
                "spread": [r["tps"] for r in runs],
                "disk_mb_per_token": dpt / 1e6,
                "read_mb_per_token": _median(runs, "read", 1e-6),
                "disk_mb_s": dpt * tps / 1e6,
                "peak_rss": max(r["rss"] for r in runs),
                "hit_rate": runs[0]["hit"],
                "cpu_ms_per_token": _median(runs, "cpu", 1e3),
                "system_ms_per_token": _median(runs, "system", 1e3),
                "roofline_s": statistics.median(bounds),
                "x_roofline": statistics.median(ratios),
                "x_roofline_spread": ratios,
                "missed_mb_per_token": None if missed is None else missed / 1e6,
                "x_roofline_records": strict,
            }
        )
    compute_s = {k: statistics.median(v) for k, v in compute.items()}
    return {
        "disk_gbps": disk,
        "balloon_bytes": held,
        "compute_s": compute_s,
        "rows": out,
    }


def _median(runs: list[dict], key: str, scale: float = 1.0) -> float | None:
    """The runs' median `key` times `scale`; None where it is not measured
    (llama.cpp's rows)."""
    if runs[0][key] is None:
        return None
    return scale * statistics.median(r[key] for r in runs)


COLUMNS = [
    ("row", "row", "{}"),
    ("memory", "memory", "{}"),
    ("mode", "mode", "{}"),
    ("decode_tps", "decode tok/s", "{:.3f}"),
    ("hit_rate", "slot hit", "{:.2f}"),
    ("read_mb_per_token", "read MB/tok", "{:.0f}"),
    ("disk_mb_per_token", "disk MB/tok", "{:.0f}"),
    ("disk_mb_s", "disk MB/s", "{:.0f}"),
    ("cpu_ms_per_token", "CPU ms/tok", "{:.0f}"),
    ("system_ms_per_token", "of it kernel", "{:.0f}"),
    ("peak_rss", "peak RSS MB", "{:.0f}"),
    ("roofline_s", "roofline s/tok", "{:.2f}"),
    ("x_roofline", "x roofline", "{:.2f}"),
    ("missed_mb_per_token", "missed MB/tok", "{:.0f}"),
    ("x_roofline_records", "x roofline of missed", "{:.2f}"),
]


def format_table(result: dict) -> str:
    head = [t for _, t, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        r = dict(r, peak_rss=r["peak_rss"] / 2**20)
        cells = ["" if r.get(k) is None else f.format(r[k]) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    d = result["disk_gbps"]
    lines.append(
        f"\ndisk (O_DIRECT, {d['record_bytes'] >> 10} KiB records): "
        f"qd1 {d['qd1']:.2f}, "
        f"qd4 {d['qd4']:.2f}, qd8 {d['qd8']:.2f} GB/s; limit {d['limit']:.2f} GB/s. "
        f"balloon {result['balloon_bytes'] >> 20} MB."
    )
    return "\n".join(lines)


def main(cfg: BeyondConfig, as_json: bool) -> dict:
    result = run_beyond(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1) if as_json else format_table(result))
    return result
