"""Options every plugin command shares, defined once.

kubectl rejects flags placed before the plugin name, so `--kubeconfig`, `--context`, `-n` and `-v`
are the plugin's own and accepted after any subcommand (`kubectl snapshot pod/x -n team-a -v`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kubectl_snapshot.cli import completion
from kubectl_snapshot.cli.wiring import kube_opts

F = TypeVar("F", bound=Callable[..., Any])
ENV_REPOSITORY = "KUBECTL_SNAPSHOT_REPOSITORY"
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def _store(field: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value not in (None, False, ()):
            setattr(kube_opts(ctx), field, tuple(value) if isinstance(value, list | tuple) else value)
            if field == "verbose":  # console.errors.handle_errors reads it from the root's params
                ctx.find_root().params["verbose"] = True
        return value

    return callback


def common_options(fn: F) -> F:
    """--kubeconfig/--context/-n/-s/--token/--as/--as-group/-v on a command (and on the group), as kubectl
    spells them: the last one given wins."""
    options = [
        click.option(
            "--kubeconfig",
            type=click.Path(dir_okay=False),
            expose_value=False,
            callback=_store("kubeconfig"),
            help="Path to the kubeconfig (default: $KUBECONFIG, ~/.kube/config).",
        ),
        click.option(
            "--context",
            expose_value=False,
            callback=_store("context"),
            shell_complete=completion.contexts,
            help="kubeconfig context to use.",
        ),
        click.option(
            "-n",
            "--namespace",
            expose_value=False,
            callback=_store("namespace"),
            shell_complete=completion.namespaces,
            help="Namespace (default: the context's namespace, else default).",
        ),
        click.option(
            "-s",
            "--server",
            expose_value=False,
            callback=_store("server"),
            help="The address and port of the Kubernetes API server (overrides the kubeconfig's).",
        ),
        click.option(
            "--token",
            expose_value=False,
            callback=_store("token"),
            help="Bearer token for authentication to the API server.",
        ),
        click.option(
            "--as",
            "impersonate",
            expose_value=False,
            callback=_store("impersonate"),
            help="User to impersonate for the operation (e.g. jane, system:serviceaccount:NS:NAME).",
        ),
        click.option(
            "--as-group",
            "impersonate_groups",
            multiple=True,
            expose_value=False,
            callback=_store("impersonate_groups"),
            help="Group to impersonate for the operation (one).",
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


DRY_RUN = ("none", "client", "server")


def dry_run_option(fn: F) -> F:
    """kubectl's --dry-run=none|client|server."""
    return click.option(
        "--dry-run",
        type=click.Choice(DRY_RUN),
        default="none",
        show_default=True,
        help="client: only print what would be sent; server: the API server admits it but persists nothing.",
    )(fn)


def wait_options(fn: F) -> F:
    """--timeout and --no-wait of the commands that wait for what they created."""
    fn = click.option(
        "--timeout", type=Duration(), default="10m", show_default=True, help="How long to wait (e.g. 90s, 10m, 1h)."
    )(fn)
    return click.option("--no-wait", is_flag=True, help="Return once the object is created.")(fn)


def selector_option(fn: F) -> F:
    return click.option(
        "-l",
        "--selector",
        help="Label selector (e.g. -l kubectl-snapshot.io/pod=web,tier!=db), as kubectl takes it.",
    )(fn)


LAZY_HELP = (
    "Lazy restore: the pod runs before its memory is back, pages fetched from the registry as the processes"
    " touch them. If a page cannot be fetched later (the registry must stay reachable until all memory is back),"
    " the container is killed (a LazyRestoreFailed Event) and starts afresh, its restored state lost. Workloads"
    " that must not be killed mid-run stay eager (the default)."
)


def lazy_option(fn: F) -> F:
    """--lazy of the commands that create a restore pod (docs/lazy-restore.md)."""
    return click.option("--lazy", is_flag=True, help=LAZY_HELP)(fn)
