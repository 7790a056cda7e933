"""moestream COMMAND: convert, run, bench, verify, serve, chat, info, plan, eval,
plot (convert and run are also convert-moe and run-moe)."""

from __future__ import annotations

import sys

import click

from .bench.commands import bench_group as bench_cmd
from .chat import chat_cmd
from .converter.cli import main as convert_cmd
from .errors import user_errors
from .formats.verify import verify
from .options import CONTEXT, common_options
from .runtime.cli import main as run_cmd
from .serve import serve_cmd
from .tools import eval_cmd, info_cmd, plan_cmd, plot_cmd
from .units import human_bytes


@click.group(context_settings=CONTEXT)
@common_options
def main() -> None:
    """Run Mixture-of-Experts models whose experts do not fit in memory."""


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
        f"{report.layers} layers, {report.experts} experts, "
        f"{human_bytes(report.bytes_read)} of blobs checked"
    )
    if report.ok:
        click.echo(f"OK {model_dir}: {summary}")
        return
    click.echo(f"FAILED {model_dir}: {len(report.problems)} problems; {summary}")
    sys.exit(1)


main.add_command(convert_cmd, "convert")
main.add_command(run_cmd, "run")
main.add_command(bench_cmd, "bench")
main.add_command(verify_cmd, "verify")
main.add_command(serve_cmd, "serve")
main.add_command(chat_cmd, "chat")
# Know before you run, see what happens, quality (moestream/tools.py).
main.add_command(info_cmd, "info")
main.add_command(plan_cmd, "plan")
main.add_command(eval_cmd, "eval")
main.add_command(plot_cmd, "plot")

if __name__ == "__main__":
    main()
