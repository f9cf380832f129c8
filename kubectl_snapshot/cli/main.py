"""kubectl-snapshot: the kubectl plugin (`kubectl snapshot ...`).

    kubectl snapshot pod/NAME [--to REPO[:TAG]] [--stop] ...     take a snapshot (a PodSnapshot)
    kubectl snapshot restore REF|SNAPSHOT [--name N] [--node N]   create a pod from a snapshot
    kubectl snapshot migrate pod/NAME [--node N]                   snapshot, restore elsewhere, delete
    kubectl snapshot list | inspect | delete                       manage snapshots
    kubectl snapshot install | uninstall | doctor                  the node agent

A thin click layer: parsing, wiring adapters into the use cases of `kubectl_snapshot.app`, output.
Errors print `error:`/`hint:` and exit 1 (runtime) or 2 (usage); `-v` adds tracebacks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click
import yaml

from kubectl_snapshot.adapters.signatures import load_trust, merge_trust, provenance_of, trust_from_data
from kubectl_snapshot.app import doctor as doctor_app
from kubectl_snapshot.app import install as install_app
from kubectl_snapshot.app.delete import delete_snapshots
from kubectl_snapshot.app.listing import list_objects, snapshot_row
from kubectl_snapshot.app.migrate import MigrateRequest, migrate
from kubectl_snapshot.app.ports import ArtifactStore, Kube
from kubectl_snapshot.app.restore import RestoreRequest, build_restore, create_restore_pod, resolve_source, wait_running
from kubectl_snapshot.app.snapshot import SnapshotRequest, snapshot_body, start_snapshot, wait_snapshot
from kubectl_snapshot.cli import completion
from kubectl_snapshot.cli.params import (
    ENV_REPOSITORY,
    Duration,
    common_options,
    dry_run_option,
    kube_opts,
    repository_default,
)
from kubectl_snapshot.cli.watch_progress import RemoteProgress
from kubectl_snapshot.console import leave
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.inspect import inspect_data, inspect_text
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.artifact import load_artifact
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.podspec import destination, parse_pod_arg
from kubectl_snapshot.core.provenance import TrustPolicy
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.status import human_bytes
from kubectl_snapshot.core.status import read as snapshot_status

DEFAULT_COMMAND = "pod"
ALIASES = {"snapshot": DEFAULT_COMMAND}  # `kubectl-snapshot snapshot pod/NAME` reads naturally too


class PluginGroup(click.Group):
    """`kubectl snapshot pod/NAME`: an argument that is not a subcommand goes to the `pod` command."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] in ALIASES:
            return ALIASES[args[0]], self.get_command(ctx, ALIASES[args[0]]), args[1:]
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            return DEFAULT_COMMAND, self.get_command(ctx, DEFAULT_COMMAND), args
        return super().resolve_command(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        """Subcommands, and `pod/NAME` for the default command."""
        items = [i for i in super().shell_complete(ctx, incomplete) if not str(i.value).startswith("__")]
        if incomplete.startswith("pod/") or (incomplete and "pod/".startswith(incomplete)):
            items += completion.pods(ctx, None, incomplete)
        return items


# --- wiring --------------------------------------------------------------------------------------------


def kube_client() -> Kube:
    from kubectl_snapshot.adapters.kube import KubeClient

    opts = kube_opts(click.get_current_context())
    return KubeClient.from_config(
        opts.kubeconfig,
        opts.context,
        server=opts.server,
        token=opts.token,
        impersonate=opts.impersonate,
        impersonate_groups=opts.impersonate_groups,
    )


def namespace_of(kube: Kube) -> str:
    return kube_opts(click.get_current_context()).namespace or kube.namespace or "default"


def artifact_store(ref: Reference, insecure: bool) -> ArtifactStore:
    """Credentials from the docker config; loopback registries are plain HTTP anyway."""
    from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient

    return RegistryClient(credentials=CredentialStore.from_docker_config(), plain_http=insecure)


def _wait_options(fn: Any) -> Any:
    fn = click.option(
        "--timeout", type=Duration(), default="10m", show_default=True, help="How long to wait (e.g. 90s, 10m, 1h)."
    )(fn)
    fn = click.option("--no-wait", is_flag=True, help="Return once the object is created.")(fn)
    return fn


def _selector_option(fn: Any) -> Any:
    return click.option(
        "-l",
        "--selector",
        help="Label selector (e.g. -l kubectl-snapshot.io/pod=web,tier!=db), as kubectl takes it.",
    )(fn)


def _snapshot_name(d: dict[str, Any]) -> str:
    """`-o name`, as kubectl prints it: kind.group/name."""
    return f"{K.SINGULAR}.{K.GROUP}/{d['metadata']['name']}"


def _snapshot_options(fn: Any) -> Any:
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


MEMORY_NOTICE = (
    "note: a snapshot holds the pod's memory, and so every secret the pod has read (tokens, passwords, "
    "keys). It is protected by who can read the repository, by the agents' signature (a restore verifies "
    "it and refuses another namespace unless that namespace granted it), and it stores no environment "
    "variables outside memory. Treat read access to the repository like access to the pod. "
    "(Shown once; docs/security.md, Provenance.)"
)


def memory_notice() -> None:
    """Say once per user, plainly, what a snapshot holds; a stamp file remembers it was said."""
    import os

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


# --- commands ------------------------------------------------------------------------------------------


@click.group(
    cls=PluginGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=False,
)
@common_options
@click.version_option(package_name="kubectl-snapshot")
def cli() -> None:
    """Save games for pods: snapshot a running pod to a registry, restore it anywhere.

    \b
    kubectl snapshot pod/NAME --to REGISTRY/REPO      take a snapshot
    kubectl snapshot restore SNAPSHOT|REF              bring it back as a new pod
    """


def _snapshot_request(
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
    kube = kube_client()
    req = SnapshotRequest(
        namespace=namespace_of(kube),
        pod=pod,
        repository=repository,
        registry_secret=registry_secret,
        insecure=insecure,
        stop=stop,
        include_volumes=not no_volumes,
        ignore_liveness=ignore_liveness,
    )
    return kube, req


@cli.command(DEFAULT_COMMAND)
@common_options
@_snapshot_options
@click.option("--stop", is_flag=True, help="Stop the pod's containers once the snapshot is pushed.")
@_wait_options
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
    kube, req = _snapshot_request(
        target, to, stop=stop, registry_secret=registry_secret, insecure=insecure, no_volumes=no_volumes,
        ignore_liveness=ignore_liveness,
    )  # fmt: skip
    ns, pod = req.namespace, req.pod
    if dry_run != "none":
        body = snapshot_body(req, kube=kube) if dry_run == "client" else start_snapshot(req, kube=kube, dry_run=True)
        name = body["metadata"]["name"]
        emit(body, output, lambda _d: f"podsnapshot/{name} created ({dry_run} dry run)", name=_snapshot_name)
        return
    created = start_snapshot(req, kube=kube)
    memory_notice()
    name = created["metadata"]["name"]
    if no_wait:
        emit(created, output, lambda _d: f"podsnapshot/{name} created", name=_snapshot_name)
        return
    with RemoteProgress(f"snapshot {pod}") as bar:
        final = wait_snapshot(ns, name, kube=kube, timeout_s=timeout, on_status=bar.snapshot)
    emit(final, output, lambda d: snapshot_status(d).reference, name=_snapshot_name)


@cli.command("restore")
@common_options
@click.option("--name", help="Name of the new pod (default: <original>-restored).")
@click.option("--node", shell_complete=completion.nodes, help="Run it on this node (default: the scheduler picks).")
@click.option("--registry-secret", help="dockerconfigjson Secret the agent pulls with.")
@click.option("--agent-image", help="Image of the gate init container (default: the agent DaemonSet's image).")
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@dry_run_option
@_wait_options
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
    dry_run: str,
    no_wait: bool,
    timeout: float,
    output: str,
) -> None:
    """Create a pod from a snapshot (a PodSnapshot name here, or REGISTRY/REPO[:TAG|@DIGEST])."""
    kube = kube_client()
    ns = namespace_of(kube)
    req = RestoreRequest(
        source=source,
        namespace=ns,
        name=name,
        node=node,
        registry_secret=registry_secret,
        agent_image=agent_image,
        insecure=insecure,
    )
    body, _artifact = build_restore(req, kube=kube, stores=artifact_store)
    pod_ref = lambda d: f"pod/{d['metadata']['name']}"  # noqa: E731
    if dry_run != "none":
        if dry_run == "server":
            body = create_restore_pod(body, kube=kube, dry_run=True)
        emit(body, "yaml" if output in ("text", "wide") else output, str, name=pod_ref)
        return
    created = create_restore_pod(body, kube=kube)
    pod_name = created["metadata"]["name"]
    if no_wait:
        emit(created, output, pod_ref, name=pod_ref)
        return
    with RemoteProgress(f"restore {pod_name}") as bar:
        running = wait_running(ns, pod_name, kube=kube, timeout_s=timeout, on_state=bar.restore)
    emit(running, output, pod_ref, name=pod_ref)


@cli.command("migrate")
@common_options
@_snapshot_options
@click.option("--node", shell_complete=completion.nodes, help="Target node (default: another Ready node).")
@click.option("--name", help="Name of the new pod (default: <original>-restored).")
@click.option("--agent-image", help="Image of the gate init container (default: the agent DaemonSet's image).")
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
    timeout: float,
    output: str,
) -> None:
    """Move a running pod to another node: snapshot it (it keeps running), restore the copy there, and
    delete the original only once the copy runs. If anything fails the original is left untouched."""
    kube, snapshot = _snapshot_request(
        target, to, stop=False, registry_secret=registry_secret, insecure=insecure, no_volumes=no_volumes,
        ignore_liveness=ignore_liveness,
    )  # fmt: skip
    ns, pod = snapshot.namespace, snapshot.pod
    req = MigrateRequest(
        snapshot=snapshot,
        node=node,
        name=name,
        agent_image=agent_image,
        timeout_s=timeout,
    )
    with RemoteProgress(f"migrate {pod}") as bar:
        result = migrate(
            req, kube=kube, stores=artifact_store, on_status=bar.snapshot, on_state=bar.restore, on_step=bar.step
        )
    data = {
        "snapshot": result.snapshot,  # the PodSnapshot object
        "restored": {"name": result.pod["metadata"]["name"], "namespace": ns, "node": result.to_node},
        "original": {"name": pod, "namespace": ns, "node": result.from_node, "deleted": True},
    }
    emit(data, output, _migrated_text)


def _migrated_text(d: dict[str, Any]) -> str:
    ref = snapshot_status(d["snapshot"]).reference
    return f"pod/{d['restored']['name']} runs on {d['restored']['node']} (from {ref})"


@cli.command("list")
@common_options
@click.option("-A", "--all-namespaces", is_flag=True, help="List PodSnapshots in every namespace.")
@_selector_option
@click.option("-w", "--watch", is_flag=True, help="After listing, print each PodSnapshot again as it changes.")
@output_option
@handle_errors
def list_cmd(all_namespaces: bool, selector: str | None, watch: bool, output: str) -> None:
    """List PodSnapshots (like `kubectl get podsnapshots`, with -A, -l, -w and -o as kubectl has them)."""
    kube = kube_client()
    ns = None if all_namespaces else namespace_of(kube)
    pairs = list_objects(kube=kube, namespace=ns, label_selector=selector)
    structured = output in ("json", "yaml") or output.startswith("jsonpath")
    if structured:
        emit({"apiVersion": "v1", "kind": "List", "items": [o for o, _ in pairs], "metadata": {}}, output, str)
    elif output == "name":
        if pairs:
            click.echo("\n".join(_snapshot_name(o) for o, _ in pairs))
    else:
        wide = output == "wide"
        rows = [r for _, r in pairs]
        if rows or not watch:
            click.echo(_table(rows, all_namespaces, wide=wide))
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
    import datetime

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
                    click.echo(_snapshot_name(obj))
                else:
                    row = snapshot_row(obj, datetime.datetime.now(datetime.UTC))
                    if etype == "DELETED":
                        row["phase"] = "Deleted"
                    click.echo(_table([row], with_ns, wide=output == "wide", header=False))
        except Expired:
            resource_version = None  # 410 Gone: the version is too old; start over (seen skips repeats)


def _columns(with_ns: bool, wide: bool) -> list[str]:
    head = (["NAMESPACE"] if with_ns else []) + ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"]
    return head + (["STAGE", "DESTINATION", "MESSAGE"] if wide else [])


def _header(with_ns: bool, wide: bool) -> str:
    return "   ".join(_columns(with_ns, wide))


def _table(rows: list[dict[str, Any]], with_ns: bool, *, wide: bool = False, header: bool = True) -> str:
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


@cli.command("inspect")
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
        kube = kube_client()
        src = resolve_source(source, namespace=namespace_of(kube), kube=kube, insecure=insecure)
        ref, ins = src.reference, src.insecure
    store = artifact_store(ref, ins)
    artifact = load_artifact(store, ref)
    policy = merge_trust([load_trust(list(keys)), _cluster_trust(kube)])
    emit(inspect_data(artifact, provenance_of(store, artifact.reference, policy)), output, inspect_text)


def _cluster_trust(kube: Kube | None) -> TrustPolicy:
    """The cluster's trusted keys, if the cluster can be asked (inspect of a REF works without one)."""
    from kubectl_snapshot.core import kube as K
    from kubectl_snapshot.core.errors import SnapshotError

    try:
        kube = kube or kube_client()
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


@cli.command("delete")
@common_options
@click.option("--registry", is_flag=True, help="Also delete the snapshot's manifest from the registry.")
@click.option("--insecure", is_flag=True, help="Plain HTTP to a non-loopback registry.")
@_selector_option
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
    kube = kube_client()
    ns = namespace_of(kube)
    if selector:
        names = tuple(r["name"] for _, r in list_objects(kube=kube, namespace=ns, label_selector=selector))
    done = delete_snapshots(
        list(names),
        namespace=ns,
        kube=kube,
        stores=artifact_store if registry else None,
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


def _node_setting_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`install`'s node settings, from their one declaration (core/nodesettings.py): same names as the
    agent's options, no default here (render() has them), so only what the user gave is passed on."""
    for name, opt, default in reversed(NS.options()):
        if opt.install:
            shown = f" (default {default})" if default else ""
            fn = click.option(NS.flag(name), *opt.aliases, name, default=None, help=opt.help + shown)(fn)
    return fn


def _install_settings(api_server: str | None, node_config: str | None, **node: str | None) -> dict[str, Any]:
    settings: dict[str, Any] = {k: v for k, v in node.items() if v}
    if api_server:
        settings["api_server"] = api_server
    if node_config:
        try:
            with open(node_config) as f:
                per_node = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise InvalidArgument(f"cannot read --node-config {node_config}: {e}") from e
        if not isinstance(per_node, dict):
            raise InvalidArgument(f"--node-config {node_config} must map node names to their settings")
        settings["per_node_paths"] = per_node
    return settings


@cli.command("install")
@common_options
@click.option("--agent-image", help="The kubectl-snapshot agent image (default: kubectl-snapshot-agent:VERSION).")
@click.option("--api-server", help="API server URL for the agent (when the in-cluster service is unreachable).")
@_node_setting_options
@click.option(
    "--node-config",
    type=click.Path(dir_okay=False, exists=True),
    help="YAML/JSON {node: {" + ", ".join(NS.PER_NODE_KEYS) + "}} for several nodes per machine.",
)
@click.option(
    "--host-network",
    is_flag=True,
    help="Run the agent in the nodes' network namespace (only when the registry is reachable from nodes alone).",
)
@click.option(
    "--rotate-signing-key",
    is_flag=True,
    hidden=True,  # refused with a hint: each node's agent has its own key now
)
@click.option(
    "--trust-key",
    "trust_keys",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Also trust snapshots signed with this public key (PEM; e.g. another cluster's). Repeatable.",
)
@click.option(
    "--allow-unverified-snapshots/--refuse-unverified-snapshots",
    "allow_unverified",
    default=None,
    help="Whether restores accept snapshots no trusted key signed (default: refuse; kept across installs).",
)
@dry_run_option
@click.option("--timeout", type=Duration(), default="5m", show_default=True, help="How long to wait for the rollout.")
@output_option
@handle_errors
def install_cmd(
    agent_image: str | None,
    api_server: str | None,
    node_config: str | None,
    host_network: bool,
    rotate_signing_key: bool,
    trust_keys: tuple[str, ...],
    allow_unverified: bool | None,
    dry_run: str,
    timeout: float,
    output: str,
    **node: str | None,
) -> None:
    """Install the CRD, RBAC, admission policies, agent DaemonSet and RuntimeClass; wait until the agents run.

    Also makes the trust ConfigMap kubectl-snapshot-trust (public keys, policy; each node's agent adds
    its own signing key there, and every key listed stays) and, once, the Secret kubectl-snapshot-keys
    the agents keep each namespace's encryption key in.
    """
    if rotate_signing_key:
        raise click.UsageError(
            "--rotate-signing-key: there is no cluster signing key to rotate any more; each node's agent signs "
            "with its own key. To replace a node's key, delete its file on the node "
            "(<state root>/NODE/signing/node.key, by default /var/lib/kubectl-snapshot/NODE/signing/node.key) "
            "and restart that node's agent; to stop trusting a key, remove its <key id>.pub and <key id>.node "
            f"entries from ConfigMap {K.AGENT_NAMESPACE}/{K.TRUST_CONFIG_MAP} (docs/security.md)"
        )
    settings = _install_settings(api_server, node_config, **node)
    if host_network:
        settings["host_network"] = True
    objects = install_app.render(agent_image, settings)
    if dry_run == "client":
        _emit_objects(objects, output)
        return
    if dry_run == "server":  # every object through the API server's validation and admission, none stored
        result = install_app.server_dry_run(objects, kube=kube_client())
        if result.unchecked:
            namespaces = sorted({str(o["metadata"]["namespace"]) for o in result.unchecked})
            click.echo(
                f"note: {len(result.unchecked)} objects in namespace {', '.join(namespaces)} were not checked by the "
                "API server: that namespace does not exist before the install creates it (shown as rendered)",
                err=True,
            )
        _emit_objects(result.checked + result.unchecked, output)
        return
    kube = kube_client()
    pems = []
    for path in trust_keys:
        with open(path, "rb") as f:
            pems.append(f.read())
    signing = install_app.trust_objects(kube, trust_keys=pems, allow_unverified=allow_unverified)
    keys = install_app.key_objects(kube)
    objects = objects[:-1] + signing + keys + objects[-1:]  # before the DaemonSet, after its namespace
    with RemoteProgress("install") as bar:
        install_app.install(objects, kube=kube, timeout_s=timeout, on_step=lambda what, _d, _t: bar.step(what))
    emit({"installed": [f"{o['kind']}/{o['metadata']['name']}" for o in objects]}, output, lambda _d: "installed")


@cli.command("uninstall")
@common_options
@dry_run_option
@click.option(
    "--timeout",
    type=Duration(),
    default="5m",
    show_default=True,
    help="How long pod deletion and node clean-up may take.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Uninstall even while pods run under the kubectl-snapshot runtime class (their containers then "
    "cannot be stopped until the agent is installed again).",
)
@click.option(
    "--purge-keys",
    is_flag=True,
    help=f"Also delete the namespace keys, the old cluster signing key and the trust ConfigMap (and namespace "
    f"{K.AGENT_NAMESPACE}): every sealed snapshot becomes unrestorable. Back them up first (docs/deploy.md).",
)
@output_option
@handle_errors
def uninstall_cmd(dry_run: str, timeout: float, force: bool, purge_keys: bool, output: str) -> None:
    """Remove the runtime hook from every node, then what `install` created (PodSnapshots go with the CRD).

    Waits for pods of the kubectl-snapshot runtime class that are being deleted, and refuses while others
    run (restored and resuming pods): containerd stops their containers through the runtime hook.

    \b
    Keeps the keys unless --purge-keys: Secrets kubectl-snapshot-keys (namespace keys of sealed
    snapshots) and kubectl-snapshot-signing-key (earlier releases' cluster-wide signing key, where there
    is one), ConfigMap kubectl-snapshot-trust (the nodes' public keys among it), and so their
    namespace kubectl-snapshot-system. A later install uses them again, so earlier snapshots restore.
    """
    objects = install_app.render(None, {})
    if dry_run == "client":
        plan = install_app.removal(objects, kube=None, purge_keys=purge_keys)
    elif dry_run == "server":
        kube = kube_client()
        plan = install_app.removal(objects, kube=kube, purge_keys=purge_keys)
        kube.delete_objects(plan.delete, dry_run=True)
    else:
        with RemoteProgress("uninstall") as bar:
            done = install_app.uninstall(
                objects,
                kube=kube_client(),
                timeout_s=timeout,
                force=force,
                purge_keys=purge_keys,
                on_step=lambda what, _d, _t: bar.step(what),
            )
        plan = done.removal
        if done.left:
            click.echo(
                f"warning: {len(done.left)} pod(s) left running under the {K.RUNTIME_CLASS} runtime class "
                f"({install_app.pod_names(done.left)}): "
                "their containers cannot be stopped until kubectl-snapshot is installed again",
                err=True,
            )
    deleted = [f"{o['kind']}/{o['metadata']['name']}" for o in plan.delete]
    kept = [f"{o['kind']}/{o['metadata']['name']}" for o in plan.keep]
    keys = [n for n in kept if not n.startswith("Namespace/")]
    if keys and output in ("text", "wide"):
        click.echo(
            f"note: kept the keys in namespace {K.AGENT_NAMESPACE} ({', '.join(keys)}): sealed and signed "
            "snapshots restore only with them, and a later install uses them again. Back them up (docs/deploy.md, "
            '"Keys"); `kubectl snapshot uninstall --purge-keys` deletes them',
            err=True,
        )
    verb = "deleted" if dry_run == "none" else f"deleted ({dry_run} dry run)"
    emit(
        {"deleted": deleted, "kept": kept, "dryRun": dry_run != "none"},
        output,
        lambda d: "\n".join([f"{n} {verb}" for n in d["deleted"]] + [f"{n} kept" for n in d["kept"]]),
        name=lambda d: "\n".join(d["deleted"]),
    )


def _emit_objects(objects: list[dict[str, Any]], output: str) -> None:
    if output in ("text", "wide", "yaml"):
        click.echo(yaml.safe_dump_all(objects, sort_keys=False).rstrip())
    else:
        emit(
            {"apiVersion": "v1", "kind": "List", "items": objects},
            output,
            str,
            name=lambda d: "\n".join(_kind_name(o) for o in d["items"]),
        )


def _kind_name(obj: dict[str, Any]) -> str:
    group = str(obj.get("apiVersion", "")).rpartition("/")[0]
    return f"{str(obj.get('kind', '')).lower()}{'.' + group if group else ''}/{obj['metadata']['name']}"


@cli.command("doctor")
@common_options
@output_option
@handle_errors
def doctor_cmd(output: str) -> None:
    """Check the installation and each node's agent and facts."""
    report = doctor_app.doctor(kube=kube_client())
    emit(report, output, _doctor_text)
    if not report["ok"]:
        sys.exit(1)


def _doctor_text(d: dict[str, Any]) -> str:
    lines = [f"{'ok ' if c['ok'] else 'BAD'} {c['check']}: {c['detail']}" for c in d["checks"]]
    if d.get("error"):
        lines.append(f"BAD {d['error']}")
    head = ["NODE", "AGENT", "READY", "CRIU", "CONTAINERD", "RUNC", "KERNEL", "HANDLER"]
    rows = [head] + [
        [
            n["node"],
            n["agentPod"] or "-",
            str(n["agentReady"]).lower(),
            str(n["criuVersion"]),
            str(n["containerdVersion"]),
            str(n["runcVersion"]),
            str(n["kernel"]),
            str(n["runtimeHandler"]).lower(),
        ]
        for n in d["nodes"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["", *("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)]
    for n in d["nodes"]:
        criu, hook = n.get("criu") or {}, n.get("hook") or {}
        if not criu and not hook:
            continue
        lines += [
            "",
            f"{n['node']}:",
            f"  CRIU          {criu.get('path', '?')} ({criu.get('version', '?')}; {criu.get('from', '?')})",
            f"  runtime hook  {hook.get('path', '?')} (python {hook.get('python', '?')}; {hook.get('from', '?')})",
            *(
                f"  {name}: {t.get('path', '?')}"
                + (f" {t['version']}" if t.get("version") else "")
                + f" ({t.get('from', '?')}"
                + (f"; instead of {t['replaces']}" if t.get("replaces") else "")
                + (f"; {t.get('detail')}" if "ok" in t else "")
                + ")"
                for name, t in (n.get("tools") or {}).items()
            ),
            f"  criu check    {str(n.get('criuCheck', '?')).splitlines()[-1] if n.get('criuCheck') else '?'}",
            f"  cgroup        {n.get('cgroup', '?')}",
            f"  containerd    config {n.get('containerdConfig', '?')}; imports the drop-in: "
            f"{str(n.get('importsDropin', '?')).lower()}; restart pending: {str(n.get('restartPending', '?')).lower()}",
            *(f"  BLOCKED       {b}" for b in n.get("blockers") or []),
        ]
    return "\n".join(lines)


@cli.command("completion")
@click.argument("shell", type=click.Choice(completion.SHELLS))
def completion_cmd(shell: str) -> None:
    """Print a completion script for the kubectl-snapshot command (bash, zsh or fish).

    \b
    With kubectl >= 1.26 `kubectl snapshot <TAB>` completes through kubectl's own completion
    (`source <(kubectl completion bash)`) once kubectl_complete-snapshot is on PATH (pip installs it;
    from krew: ln -s ~/.krew/store/snapshot/*/kubectl_complete-snapshot ~/.krew/bin/).
    For the kubectl-snapshot command itself:
      bash:  source <(kubectl snapshot completion bash)
      zsh:   source <(kubectl snapshot completion zsh)
      fish:  kubectl snapshot completion fish | source
    """
    click.echo(completion.source(cli, shell))


# --- entry point ---------------------------------------------------------------------------------------


def kubectl_args(argv: list[str]) -> list[str]:
    """kubectl's spellings click does not parse by itself: a bare `--dry-run` means `--dry-run=client`
    (kubectl never takes the next word as its value)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        out.append("--dry-run=client" if arg == "--dry-run" else arg)
    return out


def _add_policy_commands() -> None:
    from kubectl_snapshot.cli.policy import policy_group

    cli.add_command(policy_group)


_add_policy_commands()


def main(argv: list[str] | None = None) -> None:
    """Run the plugin; usage errors print `error:`/`hint:` and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["__complete"]:  # kubectl_complete-snapshot in the krew archive runs this
        completion.main(args[1:])
        return
    try:
        cli.main(
            args=kubectl_args(args),
            prog_name="kubectl snapshot",
            standalone_mode=False,
            complete_var=completion.COMPLETE_VAR,
        )
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help() if e.ctx else "", err=True)
        sys.exit(2)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "kubectl snapshot"
        click.echo(f"error: {e.format_message()}\nhint: see '{cmd} --help'", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)


def entry() -> None:
    """The `kubectl-snapshot` program: `main`, then a quick exit (console/leave.py)."""
    leave.run(main)


if __name__ == "__main__":
    entry()
