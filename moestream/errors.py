"""User-facing errors: the CLIs print these as one line, without a traceback."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import TypeVar

import click

T = TypeVar("T")
# The native engine's read errors reach Python through MLX's evaluation as a
# RuntimeError that carries ExpertReadError's words.
NATIVE_READ_ERROR = re.compile(r"(Cannot read expert|Expert) \d+ of layer \d+ ")


def user_errors(fn: Callable[[], T]) -> T:
    """Run `fn`; turn the library's ValueError / OSError into a one-line exit 2."""
    try:
        return fn()
    except (ValueError, OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not NATIVE_READ_ERROR.match(str(e)):
            raise
        # One line, whatever the message: library text may carry newlines.
        click.echo(f"error: {' '.join(str(e).split())}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
