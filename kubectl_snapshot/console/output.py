"""Output formats, defined once, spelled as kubectl spells them: `-o wide|name|json|yaml|jsonpath=TEMPLATE`
(and `text`, the default human form)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from kubectl_snapshot.console.formats import FORMATS, formatted
from kubectl_snapshot.core import jsonpath
from kubectl_snapshot.core.errors import InvalidArgument

F = TypeVar("F", bound=Callable[..., Any])


class OutputFormat(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    name = "format"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if text in ("text", "wide", "name", "json", "yaml"):
            return text
        for prefix in ("jsonpath=", "jsonpath-as-json="):
            if text.startswith(prefix):
                if not text[len(prefix) :]:
                    self.fail(f"{prefix} needs a template, e.g. -o 'jsonpath={{.metadata.name}}'", param, ctx)
                try:
                    jsonpath.parse(text[len(prefix) :])  # a bad template is a usage error before any call
                except InvalidArgument as e:
                    self.fail(e.message, param, ctx)
                return text
        self.fail(f"{text!r} is not one of {', '.join(FORMATS)}", param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        values = ("text", "wide", "name", "json", "yaml", "jsonpath=")
        return [CompletionItem(v) for v in values if v.startswith(incomplete)]


def output_option(fn: F) -> F:
    return click.option(
        "-o",
        "--output",
        type=OutputFormat(),
        default="text",
        show_default=True,
        help="Output format: text, wide, name, json, yaml, jsonpath=TEMPLATE (kubectl's JSONPath).",
    )(fn)


def emit(data: Any, fmt: str, text: Callable[[Any], str], **forms: Callable[[Any], str] | None) -> None:
    """Print `data` in `fmt` (console/formats.py `formatted`: `wide=`, `name=` forms)."""
    click.echo(formatted(data, fmt, text, **forms), nl=False)
