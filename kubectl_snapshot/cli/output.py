"""Machine-readable output: `-o json|yaml`, defined once."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
import yaml

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("text", "json", "yaml")


def output_option(fn: F) -> F:
    return click.option(
        "-o",
        "--output",
        type=click.Choice(FORMATS),
        default="text",
        show_default=True,
        help="Output format.",
    )(fn)


def emit(data: Any, fmt: str, text: Callable[[Any], str]) -> None:
    if fmt == "json":
        click.echo(json.dumps(data, indent=2, sort_keys=False))
    elif fmt == "yaml":
        click.echo(yaml.safe_dump(data, sort_keys=False).rstrip())
    else:
        click.echo(text(data))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
