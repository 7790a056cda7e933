"""How far ahead the experts of an MoE layer can be predicted, and at what cost.

Predictors of layer m's experts at token t, each a ranking (best first):

- router L+1: layer m's router on layer m-1's MoE input (what the runtime's
  prefetch does, moestream/runtime/prefetch.py; a trace's recorded `ahead`);
- router L+2: layer m's router on layer m-2's MoE input (two layers earlier);
- table L+1, table L+2: a learned table, P(f routed at m | e routed at m-d)
  counted on the first half of the tokens, summed over the k experts token t
  routes to at layer m-d.

Every predictor is scored on the second half of the tokens, on the target
layers 2.. (those every depth can predict): recall (of the k routed, the share
among the first n predicted), precision (of the n, the share routed), wasted
(predicted, not routed: experts a token a layer, and MB a token over the
model's MoE layers). Then each layer's calls replay through the runtime's
SlotPool (LRFU) from empty slots at `--capacity` % of the experts, reading
ahead the predicted experts not in a slot, as the native engine's prefetch:
miss recall (misses read ahead), precision, wasted MB a token, and for the
union of L+2 and L+1 the share of misses read ahead two layers early.

    python scripts/predict_depth.py model OUT TEXT --tokens 4096 [--save-trace F]
    python scripts/predict_depth.py trace TRACE.npz [--record-bytes B]

`model` runs a converted model over TEXT (teacher-forced, chunks of 256, every
expert resident) and records each MoE block's input; `--save-trace` writes the
routing with `ahead` (router L+1, 16 wide) for `moestream bench trace`. `trace`
takes a trace file (its recorded `ahead` is router L+1; no L+2 router), with
records of `--record-bytes` (default: Qwen3-30B-A3B's 4-bit record, the bench
model `medium`'s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

from moestream.bench.replay import (
    cooccurrence,
    decode_timeline,
    prediction_quality,
    prefetch_replay,
    ranked,
    table_scores,
)

MEDIUM_RECORD = 2_654_208  # 3 x 2048 x 768 4-bit weights, bf16 scales/biases per 64
WIDTH = 16  # predictions recorded per token and layer


def record(
    out: str, text: str, tokens: int, depths: tuple[int, ...] = (1, 2)
) -> tuple[np.ndarray, dict[int, np.ndarray], int]:
    """Run `out` over `tokens` tokens of `text`; return the routed ids [layers,
    tokens, k], per depth d layer j+d's router ranking on layer j's MoE input
    [layers - d, tokens, WIDTH], and the expert record's bytes."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    import moestream
    from moestream.bench.routes import moe_blocks

    model, tok = moestream.load(
        out, cache_experts=10**6, record_trace=True, prefetch=False
    )
    blocks = list(moe_blocks(model).values())
    gates = [b.gate for b in blocks]
    seen: list[list[mx.array]] = [[] for _ in blocks]

    class Capture(nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.i = i

        def __call__(self, x: mx.array) -> mx.array:
            seen[self.i].append(x.reshape(-1, x.shape[-1]))
            return gates[self.i](x)

    for i, b in enumerate(blocks):
        b.gate = Capture(i)
    with open(text) as f:
        ids = tok.encode(f.read(8 * tokens))[:tokens]
    cache = make_prompt_cache(model)
    for s in range(0, len(ids), 256):
        mx.eval(model(mx.array([ids[s : s + 256]]), cache=cache))
    routing = moestream.stats(model).routing()
    routed = np.stack([routing[x] for x in sorted(routing)])
    inputs = [mx.concatenate(x) for x in seen]
    width = min(WIDTH, gates[0].weight.shape[0])
    ahead = {}
    for d in depths:
        ahead[d] = np.stack(
            [
                ranked(np.array(gates[j + d](inputs[j]).astype(mx.float32)), width)
                for j in range(len(blocks) - d)
            ]
        )
    rt = moestream.runtime_of(model)
    return routed, ahead, max(x.record_nbytes for x in rt.manifest.layers)


def split(tokens: int, seq_starts: np.ndarray) -> tuple[np.ndarray, list[slice]]:
    """The first half's token indices (to learn from) and the second half's
    sequences (to score on): by sequences when there are several, else by token."""
    if len(seq_starts) > 1:
        bounds = [*seq_starts.tolist(), tokens]
        seqs = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        half = len(seqs) // 2
        return np.arange(seqs[half].start), seqs[half:]
    return np.arange(tokens // 2), [slice(tokens // 2, tokens)]


def predictors(
    ids: np.ndarray, routers: dict[int, np.ndarray], train: np.ndarray
) -> dict[str, dict[int, np.ndarray]]:
    """Per predictor name, per target layer m (from its depth on): its ranking
    [tokens, WIDTH]."""
    layers, _, _ = ids.shape
    experts = int(ids.max()) + 1
    width = min(WIDTH, experts)
    out: dict[str, dict[int, np.ndarray]] = {}
    for d, ahead in sorted(routers.items()):
        out[f"router L+{d}"] = {m: ahead[m - d] for m in range(d, layers)}
    for d in (1, 2):
        name = f"table L+{d}"
        out[name] = {}
        for m in range(d, layers):
            src, dst = ids[m - d].astype(np.int64), ids[m].astype(np.int64)
            table = cooccurrence(src[train], dst[train], experts)
            out[name][m] = ranked(table_scores(table, src), width)
    return out


def score(
    ids: np.ndarray,
    preds: dict[str, dict[int, np.ndarray]],
    seqs: list[slice],
    widths: list[int],
    capacity: int,
    record_bytes: int,
) -> list[dict]:
    layers, _, _ = ids.shape
    experts = int(ids.max()) + 1
    targets = range(2, layers)
    rows = []
    mb = layers * record_bytes / 1e6  # one wasted expert a layer, in MB a token

    def replay(hints_of) -> dict[str, int]:
        total: dict[str, int] = {}
        for m in targets:
            for s in seqs:
                got = prefetch_replay(
                    ids[m][s].astype(np.int64),
                    [h[s] for h in hints_of(m)],
                    capacity,
                    experts,
                )
                for k, v in got.items():
                    total[k] = total.get(k, 0) + v
        return total

    n_tokens = sum(s.stop - s.start for s in seqs) * len(targets)
    for name, by_layer in preds.items():
        for n in widths:
            q = [
                prediction_quality(ids[m][s], by_layer[m][s][:, :n])
                for m in targets
                for s in seqs
            ]
            w = [(s.stop - s.start) for _ in targets for s in seqs]
            mean = {k: float(np.average([x[k] for x in q], weights=w)) for k in q[0]}
            r = replay(lambda m, b=by_layer, n=n: [b[m][:, :n]])
            rows.append(_row(name, n, mean, r, n_tokens, mb))
    k, b = ids.shape[2], preds["router L+1"]
    for early in ("router L+2", "table L+2"):
        a = preds.get(early)
        for n2 in (k // 2, k, k + 2) if a is not None else ():
            r = replay(lambda m, a=a, n2=n2: [a[m][:, :n2], b[m][:, : k + 2]])
            rows.append(
                _row(f"{early} @{n2}, then router L+1", k + 2, None, r, n_tokens, mb)
            )
    return rows


def timelines(
    ids: np.ndarray,
    preds: dict[str, dict[int, np.ndarray]],
    seqs: list[slice],
    capacity: int,
    ratios: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0),
) -> list[dict]:
    """decode_timeline on the scored tokens (a layer's compute 1, a record's
    read `ratio`): no prefetch, router L+1 at k and k+2, and L+2 (router, else
    table) at k/2 and k beside it; time a token and reads a token."""
    k, experts = ids.shape[2], int(ids.max()) + 1
    keep = np.concatenate([np.arange(s.start, s.stop) for s in seqs])
    routed = ids[:, keep].astype(np.int64)
    one = {m: p[keep][:, : k + 2] for m, p in preds["router L+1"].items()}
    two = preds.get("router L+2") or preds["table L+2"]
    name = "router" if "router L+2" in preds else "table"
    exact = {m: p[keep][:, :k] for m, p in preds["router L+1"].items()}
    variants = {
        "no prefetch": {},
        f"router L+1 @{k}": {1: exact},
        f"router L+1 @{k + 2}": {1: one},
    }
    for n2, n1, first in ((k // 2, k, exact), (k // 2, k + 2, one), (k, k + 2, one)):
        variants[f"{name} L+2 @{n2} + router L+1 @{n1}"] = {
            1: first,
            2: {m: p[keep][:, :n2] for m, p in two.items()},
        }
    rows = []
    for label, hints in variants.items():
        for ratio in ratios:
            got = decode_timeline(routed, hints, capacity, experts, ratio)
            rows.append({"variant": label, "read": ratio, **got})
    return rows


def timeline_markdown(rows: list[dict]) -> str:
    ratios = sorted({r["read"] for r in rows})
    head = " | ".join(f"read {x:g}" for x in ratios)
    lines = [f"| a layer's compute 1 | {head} |", "|---" * (len(ratios) + 1) + "|"]
    for label in dict.fromkeys(r["variant"] for r in rows):
        cells = " | ".join(
            f"{r['time_per_token']:.2f} ({r['reads_per_token']:.1f})"
            for r in rows
            if r["variant"] == label
        )
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def victims(trace, capacities: list[int], width: int) -> list[dict]:
    """Hit rates of LRU and LRFU with the plain victim choice, with one that
    spares the experts predicted for the layer's current call (`ahead` of the
    layer before, what the engine holds when it evicts), and with one that
    spares those predicted for its next call (not known yet when it evicts: a
    bound), beside Belady; layers 1.., every sequence from empty slots."""
    from moestream.bench.replay import belady_hits, policy_hits, protected_step_hits

    experts, rows = trace.num_experts, []
    for cap in capacities:
        hits: dict[str, int] = {}
        total = 0
        for m in range(1, trace.layers):
            ahead = trace.ahead[m - 1][:, :width].astype(np.int64)
            for seq, cut in zip(
                trace.sequences(m), np.split(ahead, trace.seq_starts[1:]), strict=True
            ):
                total += sum(len(np.unique(r)) for r in seq)
                nxt = np.concatenate([cut[1:], cut[-1:]])
                for policy in ("lru", "lrfu"):
                    got = {
                        policy: policy_hits(seq, cap, policy, experts),
                        f"{policy}+now": protected_step_hits(
                            seq, cut, cap, policy, experts
                        ).sum(),
                        f"{policy}+next": protected_step_hits(
                            seq, nxt, cap, policy, experts
                        ).sum(),
                    }
                    for k, v in got.items():
                        hits[k] = hits.get(k, 0) + int(v)
                hits["belady"] = hits.get("belady", 0) + belady_hits(seq, cap)
        rows.append({"slots": cap, **{k: v / total for k, v in hits.items()}})
    return rows


def _row(name, n, quality, r, n_tokens, mb) -> dict:
    return {
        "predictor": name,
        "width": n,
        **(quality or {}),
        "miss_recall": r["used"] / max(r["misses"], 1),
        "slot_precision": r["used"] / max(r["hinted"], 1),
        "slot_wasted_mb": (r["hinted"] - r["used"]) / n_tokens * mb,
        "early": r.get("early_0", 0) / max(r["misses"], 1) if "early_1" in r else None,
        "miss_rate_per_token": r["misses"] / n_tokens,
    }


def markdown(rows: list[dict], mb: float) -> str:
    lines = [
        "| predictor | width | recall | precision | wasted / token / layer | "
        "wasted MB / token | slots: miss recall | precision | wasted MB / token | "
        "misses read 2 layers ahead |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        q = (
            f"{r['recall']:.3f} | {r['precision']:.3f} | {r['wasted']:.2f} | "
            f"{r['wasted'] * mb:.2f}"
            if "recall" in r
            else "| | |"
        )
        early = "" if r["early"] is None else f"{r['early']:.3f}"
        lines.append(
            f"| {r['predictor']} | {r['width']} | {q} | {r['miss_recall']:.3f} | "
            f"{r['slot_precision']:.3f} | {r['slot_wasted_mb']:.2f} | {early} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("model")
    m.add_argument("out")
    m.add_argument("text")
    m.add_argument("--tokens", type=int, default=4096)
    m.add_argument("--save-trace", default=None)
    t = sub.add_parser("trace")
    t.add_argument("trace")
    t.add_argument("--record-bytes", type=int, default=MEDIUM_RECORD)
    for q in (m, t):
        q.add_argument("--capacity", type=float, default=25.0)
        q.add_argument("--widths", default=None, help="default: k, k+2, 2k, 4k")
        q.add_argument("--json", action="store_true")
    v = sub.add_parser("victims")
    v.add_argument("trace")
    v.add_argument("--rho", default="2,4", help="slots / top-k, comma-separated")
    v.add_argument("--width", type=int, default=None, help="default: k + 2")
    args = p.parse_args(argv)
    if args.mode == "victims":
        from moestream.bench.routes import load_trace

        trace = load_trace(args.trace)
        if trace.ahead is None:
            sys.exit(f"error: {args.trace} records no `ahead` predictions.")
        k = trace.top_k
        caps = [int(float(r) * k) for r in args.rho.split(",")]
        rows = victims(trace, caps, args.width or k + 2)
        keys = [x for x in rows[0] if x != "slots"]
        print("| slots | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for r in rows:
            print(f"| {r['slots']} | " + " | ".join(f"{r[x]:.3f}" for x in keys) + " |")
        return 0
    if args.mode == "model":
        ids, routers, record_bytes = record(args.out, args.text, args.tokens)
        starts = np.zeros(1, np.int64)
        if args.save_trace:
            from moestream.bench.routes import write_trace

            meta = {"geometry": {"num_experts": int(ids.max()) + 1}}
            write_trace(args.save_trace, ids, starts, meta, ahead=routers[1])
    else:
        from moestream.bench.routes import load_trace

        trace = load_trace(args.trace)
        if trace.ahead is None:
            sys.exit(f"error: {args.trace} records no `ahead` predictions.")
        ids, starts, record_bytes = trace.ids, trace.seq_starts, args.record_bytes
        routers = {1: trace.ahead}
    k, experts = ids.shape[2], int(ids.max()) + 1
    widths = (
        [int(w) for w in args.widths.split(",")]
        if args.widths
        else sorted({k, k + 2, 2 * k, min(4 * k, WIDTH)})
    )
    train, seqs = split(ids.shape[1], starts)
    capacity = max(k, round(args.capacity / 100 * experts))
    preds = predictors(ids, routers, train)
    rows = score(ids, preds, seqs, widths, capacity, record_bytes)
    times = timelines(ids, preds, seqs, capacity)
    mb = ids.shape[0] * record_bytes / 1e6
    if args.json:
        print(json.dumps({"predictions": rows, "timelines": times}, indent=1))
    else:
        print(
            f"{ids.shape[0]} layers, top-{k} of {experts}, {capacity} slots, "
            f"record {record_bytes} B; scored on {sum(s.stop - s.start for s in seqs)}"
            f" tokens x layers 2..{ids.shape[0] - 1}"
        )
        print(markdown(rows, mb))
        print("\ntime a token (reads a token), one disk, a read ahead dropped if late:")
        print(timeline_markdown(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
