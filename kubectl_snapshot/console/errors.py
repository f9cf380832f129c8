"""How errors reach the user: `error:` / `hint:` lines, details indented, exit codes; tracebacks only -v."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kubectl_snapshot.core.errors import SnapshotError, render

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn SnapshotError into the error:/hint: output and its exit code (1 runtime, 2 usage)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context(silent=True)
        verbose = bool(ctx and ctx.find_root().params.get("verbose"))
        try:
            return fn(*args, **kwargs)
        except SnapshotError as e:
            if verbose:
                traceback.print_exc()
            click.echo(render(e), err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
