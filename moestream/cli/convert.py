"""convert-moe SOURCE OUT"""

from __future__ import annotations

import click

from ..converter.pack import DTYPES, convert
from ..errors import user_errors
from ..formats import LAYOUTS
from ..options import CONTEXT, common_options


@click.command(context_settings=CONTEXT)
@click.argument("source")
@click.argument("out", type=click.Path())
@click.option(
    "--bits",
    default=None,
    help="Bits per expert projection, e.g. gate_proj=4,up_proj=4,down_proj=6; "
    "a layer range as down_proj@0-3=8. Default: 4 for every projection; for an "
    "MLX-quantized source, its own bits (kept without re-quantizing).",
)
@click.option(
    "--q-group-size",
    default=None,
    type=int,
    help="Quantization group size. Default: 64; for an MLX-quantized source, its own.",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="Cast floating weights before quantizing (default: the source's).",
)
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default=None,
    help="Expert records: rows (default), as MLX holds them, for any device; "
    "blocked, 16 rows at a time as the CPU kernel reads them, for CPU runs "
    "(the mapped backend most). A GPU needs rows. Given with a converted "
    "SOURCE, its records are rewritten in this layout.",
)
@click.option("--revision", default=None, help="Hub revision (branch, tag, commit).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--resume",
    is_flag=True,
    help="Finish an interrupted conversion in OUT.partial, reusing verified layers.",
)
@common_options
def main(
    source: str,
    out: str,
    bits: str | None,
    q_group_size: int | None,
    dtype: str | None,
    layout: str | None,
    revision: str | None,
    force: bool,
    resume: bool,
) -> None:
    """Convert SOURCE (hub repo id or local directory) into a moestream model OUT.

    SOURCE may also be a folder convert-moe wrote: OUT is then the same
    model with its expert records in --layout, the other files copied.
    """
    summary = user_errors(
        lambda: convert(
            source,
            out,
            bits=bits,
            q_group_size=q_group_size,
            dtype=dtype,
            revision=revision,
            force=force,
            resume=resume,
            layout=layout,
        )
    )
    for line in summary.lines():
        click.echo(line)


if __name__ == "__main__":
    main()
