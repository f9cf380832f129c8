"""`kubectl snapshot list`: PodSnapshots as kubectl get shows objects (-A, -l, -w, -o)."""

from __future__ import annotations

from typing import Any

import click

from kubectl_snapshot.app.listing import list_objects, snapshot_row
from kubectl_snapshot.app.ports import Kube
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.cli.params import common_options, selector_option
from kubectl_snapshot.cli.snapshot import snapshot_name
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.status import human_bytes


@click.command("list")
@common_options
@click.option("-A", "--all-namespaces", is_flag=True, help="List PodSnapshots in every namespace.")
@selector_option
@click.option("-w", "--watch", is_flag=True, help="After listing, print each PodSnapshot again as it changes.")
@output_option
@handle_errors
def list_cmd(all_namespaces: bool, selector: str | None, watch: bool, output: str) -> None:
    """List PodSnapshots (like `kubectl get podsnapshots`, with -A, -l, -w and -o as kubectl has them)."""
    kube = wiring.kube_client()
    ns = None if all_namespaces else wiring.namespace_of(kube)
    pairs = list_objects(kube=kube, namespace=ns, label_selector=selector)
    structured = output in ("json", "yaml") or output.startswith("jsonpath")
    if structured:
        emit({"apiVersion": "v1", "kind": "List", "items": [o for o, _ in pairs], "metadata": {}}, output, str)
    elif output == "name":
        if pairs:
            click.echo("\n".join(snapshot_name(o) for o, _ in pairs))
    else:
        wide = output == "wide"
        rows = [r for _, r in pairs]
        if rows or not watch:
            click.echo(table(rows, all_namespaces, wide=wide))
        else:
            click.echo(_header(all_namespaces, wide))
    if watch:
        _watch_list(kube, ns, selector, output, all_namespaces, seen={_version(o) for o, _ in pairs})


def _version(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


def _watch_list(
    kube: Kube, ns: str | None, selector: str | None, output: str, with_ns: bool, *, seen: set[tuple[str, str]]
) -> None:
    """kubectl get -w: one line (or document) per change, until interrupted. Each watch is resumed from
    the last resourceVersion seen; when that expired (410 Gone) the watch starts over and versions
    already printed are skipped."""
    from kubectl_snapshot.core.errors import Expired

    resource_version: str | None = None
    while True:
        try:
            for etype, obj in kube.watch_snapshots(ns, 300, label_selector=selector, resource_version=resource_version):
                resource_version = _version(obj)[1] or resource_version
                if etype == "BOOKMARK" or not obj.get("metadata"):
                    continue  # a bookmark only moves the resourceVersion on
                if etype != "DELETED" and _version(obj) in seen:
                    continue
                seen.add(_version(obj))
                if output in ("json", "yaml") or output.startswith("jsonpath"):
                    emit(obj, output, str)
                    if output == "yaml":
                        click.echo("---")
                elif output == "name":
                    click.echo(snapshot_name(obj))
                else:
                    row = snapshot_row(obj, T.now())
                    if etype == "DELETED":
                        row["phase"] = "Deleted"
                    click.echo(table([row], with_ns, wide=output == "wide", header=False))
        except Expired:
            resource_version = None  # 410 Gone: the version is too old; start over (seen skips repeats)


def _columns(with_ns: bool, wide: bool) -> list[str]:
    head = (["NAMESPACE"] if with_ns else []) + ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"]
    return head + (["STAGE", "DESTINATION", "MESSAGE"] if wide else [])


def _header(with_ns: bool, wide: bool) -> str:
    return "   ".join(_columns(with_ns, wide))


def table(rows: list[dict[str, Any]], with_ns: bool, *, wide: bool = False, header: bool = True) -> str:
    if not rows:
        return "No PodSnapshots found."
    head = _columns(with_ns, wide)
    lines = [head] if header else []
    for r in rows:
        size = human_bytes(r["size"]) if r["size"] else "-"
        cells = [r["name"], r["pod"], r["phase"], r["node"] or "-", size, r["reference"] or "-", r["age"]]
        if wide:
            cells += [r["stage"] or "-", r["destination"] or "-", (r["message"] or "-").replace("\n", " ")[:120]]
        lines.append(([r["namespace"]] if with_ns else []) + cells)
    widths = [max(len(line[i]) for line in [head, *lines]) for i in range(len(head))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)
