"""moestream COMMAND: convert, run, bench, verify, serve, chat, info, plan, eval,
plot (convert and run are also convert-moe and run-moe)."""

from __future__ import annotations

import click

from ..bench.commands import bench_group as bench_cmd
from ..options import CONTEXT, common_options
from .chat import chat_cmd
from .convert import main as convert_cmd
from .eval import eval_cmd
from .info import info_cmd
from .plan import plan_cmd
from .plot import plot_cmd
from .run import main as run_cmd
from .serve import serve_cmd
from .verify import verify_cmd


@click.group(context_settings=CONTEXT)
@common_options
def main() -> None:
    """Run Mixture-of-Experts models whose experts do not fit in memory."""


main.add_command(convert_cmd, "convert")
main.add_command(run_cmd, "run")
main.add_command(bench_cmd, "bench")
main.add_command(verify_cmd, "verify")
main.add_command(serve_cmd, "serve")
main.add_command(chat_cmd, "chat")
main.add_command(info_cmd, "info")
main.add_command(plan_cmd, "plan")
main.add_command(eval_cmd, "eval")
main.add_command(plot_cmd, "plot")

if __name__ == "__main__":
    main()
