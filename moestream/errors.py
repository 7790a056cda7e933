"""User-facing errors: the CLIs print these as one line, without a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import click

T = TypeVar("T")


def user_errors(fn: Callable[[], T]) -> T:
    """Run `fn`; turn the library's ValueError / OSError (ExpertReadError from
    either engine, from inside MLX's evaluation too) into a one-line exit 2."""
    try:
        return fn()
    except (ValueError, OSError) as e:
        # One line, whatever the message: library text may carry newlines.
        click.echo(f"error: {' '.join(str(e).split())}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
