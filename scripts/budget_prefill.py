"""The first prefill of a fresh process under the least memory budget that
holds its slots, as `moestream bench` times it: tok/s, the page faults it
took and the process's peak RSS, for checkouts side by side.

    .venv/bin/python scripts/budget_prefill.py build/bench-small \
        --variants ../before,. [--cases 1024:64,128:64,1024:16] [--rounds 3] \
        [--backend auto|slots|mapped] [--in-order]

A variant is a checkout's directory (its moestream, with its own built
extension, first on the child's PYTHONPATH). A case is prompt tokens and
slots a layer; the budget is `budget_for` at a context of the prompt plus 9
(the bench's 8 decoded tokens and one), the prompt the bench's text, the
trace recorded (as the bench loads). `--backend slots` (the default)
asks for the slots by count, as before; `auto` and `mapped` give the budget
alone (mapped by default under a budget over blocked records). `--in-order`
drops each blob from the page cache and reads it again in order first, as a
user's copy leaves it (the page cache may then hold it in large folios,
which one fault maps whole). Each round runs every case of every variant in
a fresh process, variants in turn; the table gives each round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def child(model: str, tokens: int, slots: int, backend: str, in_order: bool) -> str:
    import resource
    import time

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_tokenizer

    from moestream.bench.worker import prompt_ids
    from moestream.runtime import RuntimeConfig, load
    from moestream.runtime.loader import budget_for

    path = Path(model)
    if in_order:
        from moestream.bench.sysio import read_in_order
        from moestream.formats import load_manifest

        for layer in load_manifest(path).layers:
            read_in_order(path / layer.file)
    context = tokens + 9
    budget = budget_for(path, slots, context)
    options = RuntimeConfig().with_options(
        backend=backend,
        cache_experts=slots if backend == "slots" else None,
        memory_budget=budget,
        context=context,
        record_trace=True,
    )
    tokenizer = load_tokenizer(path)
    model_, _ = load(path, options, tokenizer=tokenizer)
    prompt = mx.array(prompt_ids(tokenizer, tokens))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    steps = generate_step(prompt, model_, max_tokens=9)
    next(steps)
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - usage.ru_minflt
    for _ in steps:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    return f"{tokens / seconds:.1f} {faults} {peak} {budget >> 20}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--variants", required=True, help="comma list of checkouts")
    ap.add_argument("--cases", default="1024:64,128:64,1024:16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="slots", choices=("auto", "slots", "mapped"))
    ap.add_argument(
        "--in-order", action="store_true", help="read the blobs in order first"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tokens, slots = (int(v) for v in args.child.split(":"))
        print(child(args.model, tokens, slots, args.backend, args.in_order))
        return
    names = args.variants.split(",")
    cases = args.cases.split(",")
    rows: dict[tuple[str, str], list[list[str]]] = {}
    for _ in range(args.rounds):
        for name in names:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(name).resolve()), env.get("PYTHONPATH", "")]
            )
            for case in cases:
                cmd = [sys.executable, __file__, args.model, "--variants", name]
                cmd += ["--backend", args.backend] + ["--in-order"] * args.in_order
                done = subprocess.run(
                    [*cmd, "--child", case],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                out = done.stdout.strip().splitlines()[-1].split()
                rows.setdefault((case, name), []).append(out)
    heads = "tok/s (rounds) | page faults | peak RSS MB | budget MB"
    print(f"| prompt:slots | variant | {heads} |")
    print("|---|---|---|---|---|---|")
    for (case, name), runs in rows.items():
        rates = " / ".join(r[0] for r in runs)
        faults = " / ".join(f"{int(r[1]) // 1000} k" for r in runs)
        peaks = " / ".join(r[2] for r in runs)
        print(f"| {case} | {name} | {rates} | {faults} | {peaks} | {runs[0][3]} |")


if __name__ == "__main__":
    main()
