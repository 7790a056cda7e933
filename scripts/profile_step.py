"""Where one decode step's time goes, for mlx-lm's resident model and the streaming one.

    .venv/bin/python scripts/profile_step.py build/bench-small [--steps 20]
        [--prompt 128 | --context 2048]

Two measurements of the same greedy decode steps, side by side in one run:
the plain step (MLX's lazy graph evaluated once, as generation runs it), and
the instrumented step, where every timed module evaluates its inputs before
and its output after it runs, so its own time is known. The parts are
exclusive (a module's time less its timed children's); "untimed" is what the
instrumented step spent outside every part (Python, graph building, the
residual adds); "barriers" is what the evaluations in between cost beyond
the plain step. Parts + untimed = the instrumented step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU

from moestream.reference import resident_from_converted
from moestream.runtime import config_from, load, native
from moestream.runtime.switch import StreamingSwitchGLU

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


class Profiler:
    """Exclusive seconds per part, of the modules it was told about."""

    def __init__(self) -> None:
        self.keys: dict[int, str] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []
        self.on = False

    def call(self, key: str, run: Callable, args: tuple, kwargs: dict) -> object:
        mx.eval([a for a in args if isinstance(a, mx.array)])
        self.stack.append(0.0)  # the children's time
        start = time.perf_counter()
        out = run(*args, **kwargs)
        mx.eval(out)
        spent = time.perf_counter() - start
        children = self.stack.pop()
        self.seconds[key] += spent - children
        if self.stack:
            self.stack[-1] += spent
        return out


def _patch(cls: type, prof: Profiler, method: str = "__call__") -> None:
    original = getattr(cls, method)

    def timed(self: object, *args: object, **kwargs: object) -> object:
        key = prof.keys.get(id(self))
        if not prof.on or key is None:
            return original(self, *args, **kwargs)
        return prof.call(key, original, (self, *args), kwargs)

    setattr(cls, method, timed)


def _key(path: str, module: nn.Module) -> str | None:
    name = path.rpartition(".")[2]
    if isinstance(module, QuantizedSwitchLinear):
        return "expert qmm (gather_qmm)"
    if isinstance(module, SwiGLU):
        return "expert swiglu"
    if isinstance(module, StreamingSwitchGLU):
        return "streaming layer (slot fetch)"
    if isinstance(module, nn.QuantizedLinear):
        if name == "gate":
            return "router qmm"
        if name == "lm_head":
            return "lm_head qmm"
        return "attention qmm (q/k/v/o)"
    if isinstance(module, nn.RMSNorm):
        return "norms"
    if isinstance(module, nn.QuantizedEmbedding | nn.Embedding):
        return "embedding"
    if name == "self_attn":
        return "attention (rope, sdpa, cache)"
    if name == "mlp":
        return "moe block (softmax, top-k, combine)"
    return None


def instrument(model: nn.Module, prof: Profiler) -> None:
    classes = set()
    for path, module in model.named_modules():
        key = _key(path, module)
        if key is not None:
            prof.keys[id(module)] = key
            classes.add(type(module))
        kernel = getattr(module, "_experts", None)
        if isinstance(kernel, native.ExpertKernel):
            prof.keys[id(kernel)] = "expert kernel (gate, up, swiglu, down)"
            classes.add(native.ExpertKernel)
    for cls in classes:
        _patch(cls, prof)


def _step(model: nn.Module, token: mx.array, cache: list) -> mx.array:
    logits = model(token[None], cache=cache)
    return logits[:, -1, :]


def decode(
    model: nn.Module, steps: int, prof: Profiler, prompt: int = 0, context: int = 0
) -> dict:
    """Median seconds of plain and instrumented steps, alternating: decode
    steps (after `context` tokens, in 512-token chunks), or with `prompt`
    tokens, prefills of that many from an empty cache."""
    cache = make_prompt_cache(model)
    history = [(5 * i + 1) % 8000 + 1 for i in range(context)]
    for i in range(0, context, 512):
        mx.eval(_step(model, mx.array(history[i : i + 512]), cache))
    logits = _step(model, mx.array(PROMPT), cache)
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    long = mx.array([(7 * i + 3) % 8000 + 1 for i in range(prompt)])
    plain, timed, untimed = [], [], []
    parts: dict[str, list[float]] = defaultdict(list)
    for i in range(2 * steps + 2):
        instrumented = i % 2 == 1
        prof.seconds.clear()
        prof.on = instrumented
        if prompt:
            cache, token = make_prompt_cache(model), long
        start = time.perf_counter()
        logits = _step(model, token, cache)
        if instrumented:
            token = prof.call("sampling (argmax)", mx.argmax, (logits,), {"axis": -1})
        else:
            token = mx.argmax(logits, axis=-1)
            mx.eval(token)
        spent = time.perf_counter() - start
        prof.on = False
        if i < 2:  # warm-up
            continue
        if instrumented:
            timed.append(spent)
            untimed.append(spent - sum(prof.seconds.values()))
            for k, v in prof.seconds.items():
                parts[k].append(v)
        else:
            plain.append(spent)
    med = statistics.median
    return {
        "plain": med(plain),
        "instrumented": med(timed),
        "untimed": med(untimed),
        "parts": {k: med(v) for k, v in parts.items()},
    }


ORDER = [
    "expert qmm (gather_qmm)",
    "expert swiglu",
    "expert kernel (gate, up, swiglu, down)",
    "streaming layer (slot fetch)",
    "attention qmm (q/k/v/o)",
    "router qmm",
    "lm_head qmm",
    "attention (rope, sdpa, cache)",
    "norms",
    "moe block (softmax, top-k, combine)",
    "embedding",
    "sampling (argmax)",
]


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [
        "| part (ms per step) | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]

    def row(label: str, values: list[float], base: list[float]) -> str:
        cells = [
            f"{v * 1e3:.2f} ({100 * v / b:.0f} %)"
            for v, b in zip(values, base, strict=True)
        ]
        return f"| {label} | " + " | ".join(cells) + " |"

    inst = [r["instrumented"] for r in results.values()]
    for key in ORDER:
        if any(key in r["parts"] for r in results.values()):
            values = [r["parts"].get(key, 0.0) for r in results.values()]
            lines.append(row(key, values, inst))
    lines.append(
        row(
            "untimed (python, graph, adds)",
            [r["untimed"] for r in results.values()],
            inst,
        )
    )
    lines.append(row("**instrumented step**", inst, inst))
    plain = [r["plain"] for r in results.values()]
    lines.append(row("**plain step** (% of instrumented)", plain, inst))
    tps = " | ".join(f"{1 / p:.2f}" for p in plain)
    lines.append(f"| plain steps a second | {tps} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="a converted model (bench make-model)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--variants",
        default="resident,native,native+kernel",
        help="comma list of resident, python, native, native+kernel[:threads], "
        "each engine's optionally @backend (native+kernel@mapped)",
    )
    ap.add_argument(
        "--context",
        type=int,
        default=0,
        help="decode after this many tokens of context (a long cache)",
    )
    ap.add_argument(
        "--prompt",
        type=int,
        default=0,
        help="time prefills of this many tokens (from an empty cache) instead",
    )
    args = ap.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    print(f"load: {uptime.strip()}")
    results = {}
    for variant in args.variants.split(","):
        prof = Profiler()
        if variant == "resident":
            model = resident_from_converted(args.model)
        else:
            name, _, backend = variant.partition("@")  # "@mapped": a backend
            engine, _, kernel = name.partition("+")  # "kernel:N": N threads
            threads = int(kernel.partition(":")[2] or 0)
            cfg = config_from(
                engine=engine,
                cpu_kernel=bool(kernel),
                kernel_threads=threads,
                backend=backend or "auto",
            )
            model, _ = load(args.model, cfg)
        instrument(model, prof)
        results[variant] = decode(model, args.steps, prof, args.prompt, args.context)
        del model
    print(table(results))


if __name__ == "__main__":
    main()
