"""Options every plugin command shares, defined once.

kubectl rejects flags placed before the plugin name, so `--kubeconfig`, `--context`, `-n` and `-v`
are the plugin's own and accepted after any subcommand (`kubectl snapshot pod/x -n team-a -v`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
ENV_REPOSITORY = "KUBECTL_SNAPSHOT_REPOSITORY"
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s?)?$")


@dataclass
class KubeOpts:
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None
    verbose: bool = False


def kube_opts(ctx: click.Context) -> KubeOpts:
    root = ctx.find_root()
    opts = root.meta.setdefault("kubectl_snapshot.opts", KubeOpts())
    assert isinstance(opts, KubeOpts)
    return opts


def _store(field: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value not in (None, False):
            setattr(kube_opts(ctx), field, value)
            if field == "verbose":  # cli.errors.handle_errors reads it from the root's params
                ctx.find_root().params["verbose"] = True
        return value

    return callback


def common_options(fn: F) -> F:
    """--kubeconfig/--context/-n/-v on a command (and on the group): the last one given wins."""
    options = [
        click.option(
            "--kubeconfig",
            type=click.Path(dir_okay=False),
            expose_value=False,
            callback=_store("kubeconfig"),
            help="Path to the kubeconfig (default: $KUBECONFIG, ~/.kube/config).",
        ),
        click.option("--context", expose_value=False, callback=_store("context"), help="kubeconfig context to use."),
        click.option(
            "-n",
            "--namespace",
            expose_value=False,
            callback=_store("namespace"),
            help="Namespace (default: the context's namespace, else default).",
        ),
        click.option(
            "-v",
            "--verbose",
            is_flag=True,
            expose_value=False,
            callback=_store("verbose"),
            help="Tracebacks on errors.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


class Duration(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """`90`, `90s`, `10m`, `1h30m` -> seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip()
        m = _DURATION.match(text)
        if not text or not m or not any(m.groups()):
            self.fail(f"{value!r} is not a duration (use e.g. 90s, 10m, 1h)", param, ctx)
        h, mnt, s = m.groups()
        seconds = int(h or 0) * 3600 + int(mnt or 0) * 60 + float(s or 0)
        if seconds <= 0:
            self.fail("the timeout must be positive", param, ctx)
        return seconds


def repository_default() -> str | None:
    return os.environ.get(ENV_REPOSITORY) or None
