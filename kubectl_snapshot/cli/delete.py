"""`kubectl snapshot delete`: PodSnapshots by name or selector, and with --registry their manifests."""

from __future__ import annotations

import click

from kubectl_snapshot.app.delete import delete_snapshots
from kubectl_snapshot.app.listing import list_objects
from kubectl_snapshot.cli import completion, wiring
from kubectl_snapshot.cli.params import common_options, dry_run_option, selector_option
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import kubenames as K


@click.command("delete")
@common_options
@click.option("--registry", is_flag=True, help="Also delete the snapshot's manifest from the registry.")
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@selector_option
@dry_run_option
@output_option
@click.argument("names", nargs=-1, metavar="SNAPSHOT...", shell_complete=completion.snapshots)
@handle_errors
def delete_cmd(
    names: tuple[str, ...], registry: bool, insecure: bool, selector: str | None, dry_run: str, output: str
) -> None:
    """Delete PodSnapshots by name or -l selector (and with --registry their manifests)."""
    if not names and not selector:
        raise click.UsageError("name the PodSnapshots to delete, or select them with -l/--selector")
    if names and selector:
        raise click.UsageError("name PodSnapshots or give -l/--selector, not both")
    kube = wiring.kube_client()
    ns = wiring.namespace_of(kube)
    if selector:
        names = tuple(r["name"] for _, r in list_objects(kube=kube, namespace=ns, label_selector=selector))
    done = delete_snapshots(
        list(names),
        namespace=ns,
        kube=kube,
        stores=wiring.artifact_store if registry else None,
        insecure=insecure,
        dry_run=dry_run,
    )
    suffix = "" if dry_run == "none" else f" ({dry_run} dry run)"
    data = [{"name": d.name, "deletedFromRegistry": d.reference} for d in done]
    emit(
        data,
        output,
        lambda rows: "\n".join(_deleted_line(r) + suffix for r in rows) or "No PodSnapshots found.",
        name=lambda rows: "\n".join(f"{K.SINGULAR}.{K.GROUP}/{r['name']}" for r in rows),
    )


def _deleted_line(r: dict[str, str]) -> str:
    extra = f" (and {r['deletedFromRegistry']})" if r["deletedFromRegistry"] else ""
    return f"podsnapshot/{r['name']} deleted{extra}"
