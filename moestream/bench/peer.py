"""moestream, mlx-lm resident and llama.cpp in one table, runs interleaved.

Every run is a fresh process; each repeat runs every row once (its decode,
then its prefill), in the same order, so the rows share the machine's load;
medians are reported. The llama.cpp rows run llama-bench (its `tg` test
decodes random token ids, so its routing does not repeat; moestream decodes
sampled tokens at temperature 1 for the same reason).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .harness import BenchConfig, Row, plan_rows, run_job
from .llama_cpp import LlamaJob, run_llama_bench


@dataclass(frozen=True)
class PeerConfig:
    out: Path  # the converted model
    ggufs: tuple[tuple[str, Path], ...]  # (label, file) of the same weights
    exe: Path  # llama-bench
    ik_ggufs: tuple[tuple[str, Path], ...] = ()  # for ik_llama.cpp's rows
    ik_exe: Path | None = None  # ik_llama.cpp's llama-bench
    budgets: tuple[float, ...] = (100, 25)
    modes: tuple[str, ...] = ("warm",)
    decode_tokens: int = 32
    prompt_tokens: int = 512
    repeats: int = 3
    threads: int = 2
    ngl: int | None = None
    # llama.cpp -ncmoe values: one set of llama rows each (None: not passed)
    n_cpu_moe: tuple[int | None, ...] = (None,)
    llama_extra: tuple[str, ...] = ()
    resident: bool = True  # the mlx-lm row (off where it does not fit in RAM)
    # more moestream rows: (label, RuntimeConfig or Tuning fields), e.g. mapped
    compare: tuple[tuple[str, dict], ...] = ()
    bench: BenchConfig = field(init=False)

    def __post_init__(self) -> None:
        cfg = BenchConfig(
            self.out,
            self.budgets,
            self.modes,
            self.decode_tokens,
            self.prompt_tokens,
            verify_cost=False,
            compare=self.compare,
        )
        object.__setattr__(self, "bench", cfg)


@dataclass
class PeerRow:
    engine: str
    slots: str
    mode: str
    decode_run: Callable[[], dict]
    prefill_run: Callable[[], dict] | None
    peer: bool = False  # llama-bench's rows (llama.cpp, ik_llama.cpp)
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)


def moestream_rows(cfg: PeerConfig) -> list[PeerRow]:
    rows: list[Row] = plan_rows(cfg.bench)
    if not cfg.resident:
        rows = rows[1:]
    out = []
    for row in rows:
        pre = replace(row.job, prompt_tokens=cfg.prompt_tokens, decode_tokens=0)
        out.append(
            PeerRow(
                "mlx-lm resident" if row.job.capacity is None else "moestream",
                "-"
                if row.job.capacity is None
                else f"{row.job.capacity} ({row.budget_pct:g} %)"
                + (f" {row.variant}" if row.variant else ""),
                row.mode,
                lambda j=row.job: run_job(j),
                (lambda j=pre: run_job(j)) if cfg.prompt_tokens else None,
            )
        )
    return out


def llama_rows(cfg: PeerConfig) -> list[PeerRow]:
    out = []
    runs = [("llama.cpp", cfg.exe, g) for g in cfg.ggufs]
    runs += [("ik_llama.cpp", cfg.ik_exe, g) for g in cfg.ik_ggufs]
    for name, exe, (label, path) in runs:
        for n_cpu_moe in cfg.n_cpu_moe:
            for mode in cfg.modes:
                base = LlamaJob(
                    str(exe),
                    str(path),
                    threads=cfg.threads,
                    cold=mode == "cold",
                    ngl=cfg.ngl,
                    n_cpu_moe=n_cpu_moe,
                    extra=cfg.llama_extra,
                )
                out.append(_llama_row(cfg, f"{name} {label}", base, mode))
    return out


def _llama_row(cfg: PeerConfig, engine: str, base: LlamaJob, mode: str) -> PeerRow:
    where = "mmap" if base.ngl is None else f"-ngl {base.ngl}"
    if base.n_cpu_moe is not None:
        where += f" -ncmoe {base.n_cpu_moe}"
    tg = replace(base, decode_tokens=cfg.decode_tokens)
    pp = replace(base, prompt_tokens=cfg.prompt_tokens)
    return PeerRow(
        engine,
        where,
        mode,
        lambda j=tg: run_llama_bench(j),
        (lambda j=pp: run_llama_bench(j)) if cfg.prompt_tokens else None,
        peer=True,
    )


def run_rows(
    rows: list[PeerRow], repeats: int, progress: Callable[[str], None]
) -> None:
    """Each repeat runs every row's decode, then its prefill, in turn."""
    for r in range(repeats):
        for row in rows:
            row.decode.append(row.decode_run())
            if row.prefill_run is not None:
                row.prefill.append(row.prefill_run())
            progress(f"repeat {r + 1}/{repeats} {row.engine} {row.slots} {row.mode}")


def run_peer(cfg: PeerConfig, progress: Callable[[str], None] = print) -> dict:
    rows = moestream_rows(cfg) + llama_rows(cfg)
    run_rows(rows, cfg.repeats, progress)
    return {
        "config": {k: str(v) for k, v in cfg.__dict__.items() if k != "bench"},
        "rows": [summarize(row, cfg) for row in rows],
    }


def _median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def summarize(row: PeerRow, cfg: PeerConfig) -> dict:
    llama = row.peer
    tps, pre = ("tps", "tps") if llama else ("decode_tps", "prefill_tps")
    entry = {
        "engine": row.engine,
        "slots": row.slots,
        "mode": row.mode,
        "decode_tps": _median(row.decode, tps),
        "decode_spread": [r[tps] for r in row.decode],
        "prefill_tps": _median(row.prefill, pre),
        "prefill_spread": [r[pre] for r in row.prefill],
        # time to the first token of a prompt of prompt_tokens
        "ttft_s": _median(row.prefill, "seconds" if llama else "prefill_s"),
        "read_mb_per_token": None
        if llama
        else _median(row.decode, "bytes_per_token") / 1e6,
        "disk_mb_per_token": _median(row.decode, "disk_bytes_per_token") / 1e6,
        "peak_rss": max(r["peak_rss"] for r in row.decode + row.prefill),
    }
    if not llama:
        tokens = [r["tokens"] for r in row.decode]
        entry["tokens"] = tokens[0] if all(t == tokens[0] for t in tokens) else None
    return entry


COLUMNS = [
    ("engine", "engine", "{}"),
    ("slots", "slots / load", "{}"),
    ("mode", "mode", "{}"),
    ("decode_tps", "decode tok/s", "{:.2f}"),
    ("decode_ratio", "x mlx-lm", "{:.2f}"),
    ("decode_vs_peer", "decode x llama.cpp", "{:.2f}"),
    ("prefill_tps", "prefill tok/s", "{:.1f}"),
    ("prefill_vs_peer", "prefill x llama.cpp", "{:.2f}"),
    ("ttft_s", "TTFT s", "{:.2f}"),
    ("read_mb_per_token", "read MB/tok", "{:.1f}"),
    ("disk_mb_per_token", "disk MB/tok", "{:.1f}"),
    ("peak_rss", "peak RSS MB", "{:.0f}"),
    ("same_tokens", "tokens = mlx-lm", "{}"),
]


def format_table(result: dict) -> str:
    """The rows as a markdown table; "x llama.cpp" against the first llama.cpp
    row (the first --gguf)."""
    rows = result["rows"]
    ref = next((r for r in rows if r["engine"] == "mlx-lm resident"), None)
    peer = next((r for r in rows if r["engine"].startswith("llama.cpp")), None)
    head = [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        r = dict(r, peak_rss=r["peak_rss"] / 2**20)
        if peer is not None:
            r["decode_vs_peer"] = r["decode_tps"] / peer["decode_tps"]
            r["prefill_vs_peer"] = r["prefill_tps"] / peer["prefill_tps"]
        if ref is not None:
            r["decode_ratio"] = r["decode_tps"] / ref["decode_tps"]
            if "tokens" in r:  # exactness: the same sampled tokens (same seed)
                r["same_tokens"] = r["tokens"] == ref["tokens"]
        cells = [
            "" if r.get(k) is None or r.get(k) != r.get(k) else f.format(r[k])
            for k, _, f in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(cfg: PeerConfig, as_json: bool) -> dict:
    result = run_peer(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1) if as_json else format_table(result))
    return result
