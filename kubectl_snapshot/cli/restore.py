"""`kubectl snapshot restore REF|SNAPSHOT`: create a pod from a snapshot and wait until it runs."""

from __future__ import annotations

import click

from kubectl_snapshot.app.restore import RestoreRequest, build_restore, create_restore_pod, server_dry_run, wait_running
from kubectl_snapshot.cli import completion, wiring
from kubectl_snapshot.cli.params import common_options, dry_run_option, lazy_option, wait_options
from kubectl_snapshot.cli.watch_progress import RemoteProgress
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core.tokenclone import cloned_token_warning


@click.command("restore")
@common_options
@click.option("--name", help="Name of the new pod (default: <original>-restored).")
@click.option("--node", shell_complete=completion.nodes, help="Run it on this node (default: the scheduler picks).")
@click.option("--registry-secret", help="dockerconfigjson Secret the agent pulls with.")
@click.option("--agent-image", help="Image of the gate init container (default: the agent DaemonSet's image).")
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@lazy_option
@dry_run_option
@wait_options
@output_option
@click.argument("source", metavar="REF|SNAPSHOT", shell_complete=completion.snapshots)
@handle_errors
def restore_cmd(
    source: str,
    name: str | None,
    node: str | None,
    registry_secret: str | None,
    agent_image: str | None,
    insecure: bool,
    lazy: bool,
    dry_run: str,
    no_wait: bool,
    timeout: float,
    output: str,
) -> None:
    """Create a pod from a snapshot (a PodSnapshot name here, or REGISTRY/REPO[:TAG|@DIGEST])."""
    kube = wiring.kube_client()
    ns = wiring.namespace_of(kube)
    req = RestoreRequest(
        source=source,
        namespace=ns,
        name=name,
        node=node,
        registry_secret=registry_secret,
        agent_image=agent_image,
        insecure=insecure,
        lazy=lazy,
    )
    body, artifact = build_restore(req, kube=kube, stores=wiring.artifact_store)
    pod_ref = lambda d: f"pod/{d['metadata']['name']}"  # noqa: E731
    if dry_run != "none":
        if dry_run == "server":
            body = server_dry_run(body, artifact, kube=kube)
        emit(body, "yaml" if output in ("text", "wide") else output, str, name=pod_ref)
        return
    created = create_restore_pod(body, kube=kube)
    cloned = cloned_token_warning(artifact.config)
    if cloned:  # the agent records it too, as a Warning Event on the pod
        click.echo(f"warning: {cloned}", err=True)
    pod_name = created["metadata"]["name"]
    if no_wait:
        emit(created, output, pod_ref, name=pod_ref)
        return
    with RemoteProgress(f"restore {pod_name}") as bar:
        running = wait_running(ns, pod_name, kube=kube, timeout_s=timeout, on_state=bar.restore)
    emit(running, output, pod_ref, name=pod_ref)
