"""moestream plot TRACE -o FIG"""

from __future__ import annotations

import click

from ..errors import user_errors
from ..options import CONTEXT, common_options


@click.command(context_settings=CONTEXT)
@click.argument("trace_file", metavar="TRACE", type=click.Path(exists=True))
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False),
    help="Image file to write (.png, .svg, .pdf).",
)
@common_options
def plot_cmd(trace_file: str, output: str) -> None:
    """Draw a run-moe --trace file: expert use per layer, hit rate and MB read
    per token, beside LRU and Belady replays of the same routing."""
    from ..bench.plot import plot_trace, pyplot
    from ..trace import read_trace

    def run() -> None:
        pyplot()  # a clear error before reading the trace
        plot_trace(read_trace(trace_file), output)

    user_errors(run)
    click.echo(f"wrote {output}")
