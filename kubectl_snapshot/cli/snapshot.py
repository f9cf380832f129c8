"""`kubectl snapshot pod/NAME --to REGISTRY/REPO[:TAG]`: take a snapshot (create a PodSnapshot and wait)."""

from __future__ import annotations

import os
from typing import Any

import click

from kubectl_snapshot.app.ports import Kube
from kubectl_snapshot.app.snapshot import SnapshotRequest, snapshot_body, start_snapshot, wait_snapshot
from kubectl_snapshot.cli import completion, wiring
from kubectl_snapshot.cli.params import ENV_REPOSITORY, common_options, dry_run_option, repository_default, wait_options
from kubectl_snapshot.cli.watch_progress import RemoteProgress
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.podspec import destination, parse_pod_arg
from kubectl_snapshot.core.status import read as snapshot_status

COMMAND = "pod"  # the root routes `kubectl snapshot pod/NAME` (any word that is no command) here

MEMORY_NOTICE = (
    "note: a snapshot holds the pod's memory, and so every secret the pod has read (tokens, passwords, "
    "keys). It is protected by who can read the repository, by the agents' signature (a restore verifies "
    "it and refuses another namespace unless that namespace granted it), and it stores no environment "
    "variables outside memory. Treat read access to the repository like access to the pod. "
    "(Shown once; docs/security.md, Provenance.)"
)


def snapshot_name(d: dict[str, Any]) -> str:
    """`-o name`, as kubectl prints it: kind.group/name."""
    return f"{K.SINGULAR}.{K.GROUP}/{d['metadata']['name']}"


def snapshot_options(fn: Any) -> Any:
    """The destination and capture flags `pod/NAME` and `migrate` share."""
    opts = [
        click.option(
            "--to",
            "to",
            default=repository_default,
            show_default=f"${ENV_REPOSITORY}",
            help="Destination REGISTRY/REPO[:TAG] (default tag: the snapshot's timestamp).",
        ),
        click.option("--registry-secret", help="dockerconfigjson Secret in the namespace, used by the agent to push."),
        click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry."),
        click.option("--no-volumes", is_flag=True, help="Do not capture emptyDir volumes."),
        click.option(
            "--ignore-liveness",
            is_flag=True,
            help="Snapshot even if the freeze may outlast a liveness probe (a container may be restarted).",
        ),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _require_to(to: str | None) -> str:
    """The destination, checked before anything talks to the cluster."""
    if not to:
        raise InvalidArgument(
            "no destination repository",
            hint=f"pass --to REGISTRY/REPO (e.g. --to 127.0.0.1:5000/snapshots/web) or set ${ENV_REPOSITORY}",
        )
    destination(to, "latest")
    return to


def memory_notice() -> None:
    """Say once per user, plainly, what a snapshot holds; a stamp file remembers it was said."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    stamp = os.path.join(base, "kubectl-snapshot", "memory-notice-shown")
    if os.path.exists(stamp):
        return
    click.echo(MEMORY_NOTICE, err=True)
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write("shown\n")
    except OSError:
        pass  # read-only home: said again next time, which is better than never


def snapshot_request(
    target: str,
    to: str | None,
    *,
    stop: bool,
    registry_secret: str | None,
    insecure: bool,
    no_volumes: bool,
    ignore_liveness: bool,
) -> tuple[Kube, SnapshotRequest]:
    """The snapshot `pod/NAME --to ...` asks for (arguments checked before the API server is contacted)."""
    pod = parse_pod_arg(target)
    repository = _require_to(to)
    kube = wiring.kube_client()
    req = SnapshotRequest(
        namespace=wiring.namespace_of(kube),
        pod=pod,
        repository=repository,
        registry_secret=registry_secret,
        insecure=insecure,
        stop=stop,
        include_volumes=not no_volumes,
        ignore_liveness=ignore_liveness,
    )
    return kube, req


@click.command(COMMAND)
@common_options
@snapshot_options
@click.option("--stop", is_flag=True, help="Stop the pod's containers once the snapshot is pushed.")
@wait_options
@dry_run_option
@output_option
@click.argument("target", metavar="pod/NAME", shell_complete=completion.pods)
@handle_errors
def pod_cmd(
    target: str,
    to: str | None,
    registry_secret: str | None,
    insecure: bool,
    no_volumes: bool,
    ignore_liveness: bool,
    stop: bool,
    no_wait: bool,
    timeout: float,
    dry_run: str,
    output: str,
) -> None:
    """Snapshot a running pod: `kubectl snapshot pod/NAME --to REGISTRY/REPO[:TAG]`."""
    kube, req = snapshot_request(
        target, to, stop=stop, registry_secret=registry_secret, insecure=insecure, no_volumes=no_volumes,
        ignore_liveness=ignore_liveness,
    )  # fmt: skip
    ns, pod = req.namespace, req.pod
    if dry_run != "none":
        body = snapshot_body(req, kube=kube) if dry_run == "client" else start_snapshot(req, kube=kube, dry_run=True)
        name = body["metadata"]["name"]
        emit(body, output, lambda _d: f"podsnapshot/{name} created ({dry_run} dry run)", name=snapshot_name)
        return
    created = start_snapshot(req, kube=kube)
    memory_notice()
    name = created["metadata"]["name"]
    if no_wait:
        emit(created, output, lambda _d: f"podsnapshot/{name} created", name=snapshot_name)
        return
    with RemoteProgress(f"snapshot {pod}") as bar:
        final = wait_snapshot(ns, name, kube=kube, timeout_s=timeout, on_status=bar.snapshot)
    emit(final, output, lambda d: snapshot_status(d).reference, name=snapshot_name)
