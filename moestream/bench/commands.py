"""moestream bench [run] OUT | bench make-model SCALE OUT | bench replay OUT TEXT
| bench trace TRACE"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import click

from ..errors import user_errors
from ..options import CONTEXT, common_options
from ..units import human_bytes
from .cli import bench as run_cmd
from .llama_cli import beyond_cmd, llama_group


class DefaultGroup(click.Group):
    """A group whose first argument, when it names no subcommand, goes to `run`:
    `moestream bench OUT` stays the bench itself."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings=CONTEXT)
def bench_group() -> None:
    """The benchmark (`bench OUT`, i.e. `bench run OUT`) and its models and replays."""


@click.command(context_settings=CONTEXT)
@click.argument("scale", type=click.Choice(["small", "medium", "large"]))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--export-mlx",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write the same weights as an mlx-lm directory.",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--layout",
    type=click.Choice(["rows", "blocked"]),
    default="rows",
    show_default=True,
    help="Expert records as convert-moe --layout writes them; the same "
    "weights either way (a seed's values, then their layout).",
)
@common_options
def make_model_cmd(
    scale: str, out: Path, export_mlx: Path | None, seed: int, layout: str
) -> None:
    """Write a synthetic Qwen3-MoE benchmark model straight into moestream's
    format.

    small: 16 layers x 64 experts, top-8, hidden 1024; medium: 24 x 128,
    hidden 2048; large: 48 x 256 (more than a 24 GB machine's RAM).
    """
    from .models import SCALES, write_synthetic
    from .models import export_mlx as export

    def run() -> None:
        need = SCALES[scale].expert_bytes() * (2 if export_mlx else 1) * 1.05
        out.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out.parent).free
        if free < need:
            raise OSError(
                f"{scale} needs {human_bytes(int(need))} of disk, "
                f"{human_bytes(free)} free under {out.parent}."
            )
        start = time.perf_counter()
        manifest = write_synthetic(out, SCALES[scale], seed=seed, layout=layout)
        click.echo(
            f"wrote {out}: {human_bytes(manifest.expert_bytes)} of experts in "
            f"{time.perf_counter() - start:.0f} s"
        )
        if export_mlx:
            export(out, export_mlx)
            click.echo(f"wrote {export_mlx} (mlx-lm layout)")

    user_errors(run)


@click.command(context_settings=CONTEXT)
@click.argument("out", type=click.Path(exists=True))
@click.argument("text", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", default=4096, show_default=True, type=int)
@click.option(
    "--offset",
    default=0,
    show_default=True,
    type=int,
    help="Characters of TEXT to skip first.",
)
@click.option(
    "--slots",
    default="8",
    show_default=True,
    help="Capacities to replay, comma-separated.",
)
@click.option(
    "--save-trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the recorded routing as a trace file (.npz) for bench --trace.",
)
@common_options
def replay_cmd(
    out: str, text: str, tokens: int, offset: int, slots: str, save_trace: str | None
) -> None:
    """Cache policies against Belady on OUT's routing over TEXT (teacher-forced):
    the trace is recorded with every expert resident, then replayed through
    the runtime's own slot pool at each capacity."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from .. import runtime
    from ..runtime.pool import POLICIES
    from .replay import belady_hits, policy_hits
    from .routes import write_trace

    def run() -> None:
        model, tok = runtime.load(out, cache_experts=10**6, record_trace=True)
        with open(text) as f:
            f.seek(offset)
            ids = tok.encode(f.read(8 * tokens))[:tokens]
        cache = make_prompt_cache(model)
        for s in range(0, len(ids), 256):
            mx.eval(model(mx.array([ids[s : s + 256]]), cache=cache))
        traces = runtime.stats(model).routing()
        experts = runtime.runtime_of(model).plan.num_experts
        if save_trace:
            routes = np.stack([traces[x] for x in sorted(traces)])
            meta = {"geometry": {"num_experts": experts}, "source": out, "text": text}
            write_trace(save_trace, routes, meta=meta)
        total = sum(len(np.unique(r)) for t in traces.values() for r in t)
        click.echo(f"{len(ids)} tokens, {len(traces)} MoE layers, {experts} experts")
        click.echo("| slots | " + " | ".join(POLICIES) + " | Belady |")
        click.echo("|---" * (len(POLICIES) + 2) + "|")
        for cap in (int(c) for c in slots.split(",")):
            rates = [
                sum(policy_hits(t, cap, name, experts) for t in traces.values()) / total
                for name in POLICIES
            ]
            best = sum(belady_hits(t, cap) for t in traces.values()) / total
            cells = " | ".join(f"{r:.3f}" for r in rates)
            click.echo(f"| {cap} | {cells} | {best:.3f} |")

    user_errors(run)


@click.command(context_settings=CONTEXT)
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--capacities",
    default="5,10,12.5,25,50",
    show_default=True,
    help="Slots per layer, % of its experts (at least top-k), comma-separated.",
)
@click.option("--lrfu-decay", default=0.98, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, not a table.")
@common_options
def trace_cmd(trace: str, capacities: str, lrfu_decay: float, as_json: bool) -> None:
    """LRU, LRFU and Belady hit rates on a recorded routing trace (.npz: layers x
    tokens x k expert ids, e.g. from scripts/train_router.py), each sequence
    from empty slots, and the trace's locality."""
    import json

    from .harness import capacity_for
    from .routes import format_trace_report, load_trace, trace_report

    def run() -> None:
        try:
            pcts = tuple(float(x) for x in capacities.split(","))
        except ValueError:
            raise ValueError(
                f"--capacities {capacities!r} is not like 5,10,25."
            ) from None
        routes = load_trace(trace)
        n, k = routes.num_experts, routes.top_k
        slots = {p: capacity_for(p, n, k) for p in pcts}
        report = trace_report(routes, slots, lrfu_decay)
        click.echo(
            json.dumps(report, indent=1) if as_json else format_trace_report(report)
        )

    user_errors(run)


@click.command(context_settings=CONTEXT)
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokens", default=1024, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@common_options
def uniform_trace_cmd(out: Path, trace: Path, tokens: int, seed: int) -> None:
    """Write a routing trace for OUT's geometry whose every token routes to k
    experts drawn uniformly at random (routing that misses; `--trace` of
    `bench run` and `bench beyond-ram`)."""
    from ..formats import load_manifest
    from .routes import uniform_trace, write_trace

    def run() -> None:
        manifest = load_manifest(out)
        config = json.loads((out / "config.json").read_text())
        n, k = manifest.layers[0].num_experts, config["num_experts_per_tok"]
        ids = uniform_trace(len(manifest.layers), tokens, k, n, seed)
        write_trace(trace, ids, meta={"geometry": {"num_experts": n}, "seed": seed})
        click.echo(f"{trace}: {ids.shape[0]} layers x {tokens} tokens x {k} of {n}")

    user_errors(run)


bench_group.add_command(run_cmd, "run")
bench_group.add_command(make_model_cmd, "make-model")
bench_group.add_command(replay_cmd, "replay")
bench_group.add_command(trace_cmd, "trace")
bench_group.add_command(uniform_trace_cmd, "uniform-trace")
bench_group.add_command(llama_group, "llama-cpp")
bench_group.add_command(beyond_cmd, "beyond-ram")
