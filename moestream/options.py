"""Command-line options shared by every command.

`engine_options` turns each user field of `RuntimeConfig` into one click
option (`memory_budget` -> `--memory-budget`, a bool -> `--verify/--no-verify`),
with its help taken from the field's entry in RuntimeConfig's docstring, and
adds `--set KEY=VALUE` for the developer's `Tuning` knobs (shown in the bench's
help, hidden in the everyday commands'): run-moe, bench, plan, eval, serve
and chat take the same engine flags from this one place. `common_options`
adds `--version`, `-v` and `--log-level` (`logging_options` with another
default level: serve logs at info, as mlx_lm.server does).
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
    from .runtime.config import ARITHMETICS, BACKENDS, DTYPES, RuntimeConfig

    choices = {"dtype": DTYPES, "backend": BACKENDS, "arithmetic": ARITHMETICS}
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
    """RuntimeConfig's user fields, but `exclude`."""
    from .runtime.config import USER_FIELDS

    return [n for n in USER_FIELDS if n not in exclude]


def parse_settings(items: tuple[str, ...]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> Tuning fields, each value of its field's type."""
    from .runtime.config import TUNING_FIELDS, Tuning

    types = {f.name: f.type.replace(" ", "") for f in fields(Tuning)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in TUNING_FIELDS:
            known = ", ".join(TUNING_FIELDS)
            raise click.BadParameter(
                f"{item!r} is not KEY=VALUE with KEY one of {known}.",
                param_hint="--set",
            )
        out[key] = _typed(key, value.strip(), types[key])
    return out


def _typed(key: str, value: str, kind: str) -> Any:
    if value.lower() in ("none", "auto") and kind.endswith("|None"):
        return None
    try:
        if kind.startswith("bool"):
            return {"true": True, "on": True, "1": True, "false": False,
                    "off": False, "0": False}[value.lower()]  # fmt: skip
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except (KeyError, ValueError):
        what = {"bool": "on or off", "int": "a whole number", "float": "a number"}
        raise click.BadParameter(
            f"{key}={value!r}: give {what[kind.split('|')[0]]}.", param_hint="--set"
        ) from None
    return value


def engine_options(exclude: tuple[str, ...] = (), show_set: bool = False) -> Callable:
    """Add one option per RuntimeConfig user field (but `exclude`) and `--set`;
    the command gets them as one keyword `engine`: the fields given on the
    command line, `tuning` among them when a knob was set."""
    names = engine_fields(exclude)
    options = [_option(f) for f in fields(_runtime()[0]) if f.name in names]
    options.append(
        click.option(
            "--set",
            "tuning_settings",
            multiple=True,
            metavar="KEY=VALUE",
            hidden=not show_set,
            help="A developer knob (moestream.runtime.Tuning), e.g. readers=2 "
            "or engine=python; repeatable.",
        )
    )

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names}
            engine = {n: v for n, v in given.items() if v is not None}
            settings = parse_settings(kwargs.pop("tuning_settings"))
            if settings:  # checked where the command builds its RuntimeConfig
                engine["tuning"] = settings
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
    default: str = "warning", fmt: str = LOG_FORMAT, level_option: bool = False
) -> Callable[[Callable], Callable]:
    """--version and -v (repeatable), and with `level_option` --log-level (any
    case, as mlx_lm.server has it), wired to `logging`; `default` is the
    level when neither is given."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, log_verbose: int, **kw: Any):
            set_log_level(kw.pop("log_level", None), log_verbose, default, fmt)
            return fn(*args, **kw)

        if level_option:
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
