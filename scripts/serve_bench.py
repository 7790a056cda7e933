"""Hit rate and tok/s of `moestream serve` at 1, 2 and 4 concurrent requests.

    python scripts/serve_bench.py build/bench-small --cache-experts 32 \
        --decode-concurrency 4 --tokens 24

Starts the server (any extra flags go to it), warms it with one request, then
for each concurrency sends that many greedy completions of distinct prompts at
once (`--repeats` rounds) and reads /metrics before and after each: tok/s of
all requests together and of each (a request's tokens over its whole time,
prefill and waiting included; medians over the rounds), the experts' hit rate
and MB read per generated token (over all rounds, short prefills included).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = [
    "def read_config(path):",
    "class LRUCache:",
    "import os\nimport sys\n",
    "for i in range(10):",
    "def quicksort(xs):",
    "with open(path) as f:",
    "try:\n    import json",
    "async def fetch(url):",
]


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream", "serve", *argv, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        m = re.search(r"at (http://\S+)/v1 ", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {
        name: float(value)
        for name, value in (
            line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#"
        )
    }


def complete(url: str, prompt: str, tokens: int) -> tuple[int, float]:
    body = {"model": "default_model", "prompt": prompt, "max_tokens": tokens}
    body["temperature"] = 0.0
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as r:
        usage = json.loads(r.read())["usage"]
    return usage["completion_tokens"], time.perf_counter() - start


def round_(url: str, n: int, tokens: int, offset: int) -> dict:
    prompts = [PROMPTS[(offset + i) % len(PROMPTS)] for i in range(n)]
    before = metrics(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        done = list(pool.map(lambda p: complete(url, p, tokens), prompts))
    wall = time.perf_counter() - start
    after = metrics(url)

    def delta(k: str) -> float:
        return after[f"moestream_{k}"] - before[f"moestream_{k}"]

    generated = sum(t for t, _ in done)
    return {
        "concurrent": n,
        "tokens": generated,
        "wall_s": wall,
        "tok_s": generated / wall,
        "per_request_tok_s": sum(t / s for t, s in done) / n,
        "hits": delta("expert_hits_total"),
        "misses": delta("expert_misses_total"),
        "bytes_read": delta("expert_bytes_read_total"),
    }


def summary(rounds: list[dict]) -> dict:
    hits = sum(r["hits"] for r in rounds)
    routed = hits + sum(r["misses"] for r in rounds)
    tokens = sum(r["tokens"] for r in rounds)
    return {
        "concurrent": rounds[0]["concurrent"],
        "tok_s": statistics.median(r["tok_s"] for r in rounds),
        "per_request_tok_s": statistics.median(r["per_request_tok_s"] for r in rounds),
        "hit_rate": hits / routed if routed else 0.0,
        "mb_per_token": sum(r["bytes_read"] for r in rounds) / tokens / 1e6,
        "rounds": rounds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--repeats", type=int, default=1)
    a, serve_flags = p.parse_known_args()
    proc, url = start([a.out, "--log-level", "WARNING", *serve_flags])
    try:
        complete(url, "warm up", 4)
        rows = [
            summary([round_(url, int(n), a.tokens, i + j) for j in range(a.repeats)])
            for i, n in enumerate(a.concurrency.split(","))
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(
        "| concurrent requests | tok/s, all | tok/s, each | hit rate | MB read / tok |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrent']} | {r['tok_s']:.2f} | {r['per_request_tok_s']:.2f} "
            f"| {r['hit_rate']:.3f} | {r['mb_per_token']:.2f} |"
        )
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
