"""Command-line options shared by every command.

`engine_options` turns each field of `RuntimeConfig` into one click option
(`memory_budget` -> `--memory-budget`, a bool -> `--prefetch/--no-prefetch`),
with its help taken from the field's entry in RuntimeConfig's docstring:
run-moe, bench, plan, eval, serve and chat take the same engine flags from
this one place. `common_options` adds `--version`, `-v` and `--log-level`
(`logging_options` with another default level: serve logs at info, as
mlx_lm.server does).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

import click

from . import __version__

METAVARS = {"memory_budget": "SIZE", "host_budget": "SIZE"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _runtime() -> tuple[type, dict[str, tuple[str, ...]]]:
    """RuntimeConfig and the choices of its fields (imported on use: the
    converter's CLI shares `common_options` and never imports the runtime)."""
    from .runtime.config import DTYPES, ENGINES, POLICIES, RuntimeConfig

    choices = {
        "dtype": DTYPES,
        "policy": tuple(sorted(POLICIES)),
        "engine": ENGINES,
    }
    return RuntimeConfig, choices


def field_help(name: str) -> str:
    """The first sentence of `name`'s entry in RuntimeConfig's docstring (up to
    its first full stop outside parentheses)."""
    doc = _runtime()[0].__doc__ or ""
    m = re.search(rf"^\s+{name}: (.*?)(?=^\s+\w+: |\Z)", doc, re.M | re.S)
    if m is None:
        raise KeyError(f"RuntimeConfig's docstring does not describe {name}")
    text = " ".join(m.group(1).split())
    depth = 0
    for i, c in enumerate(text):  # the first "." outside parentheses
        depth += (c == "(") - (c == ")")
        if depth == 0 and c == "." and text[i + 1 : i + 2] in ("", " "):
            text = text[:i]
            break
    return text[:1].upper() + text[1:] + "."


def _option(f: Any) -> Callable:
    """One click option for RuntimeConfig field `f`; None means not given."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not MISSING else None
    shown = "" if default is None else f" [default: {default}]"
    kind = f.type.replace(" ", "")
    help_text = field_help(f.name) + shown
    if kind in ("bool", "bool|None"):
        shown = {True: "on", False: "off", None: "auto"}[default]
        return click.option(
            f"{flag}/--no-{flag[2:]}",
            f.name,
            default=None,
            help=f"{field_help(f.name)} [default: {shown}]",
        )
    choices = _runtime()[1]
    if f.name in choices:
        return click.option(
            flag, f.name, type=click.Choice(choices[f.name]), help=help_text
        )
    types = {
        "int": int,
        "int|None": int,
        "float": float,
        "float|None": float,
        "str": str,
        "str|None": str,
        "int|str|None": str,
    }
    if kind not in types:
        raise TypeError(f"No command-line type for RuntimeConfig.{f.name}: {f.type}")
    return click.option(
        flag,
        f.name,
        type=types[kind],
        metavar=METAVARS.get(f.name, {int: "N", float: "X"}.get(types[kind], "TEXT")),
        help=help_text,
    )


def engine_fields(exclude: tuple[str, ...] = ()) -> list[str]:
    return [f.name for f in fields(_runtime()[0]) if f.name not in exclude]


def engine_options(exclude: tuple[str, ...] = ()) -> Callable:
    """Add one option per RuntimeConfig field (but `exclude`); the command gets
    them as one keyword `engine`: the fields given on the command line."""
    names = engine_fields(exclude)
    options = [_option(f) for f in fields(_runtime()[0]) if f.name in names]

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names}
            engine = {n: v for n, v in given.items() if v is not None}
            return fn(*args, engine=engine, **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper

    return decorate


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def set_log_level(
    level: str | None,
    verbose: int,
    default: str = "warning",
    fmt: str = LOG_FORMAT,
) -> None:
    """`--log-level` wins; else -v is info and -vv debug; else `default`."""
    name = level or {0: default, 1: "info"}.get(verbose, "debug")
    logging.basicConfig(level=getattr(logging, name.upper()), format=fmt, force=True)


def logging_options(
    default: str = "warning", fmt: str = LOG_FORMAT
) -> Callable[[Callable], Callable]:
    """--version, -v (repeatable) and --log-level (any case), wired to
    `logging`; `default` is the level when neither is given."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, log_verbose: int, log_level: str | None, **kw: Any):
            set_log_level(log_level, log_verbose, default, fmt)
            return fn(*args, **kw)

        wrapper = click.option(
            "--log-level",
            type=click.Choice(LOG_LEVELS, case_sensitive=False),
            default=None,
            help=f"Logging level (default: {default}).",
        )(wrapper)
        wrapper = click.option(
            "-v",
            "log_verbose",
            count=True,
            help="Log more: -v info (memory plan, reads), -vv debug.",
        )(wrapper)
        return click.version_option(__version__, "--version", prog_name="moestream")(
            wrapper
        )

    return decorate


# Every command but serve: warnings only, unless asked.
common_options = logging_options()


CONTEXT = {"help_option_names": ["-h", "--help"]}

# The converted model most commands take, and their --json.
model_argument = click.argument("model_dir", metavar="OUT", type=click.Path())
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object."
)
