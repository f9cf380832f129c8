"""`kubectl snapshot migrate pod/NAME`: snapshot, restore on another node, delete the original."""

from __future__ import annotations

from typing import Any

import click

from kubectl_snapshot.app.migrate import MigrateRequest, migrate
from kubectl_snapshot.cli import completion, wiring
from kubectl_snapshot.cli.params import Duration, common_options, lazy_option
from kubectl_snapshot.cli.snapshot import snapshot_options, snapshot_request
from kubectl_snapshot.cli.watch_progress import RemoteProgress
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core.status import read as snapshot_status


@click.command("migrate")
@common_options
@snapshot_options
@click.option("--node", shell_complete=completion.nodes, help="Target node (default: another Ready node).")
@click.option("--name", help="Name of the new pod (default: <original>-restored).")
@click.option("--agent-image", help="Image of the gate init container (default: the agent DaemonSet's image).")
@lazy_option
@click.option("--timeout", type=Duration(), default="10m", show_default=True, help="Per step (snapshot, restore) wait.")
@output_option
@click.argument("target", metavar="pod/NAME", shell_complete=completion.pods)
@handle_errors
def migrate_cmd(
    target: str,
    to: str | None,
    registry_secret: str | None,
    insecure: bool,
    no_volumes: bool,
    ignore_liveness: bool,
    node: str | None,
    name: str | None,
    agent_image: str | None,
    lazy: bool,
    timeout: float,
    output: str,
) -> None:
    """Move a running pod to another node: snapshot it (it keeps running), restore the copy there, and
    delete the original only once the copy runs. If anything fails the original is left untouched."""
    kube, snapshot = snapshot_request(
        target, to, stop=False, registry_secret=registry_secret, insecure=insecure, no_volumes=no_volumes,
        ignore_liveness=ignore_liveness,
    )  # fmt: skip
    ns, pod = snapshot.namespace, snapshot.pod
    req = MigrateRequest(
        snapshot=snapshot,
        node=node,
        name=name,
        agent_image=agent_image,
        lazy=lazy,
        timeout_s=timeout,
    )
    with RemoteProgress(f"migrate {pod}") as bar:
        result = migrate(
            req,
            kube=kube,
            stores=wiring.artifact_store,
            on_status=bar.snapshot,
            on_state=bar.restore,
            on_step=bar.step,
        )
    for warning in result.warnings:  # the agent records it too, as a Warning Event on the copy
        click.echo(f"warning: {warning}", err=True)
    data = {
        "snapshot": result.snapshot,  # the PodSnapshot object
        "restored": {"name": result.pod["metadata"]["name"], "namespace": ns, "node": result.to_node},
        "original": {"name": pod, "namespace": ns, "node": result.from_node, "deleted": True},
    }
    emit(data, output, _migrated_text)


def _migrated_text(d: dict[str, Any]) -> str:
    ref = snapshot_status(d["snapshot"]).reference
    return f"pod/{d['restored']['name']} runs on {d['restored']['node']} (from {ref})"
