"""`kubectl snapshot policy create|list|describe|delete` (autosave: SnapshotPolicies)."""

from __future__ import annotations

from typing import Any

import click

from kubectl_snapshot.app import policy as P
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.cli.params import common_options, dry_run_option
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.policyspec import parse_selector, parse_workload, policy_object, selector_text
from kubectl_snapshot.core.status import human_bytes


def _name(obj: dict[str, Any]) -> str:
    return f"{K.POLICY_SINGULAR}.{K.GROUP}/{obj['metadata']['name']}"


@click.group("policy")
def policy_group() -> None:
    """Autosave: SnapshotPolicies save the selected pods every interval and keep the last N saves."""


@policy_group.command("create")
@common_options
@click.argument("name")
@click.option("--selector", "selector", required=True, help="Pods whose labels include all of k=v[,k=v].")
@click.option(
    "--workload", help="Only pods of this workload: KIND/NAME (StatefulSet, Deployment, ReplicaSet, Job, Pod)."
)
@click.option("--interval", required=True, help="How often each pod is saved (30s, 5m, 1h; at least 10s).")
@click.option("--to", "to", required=True, help="REGISTRY/REPO the saves are pushed to (a tag per save).")
@click.option("--keep", type=int, help="Keep the last N good saves of each pod (default 3).")
@click.option("--max-age", help="Also delete saves older than this (never a pod's newest good one), e.g. 24h.")
@click.option("--registry-secret", help="dockerconfigjson Secret in the namespace, used by the agents to push.")
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@click.option("--no-resume", is_flag=True, help="New pods of the workload start fresh instead of resuming.")
@click.option(
    "--restore-mode",
    type=click.Choice(K.RESTORE_MODES),
    default=K.RESTORE_MODE_EAGER,
    show_default=True,
    help="How resuming pods get their memory back. lazy: they run first, pages fetched from the registry as"
    " touched; a page that cannot be fetched later kills the container (a LazyRestoreFailed Event), which"
    " starts afresh, its resumed state lost. Keep eager for workloads that must not be killed mid-run.",
)
@click.option("--no-volumes", is_flag=True, help="Do not save emptyDir volumes.")
@click.option("--suspend", is_flag=True, help="Create the policy paused.")
@dry_run_option
@output_option
@handle_errors
def create_cmd(
    name: str,
    selector: str,
    workload: str | None,
    interval: str,
    to: str,
    keep: int | None,
    max_age: str | None,
    registry_secret: str | None,
    insecure: bool,
    no_resume: bool,
    restore_mode: str,
    no_volumes: bool,
    suspend: bool,
    dry_run: str,
    output: str,
) -> None:
    """Create a SnapshotPolicy (the same as `kubectl apply -f` of its YAML)."""
    kube = wiring.kube_client()
    body = policy_object(
        name=name,
        namespace=wiring.namespace_of(kube),
        selector=parse_selector(selector),
        workload=parse_workload(workload) if workload else None,
        interval=interval,
        destination=to,
        keep_last=keep,
        max_age=max_age,
        registry_secret=registry_secret,
        insecure=insecure,
        resume=not no_resume,
        restore_mode=restore_mode,
        include_volumes=not no_volumes,
        suspend=suspend,
    )
    obj = body if dry_run == "client" else P.create_policy(kube, body, dry_run=dry_run == "server")
    suffix = "" if dry_run == "none" else f" ({dry_run} dry run)"
    emit(obj, output, lambda o: f"snapshotpolicy/{o['metadata']['name']} created{suffix}", name=_name)


def _table(rows: list[dict[str, Any]], with_ns: bool, wide: bool) -> str:
    if not rows:
        return "No SnapshotPolicies found."
    head = (["NAMESPACE"] if with_ns else []) + ["NAME", "SELECTOR", "INTERVAL", "KEEP", "PODS", "LAST SAVE", "AGE"]
    if wide:
        head += ["WORKLOAD", "DESTINATION", "SUSPEND", "FAILING"]
    lines = [head]
    for r in rows:
        cells = [
            r["name"],
            r["selector"],
            r["interval"],
            str(r["keep"]),
            str(r["pods"]),
            r["lastSave"] or "-",
            r["age"],
        ]
        if wide:
            cells += [r["workload"] or "-", r["destination"], str(r["suspend"]).lower(), str(r["failing"])]
        lines.append(([r["namespace"]] if with_ns else []) + cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


@policy_group.command("list")
@common_options
@click.option("-A", "--all-namespaces", is_flag=True, help="List SnapshotPolicies in every namespace.")
@click.option("-l", "--selector", help="Label selector on the policies, as kubectl takes it.")
@output_option
@handle_errors
def list_cmd(all_namespaces: bool, selector: str | None, output: str) -> None:
    """List SnapshotPolicies (like `kubectl get snapshotpolicies`)."""
    kube = wiring.kube_client()
    ns = None if all_namespaces else wiring.namespace_of(kube)
    pairs = P.list_policies(kube, ns, label_selector=selector)
    if output in ("json", "yaml") or output.startswith("jsonpath"):
        emit({"apiVersion": "v1", "kind": "List", "items": [o for o, _ in pairs], "metadata": {}}, output, str)
    elif output == "name":
        if pairs:
            click.echo("\n".join(_name(o) for o, _ in pairs))
    else:
        click.echo(_table([r for _, r in pairs], all_namespaces, output == "wide"))


def describe_text(d: P.Description) -> str:
    obj = d.policy
    meta, spec = obj["metadata"], obj.get("spec") or {}
    retention = spec.get("retention") or {}
    workload = spec.get("workload") or {}
    lines = [
        f"Name:            {meta['name']}",
        f"Namespace:       {meta['namespace']}",
        f"Selector:        {selector_text(spec)}",
        f"Workload:        {workload.get('kind', '')}/{workload.get('name', '')}" if workload else "Workload:        -",
        f"Interval:        {spec.get('interval', '')}",
        f"Destination:     {spec.get('destination', '')}" + (" (insecure)" if spec.get("insecure") else ""),
        f"Registry secret: {spec.get('registrySecret') or '-'}",
        f"Retention:       keep last {retention.get('keepLast', 3)}"
        + (f", max age {retention['maxAge']}" if retention.get("maxAge") else ""),
        f"Resume:          {str(spec.get('resume', True)).lower()}",
        f"Restore mode:    {spec.get('restoreMode') or K.RESTORE_MODE_EAGER}",
        f"Volumes:         {str(spec.get('includeVolumes', True)).lower()}",
        f"Suspend:         {str(spec.get('suspend', False)).lower()}",
        "Pods:",
    ]
    pods = P.status_pods(obj)
    if not pods:
        lines.append("  (none saved yet)")
    for p in pods:
        size = human_bytes(int(p["lastSize"])) if p.get("lastSize") else "-"
        lines.append(
            f"  {p.get('name')} on {p.get('node', '?')}: last save {p.get('lastSaveTime', '-')} "
            f"({p.get('lastSnapshot', '-')}, {size}), result {p.get('lastResult', '-')}, "
            f"failures {p.get('consecutiveFailures', 0)}, next {p.get('nextSaveTime', '-')}"
        )
        if p.get("lastMessage"):
            lines.append(f"    message: {p['lastMessage']}")
    lines.append(
        f"Saves:           {len(d.saves)} PodSnapshots (kubectl snapshot list -l {K.LABEL_POLICY}={meta['name']})"
    )
    lines.append("Events:" if d.events else "Events:          <none>")
    for e in d.events:
        when = str(e.get("lastTimestamp") or e.get("eventTime") or "")
        lines.append(f"  {e.get('type', '')}  {e.get('reason', '')}  {when}  {e.get('message', '')}")
    return "\n".join(lines)


@policy_group.command("describe")
@common_options
@click.argument("name")
@output_option
@handle_errors
def describe_cmd(name: str, output: str) -> None:
    """A SnapshotPolicy: its spec, the status of each pod it saves, its recent Events."""
    kube = wiring.kube_client()
    d = P.describe_policy(kube, wiring.namespace_of(kube), name)
    data = {"policy": d.policy, "saves": [s["metadata"]["name"] for s in d.saves], "events": d.events}
    emit(data, output, lambda _: describe_text(d), name=lambda _: _name(d.policy))


@policy_group.command("delete")
@common_options
@click.argument("name")
@click.option("--prune", is_flag=True, help="Also delete the policy's saves and their registry manifests.")
@dry_run_option
@output_option
@handle_errors
def delete_cmd(name: str, prune: bool, dry_run: str, output: str) -> None:
    """Delete a SnapshotPolicy (its saves stay, for resume and restore, unless --prune)."""
    kube = wiring.kube_client()
    pruned = P.delete_policy(
        kube, wiring.namespace_of(kube), name, prune=prune, stores=wiring.artifact_store, dry_run=dry_run
    )
    suffix = "" if dry_run == "none" else f" ({dry_run} dry run)"
    data = {"name": name, "pruned": [{"name": d.name, "deletedFromRegistry": d.reference} for d in pruned]}

    def text(_: Any) -> str:
        lines = [
            f"podsnapshot/{d.name} deleted" + (f" (and {d.reference})" if d.reference else "") + suffix for d in pruned
        ]
        return "\n".join([*lines, f"snapshotpolicy/{name} deleted{suffix}"])

    emit(data, output, text, name=lambda _: f"{K.POLICY_SINGULAR}.{K.GROUP}/{name}")
