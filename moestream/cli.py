"""moestream COMMAND: convert, run (and the same as convert-moe / run-moe)."""

from __future__ import annotations

import click

from .bench.cli import bench as bench_cmd
from .converter.cli import main as convert_cmd
from .runtime.cli import main as run_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run Mixture-of-Experts models whose experts do not fit in memory."""


main.add_command(convert_cmd, "convert")
main.add_command(run_cmd, "run")
main.add_command(bench_cmd, "bench")

if __name__ == "__main__":
    main()
