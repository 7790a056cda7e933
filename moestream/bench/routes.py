"""Recorded routing traces (.npz): read them, force them into a bench model,
and replay them against cache policies.

A trace file holds `ids` (uint8 or wider, [layers, tokens, k]: each MoE
layer's routed expert ids per token), optionally `seq_starts` (the first token
of each sequence, sorted, from 0), `ahead` ([layers - 1, tokens, A]: what the
runtime's prefetch predicted for layer j+1 at layer j, layer j+1's router on
layer j's MoE input, best first) and `meta` (a JSON string; `geometry.
num_experts` there is the expert count the ids index). scripts/train_router.py
writes them from a trained model; `write_trace` from any recorded routing.

Forcing replaces each MoE block's router with one that returns the trace's
choice (the real router still runs, its output multiplied by zero): the block's
own top-k, the slot lookup, the reads and the expert kernels stay the engine's.
With `ahead`, each chained layer's prefetch predicts what the trained model's
next router predicted, as the model's own routers cannot for forced routes.
It is for the benchmark only; nothing in the runtime knows about it.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..families import layer_index
from ..runtime.config import Tuning
from .replay import belady_hits, policy_hits

# A forced expert's logit: after the softmax it outweighs every other by e^10.
FORCED_LOGIT = 10.0


@dataclass(frozen=True)
class RoutingTrace:
    ids: np.ndarray  # (layers, tokens, k) expert ids
    seq_starts: np.ndarray  # first token of each sequence
    meta: dict = field(default_factory=dict)
    # (layers - 1, tokens, A): layer j+1's experts as predicted at layer j
    ahead: np.ndarray | None = None

    @property
    def layers(self) -> int:
        return self.ids.shape[0]

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def predicts(self) -> bool:
        """Whether the trace records the next layer's predicted experts."""
        return self.ahead is not None

    @property
    def num_experts(self) -> int:
        """Experts per layer: the recorded geometry's, else the largest id + 1."""
        n = self.meta.get("geometry", {}).get("num_experts")
        return int(n) if n else int(self.ids.max()) + 1

    def sequences(self, layer: int) -> list[np.ndarray]:
        """Layer `layer`'s rows, cut at the sequence starts."""
        rows = self.ids[layer].astype(np.int64)
        return [r for r in np.split(rows, self.seq_starts[1:]) if len(r)]


def load_trace(path: str | Path) -> RoutingTrace:
    """Read and check a trace file; ValueError with one sentence if it is not one."""
    name = str(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise ValueError(f"No trace file {name}.") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"{name} is not a routing trace (.npz): {e}") from None
    ids = arrays.get("ids")
    if ids is None or ids.ndim != 3 or 0 in ids.shape or ids.dtype.kind not in "iu":
        raise ValueError(
            f"{name} is not a routing trace: it needs `ids`, integer "
            "[layers, tokens, k] with none of them 0."
        )
    meta = _meta(arrays.get("meta"), name)
    starts = arrays.get("seq_starts", np.zeros(1, np.int64)).astype(np.int64)
    trace = RoutingTrace(ids, starts, meta, arrays.get("ahead"))
    _check(trace, name)
    return trace


def _meta(raw: np.ndarray | None, name: str) -> dict:
    if raw is None:
        return {}
    try:
        meta = json.loads(str(raw))
    except ValueError:
        raise ValueError(f"{name}: `meta` is not a JSON string.") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{name}: `meta` is not a JSON object.")
    return meta


def _check(trace: RoutingTrace, name: str) -> None:
    s = trace.seq_starts
    if s.ndim != 1 or not len(s) or s[0] != 0 or (np.diff(s) <= 0).any():
        raise ValueError(f"{name}: `seq_starts` must rise from 0.")
    if s[-1] >= trace.tokens:
        raise ValueError(f"{name}: a sequence starts past its {trace.tokens} tokens.")
    if trace.ids.min() < 0 or trace.ids.max() >= trace.num_experts:
        raise ValueError(
            f"{name}: expert ids must lie in 0..{trace.num_experts - 1} "
            f"(found {trace.ids.min()}..{trace.ids.max()})."
        )
    ordered = np.sort(trace.ids, axis=-1)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError(f"{name}: a token routes to the same expert twice.")
    a = trace.ahead
    if a is None:
        return
    want = (trace.layers - 1, trace.tokens)
    if a.ndim != 3 or a.shape[:2] != want or a.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: `ahead` must be integer [{want[0]}, {want[1]}, n] "
            f"(layers - 1, tokens, predictions); found {a.dtype} {list(a.shape)}."
        )
    if a.size and (a.min() < 0 or a.max() >= trace.num_experts):
        raise ValueError(f"{name}: `ahead` ids must lie in 0..{trace.num_experts - 1}.")


def uniform_trace(
    layers: int, tokens: int, k: int, num_experts: int, seed: int = 0
) -> np.ndarray:
    """ids [layers, tokens, k]: each token's k distinct experts drawn uniformly
    at random, so no cache keeps what the next token needs (hit rate about
    slots / experts): routing that misses, the disk's case."""
    rng = np.random.default_rng(seed)
    draws = rng.random((layers, tokens, num_experts), dtype=np.float32)
    return np.argsort(draws, axis=-1)[..., :k]


def write_trace(
    path: str | Path,
    ids: np.ndarray,
    seq_starts: np.ndarray | None = None,
    meta: dict | None = None,
    ahead: np.ndarray | None = None,
) -> None:
    """Write `ids` [layers, tokens, k] (and `ahead`, the next layer's predicted
    experts [layers - 1, tokens, n]) as a trace file (uint8 when ids fit)."""
    ids = np.asarray(ids)
    dtype = np.uint8 if ids.max() < 256 else np.uint16
    starts = np.zeros(1, np.int64) if seq_starts is None else np.asarray(seq_starts)
    extra = {} if ahead is None else {"ahead": np.asarray(ahead).astype(dtype)}
    np.savez_compressed(
        path,
        ids=ids.astype(dtype),
        seq_starts=starts.astype(np.int64),
        meta=np.array(json.dumps(meta or {})),
        **extra,
    )


def _rows(table: mx.array, start: int, n: int) -> mx.array:
    """Rows start..start+n of `table`, wrapping around: a slice of an array
    already on the device (no host data per call) unless it wraps."""
    total = table.shape[0]
    start %= total
    if start + n <= total:
        return table[start : start + n]
    return table[mx.array(np.arange(start, start + n) % total)]


class ForcedRouter(nn.Module):
    """A router that returns logits choosing `ids` [tokens, k], token after token
    (wrapping around); `gate`, the real router, still runs. The trace's logits
    are made once, so a call slices them where they are (on a GPU, no copy
    from the host per layer)."""

    def __init__(self, gate: nn.Module, ids: np.ndarray, num_experts: int):
        super().__init__()
        self.gate = gate
        forced = np.zeros((len(ids), num_experts), np.float32)
        np.put_along_axis(forced, ids.astype(np.int64), FORCED_LOGIT, axis=1)
        self._forced = mx.array(forced)
        self.position = 0  # the next trace token

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.gate(x)
        n = int(np.prod(x.shape[:-1]))
        forced = _rows(self._forced, self.position, n)
        self.position += n
        return logits * 0 + forced.reshape(logits.shape).astype(logits.dtype)


def rewind_routes(model: nn.Module) -> None:
    """Every forced router of `model` back to its trace's first token."""
    for _, m in model.named_modules():
        if isinstance(m, ForcedRouter):
            m.position = 0


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed MoE block (one with a `gate` and a `switch_mlp`), in layer order."""
    found = {
        path: m
        for path, m in model.named_modules()
        if "gate" in m and "switch_mlp" in m and hasattr(m, "top_k")
    }
    return dict(sorted(found.items(), key=lambda kv: layer_index(kv[0])))


def check_geometry(trace: RoutingTrace, num_experts: int, top_k: int) -> None:
    """ValueError unless a model routing top-`top_k` of `num_experts` can take it."""
    if top_k != trace.top_k or num_experts < trace.num_experts:
        raise ValueError(
            f"The trace routes top-{trace.top_k} of {trace.num_experts} experts; "
            f"the model's layers route top-{top_k} of {num_experts}."
        )


class ForcedPrediction:
    """A chained layer's prefetch prediction as the trace recorded it: the
    first `n` of `ahead` [tokens, A] at the tokens its layer's `router` has
    just routed."""

    def __init__(self, router: ForcedRouter, ahead: np.ndarray, n: int):
        self._router = router
        self._ahead = mx.array(ahead[:, :n].astype(np.uint32))

    def __call__(self, x: mx.array) -> mx.array:
        t = int(np.prod(x.shape[:-1]))
        rows = _rows(self._ahead, self._router.position - t, t)
        return rows.reshape(*x.shape[:-1], -1)


def predictions_used(trace: RoutingTrace, top_k: int, extra: int) -> int:
    """How many of each token's recorded predictions prefetch takes (top-k +
    `extra`, as the runtime's router predictor); ValueError if the trace has
    none or too few."""
    n = top_k + extra
    if trace.ahead is None:
        raise ValueError(
            "The trace records no next-layer predictions (`ahead`), and the "
            "model's routers cannot predict forced routes: leave prefetch off."
        )
    if n > trace.ahead.shape[2]:
        raise ValueError(
            f"prefetch_extra={extra} asks for {n} predictions a token; the trace "
            f"records {trace.ahead.shape[2]}: use prefetch_extra <= "
            f"{trace.ahead.shape[2] - top_k}."
        )
    return n


def check_trace(
    trace: RoutingTrace, num_experts: int, top_k: int, extras: list[int]
) -> None:
    """ValueError unless a model routing top-`top_k` of `num_experts` can take
    `trace`, and its predictions (if any) serve each run's `prefetch_extra`."""
    check_geometry(trace, num_experts, top_k)
    for extra in extras if trace.predicts else []:
        predictions_used(trace, top_k, extra)


def prefetch_note(trace: RoutingTrace) -> str:
    """How a bench run forced by `trace` prefetches, for its report."""
    if trace.predicts:
        return "prefetch predicts as the trace recorded (the trained next router)"
    return "prefetch off (the model's routers cannot predict forced routes)"


def force_routes(
    model: nn.Module, trace: RoutingTrace, prefetch_extra: int | None = None
) -> list[ForcedRouter]:
    """Make MoE block l route as trace layer l mod trace.layers; the routers.

    With `prefetch_extra` and a trace that records `ahead`, each chained
    streaming layer l predicts as the trace did at layer l mod trace.layers
    (top-k + prefetch_extra of it); the layer before a wrap of the trace's
    layers has no recorded prediction and predicts nothing."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("The model has no MoE block with a `gate` to force.")
    routers = []
    for i, block in enumerate(blocks.values()):
        experts = getattr(block, "num_experts", None) or block.gate.weight.shape[0]
        check_geometry(trace, experts, block.top_k)
        gate = block.gate.gate if isinstance(block.gate, ForcedRouter) else block.gate
        block.gate = ForcedRouter(gate, trace.ids[i % trace.layers], experts)
        routers.append(block.gate)
        engine = getattr(block.switch_mlp, "_engine", None)
        if prefetch_extra is None or getattr(engine, "predict", None) is None:
            continue
        j = i % trace.layers
        n = predictions_used(trace, block.top_k, prefetch_extra)
        last = j == trace.layers - 1
        engine.predict = (
            None if last else ForcedPrediction(block.gate, trace.ahead[j], n)
        )
    return routers


def policy_curves(
    trace: RoutingTrace,
    capacities: list[int],
    policies: tuple[str, ...] = ("lru", "lrfu"),
    lrfu_decay: float = Tuning.lrfu_decay,
) -> dict[int, dict[str, float]]:
    """Hit rates of each policy and Belady at each capacity: every layer, every
    sequence from empty slots (as a fresh decode), over all selections."""
    total = trace.layers * trace.tokens * trace.top_k
    out = {}
    for cap in capacities:
        hits = dict.fromkeys([*policies, "belady"], 0)
        for layer in range(trace.layers):
            for seq in trace.sequences(layer):
                for name in policies:
                    hits[name] += policy_hits(
                        seq, cap, name, trace.num_experts, lrfu_decay
                    )
                hits["belady"] += belady_hits(seq, cap)
        out[cap] = {name: h / total for name, h in hits.items()}
    return out


def locality(trace: RoutingTrace) -> dict[str, float]:
    """The locality numbers papers report: P(an expert of a token is routed
    again at the next token), and the share of selections the top 25 % of each
    layer's experts take; beside the values of uniform routing."""
    k, experts = trace.top_k, trace.num_experts
    reused = pairs = 0
    top = []
    for layer in range(trace.layers):
        for seq in trace.sequences(layer):
            same = (seq[1:, :, None] == seq[:-1, None, :]).any(-1)
            reused += int(same.sum())
            pairs += same.size
        counts = np.sort(np.bincount(trace.ids[layer].ravel(), minlength=experts))
        top.append(counts[::-1][: max(1, experts // 4)].sum() / counts.sum())
    return {
        "p_reuse_next": reused / max(pairs, 1),
        "uniform_p_reuse_next": k / experts,
        "top25_share": float(np.mean(top)),
        "uniform_top25_share": max(1, experts // 4) / experts,
    }


def trace_report(
    trace: RoutingTrace,
    slots: dict[float, int],
    lrfu_decay: float = Tuning.lrfu_decay,
) -> dict:
    """The trace's shape, locality and policy curves at `slots` (% of experts
    -> slots per layer)."""
    caps = sorted(set(slots.values()))
    curves = policy_curves(trace, caps, ("lru", "lrfu"), lrfu_decay)
    return {
        "layers": trace.layers,
        "tokens": trace.tokens,
        "sequences": len(trace.seq_starts),
        "top_k": trace.top_k,
        "num_experts": trace.num_experts,
        "locality": locality(trace),
        "rows": [{"percent": p, "slots": c, **curves[c]} for p, c in slots.items()],
    }


def format_trace_report(report: dict) -> str:
    k, loc, r = report["top_k"], report["locality"], report
    lines = [
        f"{r['layers']} layers x {r['tokens']} tokens ({r['sequences']} sequences), "
        f"top-{k} of {r['num_experts']} experts",
        f"P(expert reused at the next token) {loc['p_reuse_next']:.3f} "
        f"(uniform {loc['uniform_p_reuse_next']:.3f}); the top 25 % of experts "
        f"take {loc['top25_share']:.3f} of selections "
        f"(uniform {loc['uniform_top25_share']:.3f})",
        "",
        "| % of experts | slots | slots / top-k | LRU | LRFU | Belady |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['percent']:g} | {r['slots']} | {r['slots'] / k:g} | "
            f"{r['lru']:.3f} | {r['lrfu']:.3f} | {r['belady']:.3f} |"
        )
    return "\n".join(lines)
