"""Builds of the native extension, or whole checkouts, side by side on a
converted model: decode and prefill tok/s, each in a fresh process per
round, rounds interleaved, medians; every variant's tokens and prefill
logits compared.

    .venv/bin/python scripts/kernel_ab.py build/bench-small \
        --variants build/native-base.so,build/native-new.so \
        [--rounds 3] [--tokens 32] [--prompt-tokens 128,1024] [--pct 100] \
        [--context 2048]

A variant is a built module (.so), which each child loads as
moestream._native before the runtime imports it, or a checkout's directory
(its moestream, with its own built extension, first on the child's
PYTHONPATH: Python and kernels of two commits side by side). The child
loads the model with `--pct` of each layer's experts in
slots and the CPU kernel on, decodes `--tokens` sampled tokens (temperature
1, the same seed in every process, so routing varies from token to token but
not from build to build) after a 16-token prompt with mlx-lm's
generate_step (as run-moe does: each step's graph built while the last one
runs), with `--context N` the same after an N-token prompt too (a long
cache), and times a prefill of each `--prompt-tokens` length. Each round
starts one build later than the last. A build's tokens or logits that
differ from the first build's are reported: builds of an exact kernel agree
bit for bit.

After a colon a variant takes flags joined by `+`: `mapped` runs the mapped
backend (no slots; `--pct` unused), `no-verify` skips the records'
checksums (a mapped record's is checked the first time a call routes it),
`no-prefetch` turns the next layer's prediction off, `no-fills` reads a
miss into its slot instead of leaving it to the kernel, `trace` records the
routing trace (as `moestream bench` does),
`model=DIR` another conversion of the
same weights (e.g. `convert-moe --layout blocked`), so that two layouts of
the records run side by side, and `KEY=VALUE` sets a numeric Tuning field
(e.g. `kernel_spin_us=0`):

    --variants X.so:mapped,X.so:mapped+model=build/bench-small-blocked
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path


def child(
    variant: str,
    model_dir: str,
    pct: float,
    tokens: int,
    prompts: list[int],
    context: int,
) -> dict:
    so, _, flag = variant.partition(":")
    flags = dict(f.partition("=")[::2] for f in flag.split("+") if f)
    model_dir = flags.get("model") or model_dir
    if not Path(so).is_dir():  # a checkout is on PYTHONPATH already
        spec = importlib.util.spec_from_file_location("moestream._native", so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["moestream._native"] = module
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from moestream.formats import load_manifest
    from moestream.runtime import Tuning, load, loader, native

    if "mlx-attention" in flag:  # builds before the kernel's attention
        loader.use_exact_attention = lambda model, plan: 0
    if "mlx-norm" in flag:  # builds before the kernel's RMS norm
        native.norm_matches_mlx = lambda: False

    experts = load_manifest(Path(model_dir)).layers[0].num_experts
    options = {"cpu_kernel": True, "verify": "no-verify" not in flags}
    if "no-prefetch" in flags:
        options["prefetch"] = False
    if "trace" in flags:  # as moestream bench loads
        options["record_trace"] = True
    for f in fields(Tuning):  # a Tuning field's number: KEY=VALUE
        default = getattr(Tuning, f.name)
        if f.name not in flags:
            continue
        if isinstance(default, bool) or not isinstance(default, int | float):
            raise SystemExit(f"{f.name}: only numeric Tuning fields take a value here")
        options[f.name] = type(default)(flags[f.name])
    if "mapped" in flags:
        model, _ = load(Path(model_dir), backend="mapped", **options)
    else:
        slots = max(8, round(experts * pct / 100))
        model, _ = load(Path(model_dir), cache_experts=slots, **options)
    if "no-fills" in flags:  # misses read into their slots, not filled by the kernel
        for _, m in model.named_modules():
            if hasattr(m, "_engine") and hasattr(m._engine, "cache"):
                m._engine.cache.fill_in_kernel = False
                m._experts.fills = None
    out: dict = {"prefill": {}, "digest": {}}
    for p in prompts:
        prompt = mx.array([(7 * i + 3) % 8000 + 1 for i in range(p)])[None]
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        logits = model(prompt, cache=cache)[:, -1]
        mx.eval(logits)
        out["prefill"][p] = p / (time.perf_counter() - start)
        out["digest"][p] = hashlib.sha256(bytes(memoryview(logits))).hexdigest()[:16]
    # as run-moe decodes: mlx-lm's generate_step, one step computed ahead
    for key, before in (("decode", 0), ("context", context)):
        if key == "context" and not context:
            continue
        mx.random.seed(0)
        prompt = [(5 * i + 1) % 8000 + 1 for i in range(before)] + list(range(1, 17))
        steps = generate_step(
            mx.array(prompt), model, max_tokens=tokens + 1, sampler=make_sampler(1.0)
        )
        next(steps)  # the prompt and the first token
        start = time.perf_counter()
        drawn = [int(t) for t, _ in steps]
        out[key] = len(drawn) / (time.perf_counter() - start)
        out.setdefault("tokens", []).extend(drawn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument(
        "--variants", required=True, help="comma list of built modules (.so)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", default="")
    ap.add_argument("--pct", type=float, default=100)
    ap.add_argument(
        "--context", type=int, default=0, help="decode after this long a prompt too"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompt_tokens.split(",") if p]
    if args.child:
        res = child(
            args.child, args.model, args.pct, args.tokens, prompts, args.context
        )
        print(json.dumps(res))
        return
    names = args.variants.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    load = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    for r in range(args.rounds):
        for so in names[r % len(names) :] + names[: r % len(names)]:  # rotated
            cmd = [
                sys.executable,
                __file__,
                args.model,
                "--variants",
                so,
                "--child",
                so,
            ]
            cmd += ["--tokens", str(args.tokens), "--pct", str(args.pct)]
            cmd += ["--prompt-tokens", args.prompt_tokens]
            cmd += ["--context", str(args.context)]
            env = dict(os.environ)
            if Path(so).is_dir():  # a checkout: its moestream first
                env["PYTHONPATH"] = os.pathsep.join(
                    [str(Path(so).resolve()), env.get("PYTHONPATH", "")]
                )
            done = subprocess.run(
                cmd, capture_output=True, text=True, check=True, env=env
            )
            runs[so].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load.append(
        subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    )
    table(names, runs, prompts, args.pct, args.context)
    print("load before/after:", *load, sep="\n  ")


def table(
    names: list[str],
    runs: dict[str, list[dict]],
    prompts: list[int],
    pct: float,
    context: int,
) -> None:
    first = runs[names[0]][0]
    keys = ["decode"] + (["context"] if context else [])
    heads = "".join(
        f" decode after {context} tok/s | x first |" for k in keys if k == "context"
    )
    heads += "".join(f" prefill {p} tok/s | x first |" for p in prompts)
    print(
        f"| variant ({pct:.0f} % slots) | decode tok/s | x first |{heads} same output |"
    )
    print("|---" * (2 + 2 * len(keys) + 2 * len(prompts)) + "|")
    for n in names:
        rs = runs[n]
        so, _, flag = n.partition(":")
        label = Path(so).name.replace("_native.", "") + (f" {flag}" if flag else "")
        row = f"| {label} |"
        for k in keys:
            dec = statistics.median(r[k] for r in rs)
            base = statistics.median(r[k] for r in runs[names[0]])
            row += f" {dec:.2f} | {dec / base:.2f} |"
        for p in prompts:
            f = statistics.median(r["prefill"][str(p)] for r in rs)
            f0 = statistics.median(r["prefill"][str(p)] for r in runs[names[0]])
            row += f" {f:.1f} | {f / f0:.2f} |"
        same = all(
            r["tokens"] == first["tokens"] and r["digest"] == first["digest"]
            for r in rs
        )
        print(f"{row} {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
