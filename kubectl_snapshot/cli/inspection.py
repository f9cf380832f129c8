"""`kubectl snapshot inspect REF|SNAPSHOT`: what a snapshot holds and whether its signature verifies."""

from __future__ import annotations

import click

from kubectl_snapshot.adapters.signatures import load_trust, merge_trust, provenance_of, trust_from_data
from kubectl_snapshot.app.ports import Kube
from kubectl_snapshot.app.restore import resolve_source
from kubectl_snapshot.cli import completion, wiring
from kubectl_snapshot.cli.params import common_options
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.inspect import inspect_data, inspect_text
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core.artifact import load_artifact
from kubectl_snapshot.core.provenance import TrustPolicy
from kubectl_snapshot.core.reference import Reference


@click.command("inspect")
@common_options
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@click.option(
    "--key",
    "keys",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Public key (PEM) to verify the signature with, besides the cluster's trusted keys. Repeatable.",
)
@output_option
@click.argument("source", metavar="REF|SNAPSHOT", shell_complete=completion.snapshots)
@handle_errors
def inspect_cmd(source: str, insecure: bool, keys: tuple[str, ...], output: str) -> None:
    """Show what a snapshot holds: containers, process trees, memory, host facts, who signed it and
    whether that verifies (with the cluster's trusted keys, when the cluster is reachable, and --key)."""
    kube: Kube | None = None
    if "/" in source:  # a reference needs no cluster
        ref, ins = Reference.parse(source), insecure
    else:
        kube = wiring.kube_client()
        src = resolve_source(source, namespace=wiring.namespace_of(kube), kube=kube, insecure=insecure)
        ref, ins = src.reference, src.insecure
    store = wiring.artifact_store(ref, ins)
    artifact = load_artifact(store, ref)
    policy = merge_trust([load_trust(list(keys)), _cluster_trust(kube)])
    emit(inspect_data(artifact, provenance_of(store, artifact.reference, policy)), output, inspect_text)


def _cluster_trust(kube: Kube | None) -> TrustPolicy:
    """The cluster's trusted keys, if the cluster can be asked (inspect of a REF works without one)."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.errors import SnapshotError

    try:
        kube = kube or wiring.kube_client()
        cm = kube.get_object(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": K.TRUST_CONFIG_MAP, "namespace": K.AGENT_NAMESPACE},
            }
        )
    except (SnapshotError, OSError):
        return TrustPolicy()
    return trust_from_data((cm or {}).get("data") or {})
