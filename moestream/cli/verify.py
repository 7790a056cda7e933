"""moestream verify OUT"""

from __future__ import annotations

import sys

import click

from ..errors import user_errors
from ..formats.verify import verify
from ..options import CONTEXT, common_options
from ..units import count, human_bytes


@click.command(context_settings=CONTEXT)
@click.argument("model_dir", metavar="OUT", type=click.Path())
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@common_options
def verify_cmd(model_dir: str, quiet: bool) -> None:
    """Check every checksum, header and size of a converted model OUT.

    Exit status 0 when intact, 1 when anything is wrong (each problem is named).
    """
    report = user_errors(lambda: verify(model_dir, progress=not quiet))
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    summary = (
        f"{count(report.layers, 'layer')}, {count(report.experts, 'expert')}, "
        f"{human_bytes(report.bytes_read)} of blobs checked"
    )
    if report.ok:
        click.echo(f"OK {model_dir}: {summary}")
        return
    click.echo(
        f"FAILED {model_dir}: {count(len(report.problems), 'problem')}; {summary}"
    )
    sys.exit(1)
