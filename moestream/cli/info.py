"""moestream info OUT"""

from __future__ import annotations

import json

import click

from ..errors import user_errors
from ..options import CONTEXT, common_options, json_option, model_argument


@click.command(context_settings=CONTEXT)
@model_argument
@json_option
@common_options
def info_cmd(model_dir: str, as_json: bool) -> None:
    """What a converted model OUT holds (reads manifest and config only)."""
    from ..info import format_info, model_info

    info = user_errors(lambda: model_info(model_dir))
    click.echo(json.dumps(info, indent=1) if as_json else format_info(info))
