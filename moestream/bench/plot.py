"""Figures: `moestream plot TRACE -o fig.png` and `moestream bench --plot fig.png`.

matplotlib is optional (`pip install 'moestream[plot]'`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..trace import Trace
from .replay import belady_step_hits, policy_step_hits

# Decode-token curves are smoothed over this many tokens.
WINDOW = 8


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "Plotting needs matplotlib: pip install 'moestream[plot]'."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def expert_use(trace: Trace) -> np.ndarray:
    """(layers, experts): share of each layer's routed (token, k) pairs."""
    layers = trace.layers()
    use = np.zeros((len(layers), trace.meta["num_experts"]))
    for i, layer in enumerate(layers):
        counts = np.bincount(trace.routing(layer).reshape(-1), minlength=use.shape[1])
        use[i] = counts[: use.shape[1]] / max(counts.sum(), 1)
    return use


def per_token(trace: Trace) -> dict[str, np.ndarray]:
    """Per decode token (calls of one token): hit rate and MB read of the run
    and of LRU and Belady replays of the same routing at the same capacity,
    each replay from an empty cache over every token (prompt included)."""
    capacity, experts = trace.meta["capacity"], trace.meta["num_experts"]
    record = {int(k): v for k, v in trace.meta["record_bytes"].items()}
    steps = sorted({e["step"] for e in trace.events if e["tokens"] == 1})
    index = {s: i for i, s in enumerate(steps)}
    out = {
        k: np.zeros(len(steps))
        for k in ("hits", "distinct", "mb", "lru", "belady", "lru_mb", "belady_mb")
    }
    for layer in trace.layers():
        events = [e for e in trace.events if e["layer"] == layer]
        routing = trace.routing(layer)
        distinct = np.array([len(np.unique(r)) for r in routing])
        replays = {
            "lru": policy_step_hits(routing, capacity, "lru", experts),
            "belady": belady_step_hits(routing, capacity),
        }
        row = 0
        for e in events:
            i = index.get(e["step"]) if e["tokens"] == 1 else None
            if i is not None:
                out["hits"][i] += e["hits"]
                out["distinct"][i] += e["hits"] + e["misses"]
                out["mb"][i] += e["bytes_read"] / 1e6
                for name, hits in replays.items():
                    out[name][i] += hits[row]
                    out[f"{name}_mb"][i] += (
                        (distinct[row] - hits[row]) * record[layer] / 1e6
                    )
            row += e["tokens"]
    total = np.maximum(out["distinct"], 1)
    return {
        "step": np.array(steps),
        "hit_rate": out["hits"] / total,
        "lru": out["lru"] / total,
        "belady": out["belady"] / total,
        "mb": out["mb"],
        "lru_mb": out["lru_mb"],
        "belady_mb": out["belady_mb"],
    }


def _smooth(y: np.ndarray, window: int = WINDOW) -> np.ndarray:
    if len(y) < window:
        return y
    return np.convolve(y, np.ones(window) / window, mode="valid")


def plot_trace(trace: Trace, path: str | Path) -> None:
    plt = pyplot()
    use = expert_use(trace)
    curves = per_token(trace)
    meta = trace.meta
    fig, axes = plt.subplots(
        3, 1, figsize=(10, 10), gridspec_kw={"height_ratios": [1.2, 1, 1]}
    )
    im = axes[0].imshow(use, aspect="auto", cmap="viridis", interpolation="nearest")
    axes[0].set_yticks(range(len(trace.layers())), [str(x) for x in trace.layers()])
    axes[0].set(xlabel="expert", ylabel="MoE layer", title="expert use per layer")
    fig.colorbar(im, ax=axes[0], label="share of the layer's routed tokens")
    tokens = len(curves["step"])
    x = np.arange(tokens)[: len(_smooth(curves["hit_rate"]))] + (
        WINDOW // 2 if tokens >= WINDOW else 0
    )
    for key, label, style in (
        ("hit_rate", f"this run ({meta['policy']})", "-"),
        ("lru", "LRU replay", "--"),
        ("belady", "Belady replay (optimal)", ":"),
    ):
        mean = curves[key].mean() if tokens else 0.0
        axes[1].plot(x, _smooth(curves[key]), style, label=f"{label}: {mean:.3f}")
    axes[1].set(ylabel="hit rate", ylim=(0, 1.02))
    axes[1].legend(loc="lower right")
    for key, label, style in (
        ("mb", "this run", "-"),
        ("lru_mb", "LRU replay", "--"),
        ("belady_mb", "Belady replay", ":"),
    ):
        mean = curves[key].mean() if tokens else 0.0
        axes[2].plot(x, _smooth(curves[key]), style, label=f"{label}: {mean:.2f}")
    axes[2].set(xlabel="decoded token", ylabel="MB read per token")
    axes[2].set_ylim(bottom=0)
    axes[2].legend(loc="upper right")
    for ax in axes[1:]:
        ax.grid(alpha=0.3)
    name = Path(meta["model"]).name
    fig.suptitle(
        f"{name}: {meta['capacity']} of {meta['num_experts']} experts per layer in "
        f"slots, top-{meta['top_k']}; curves: mean over {WINDOW} tokens, legend: "
        f"mean over {tokens} decode steps"
    )
    fig.tight_layout()
    save(fig, path)


def plot_bench(result: dict[str, Any], path: str | Path) -> None:
    """The bench table's ratios: decode and prefill x resident per row, and hit
    rate beside the LRU and Belady replays."""
    plt = pyplot()
    rows = [r for r in result["rows"] if r["capacity"] is not None]
    labels = [f"{r['row']}\n{r['mode']}" for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 1.3 * len(rows) + 2), 8))
    series = [
        (label, values)
        for key, label in (("decode_ratio", "decode"), ("prefill_ratio", "prefill"))
        if np.isfinite(values := np.array([r.get(key, np.nan) for r in rows])).any()
    ]  # a bench without prefill runs has no prefill ratios
    w = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * w
        bars = axes[0].bar(x + offset, values, w, label=label)
        axes[0].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(ylabel="x resident (tok/s)", title="speed vs mlx-lm fully resident")
    axes[0].set_xticks(x, labels)
    axes[0].legend(loc="lower left")
    w = 0.27
    for i, (key, label) in enumerate(
        (("hit_rate", "this run"), ("lru", "LRU replay"), ("belady", "Belady"))
    ):
        values = [r.get(key, np.nan) for r in rows]
        axes[1].bar(x + (i - 1) * w, values, w, label=label)
    axes[1].set(
        ylabel="hit rate",
        ylim=(0, 1.05),
        title="expert hit rate (replays: the decode trace, from empty caches)",
    )
    axes[1].set_xticks(x, labels)
    axes[1].legend(loc="lower left")
    d = result["disk_gbps"]
    resident = result["rows"][0]
    fig.suptitle(
        f"{Path(result['config']['out']).name}: resident {resident['decode_tps']:.2f}"
        f" tok/s; disk {d['qd1']:.2f} GB/s one read at a time, "
        f"{d['parallel']:.2f} GB/s in parallel"
    )
    fig.tight_layout()
    save(fig, path)


def save(fig: Any, path: str | Path) -> None:
    """Write the figure to a temporary name, then rename it."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        pyplot().close(fig)
