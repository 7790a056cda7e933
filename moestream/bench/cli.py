"""moestream bench OUT"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import user_errors
from ..options import common_options, engine_options
from ..runtime.config import TUNING_FIELDS, USER_FIELDS, RuntimeConfig
from .harness import BenchConfig, main
from .plot import plot_bench, pyplot


def _value(text: str) -> object:
    """A RuntimeConfig value written on the command line."""
    low = text.strip().lower()
    if low in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[low]
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    return text.strip()


def parse_compare(text: str) -> tuple[str, dict]:
    """`prefetch=false,policy=lru` -> (that label, RuntimeConfig or Tuning fields)."""
    known = set(USER_FIELDS + TUNING_FIELDS)
    out = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or name not in known:
            raise click.BadParameter(
                f"{part!r} is not FIELD=VALUE with a RuntimeConfig or Tuning field "
                f"({', '.join(sorted(known))})."
            )
        out[name] = _value(value)
    return text, out


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list like 100,25,12.5.") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--budgets",
    default="100,50,25,12.5,10",
    show_default=True,
    help="Expert budgets, % of each layer's experts held in slots.",
)
@click.option("--modes", default="warm,cold", show_default=True)
@click.option("--tokens", default=32, show_default=True, help="Decode tokens per run.")
@click.option(
    "--prompt-tokens",
    default=512,
    show_default=True,
    help="Prompt length of the prefill runs (0: no prefill runs).",
)
@click.option("--repeats", default=3, show_default=True, help="Decode runs per row.")
@click.option("--prefill-repeats", default=1, show_default=True)
@click.option(
    "--compare",
    multiple=True,
    metavar="FIELD=VALUE[,...]",
    help="Also run every budget with these RuntimeConfig fields changed, side by "
    "side in the same repeats (repeatable), e.g. --compare prefetch=false.",
)
@click.option("--no-verify-cost", is_flag=True, help="Skip the no-checksum row.")
@click.option(
    "--reference",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="mlx-lm directory of the same weights (default: stack OUT's experts).",
)
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A routing trace (.npz, layers x tokens x k ids) that every MoE block "
    "routes by instead of its router; reads and kernels stay real, prefetch "
    "predicts as the trace recorded (`ahead`), or is off.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, not a table.")
@click.option(
    "--plot",
    "plot_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also draw the table's ratios into this image (needs moestream[plot]).",
)
@engine_options(exclude=("memory_budget", "cache_experts", "context"), show_set=True)
@common_options
def bench(
    out: str,
    budgets: str,
    modes: str,
    tokens: int,
    prompt_tokens: int,
    repeats: int,
    prefill_repeats: int,
    compare: tuple[str, ...],
    no_verify_cost: bool,
    reference: str | None,
    trace: str | None,
    as_json: bool,
    plot_file: str | None,
    engine: dict,
) -> None:
    """Decode and prefill speed, hit rates and memory vs mlx-lm resident."""

    variants = tuple(parse_compare(c) for c in compare)

    def run() -> None:
        cfg = BenchConfig(
            out=Path(out),
            budgets=_floats(budgets),
            modes=tuple(m.strip() for m in modes.split(",")),
            decode_tokens=tokens,
            prompt_tokens=prompt_tokens,
            repeats=repeats,
            prefill_repeats=prefill_repeats,
            runtime=RuntimeConfig(**engine),
            verify_cost=not no_verify_cost,
            compare=variants,
            reference=Path(reference) if reference else None,
            trace=Path(trace) if trace else None,
        )
        if plot_file:
            pyplot()  # a clear error before the runs, not after
        result = main(cfg, as_json)
        if plot_file:
            plot_bench(result, plot_file)

    user_errors(run)
