"""`kubectl snapshot install | uninstall`: the CRDs, RBAC, admission policies and the agent DaemonSet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import yaml

from kubectl_snapshot.app import install as install_app
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.cli.params import Duration, common_options, dry_run_option
from kubectl_snapshot.cli.watch_progress import RemoteProgress
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.errors import InvalidArgument


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


def _importer_key(spec: str) -> tuple[str, bytes]:
    """--importer-key NAMESPACE=PUB.pem: the namespace and the key's PEM."""
    namespace, sep, path = spec.partition("=")
    if not sep or not namespace or not path:
        raise click.BadParameter(f"{spec!r}: give NAMESPACE=PUB.pem", param_hint="--importer-key")
    try:
        with open(path, "rb") as f:
            return namespace, f.read()
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror}", param_hint="--importer-key") from e


@click.command("install")
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
    "--key-broker/--no-key-broker",
    default=None,
    help="Keep the namespace keys behind the key broker (a Deployment, the only reader of the key Secret): "
    "each node's agent gets a key operation only for a save or restore of a pod on its own node (docs/security.md). "
    "Default: on; off with --host-network unless --key-broker-url is given (the broker then runs as one replica).",
)
@click.option(
    "--key-broker-url",
    default=None,
    help="Where the agents reach the key broker (default: its Service; https://127.0.0.1:PORT on host-network "
    "clusters without kube-proxy, the broker then runs host-network too). Implies --key-broker.",
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
    "--importer-key",
    "importer_keys",
    multiple=True,
    metavar="NAMESPACE=PUB.pem",
    callback=lambda _ctx, _param, values: tuple(_importer_key(v) for v in values),
    help="Trust checkpoints imported into NAMESPACE (ks-agent import) signed with this public key, and only "
    "those: the key vouches for no other namespace. Repeatable.",
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
    key_broker: bool | None,
    key_broker_url: str | None,
    rotate_signing_key: bool,
    trust_keys: tuple[str, ...],
    importer_keys: tuple[tuple[str, bytes], ...],
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
    if key_broker_url and key_broker is False:
        raise click.UsageError("--key-broker-url goes with the key broker, not with --no-key-broker")
    key_broker = install_app.key_broker_default(key_broker, host_network=host_network, url=key_broker_url)
    if not key_broker and host_network and dry_run != "client":
        click.echo(install_app.NO_BROKER_NOTE, err=True)
    settings["key_broker"] = key_broker
    if key_broker_url:
        settings["key_broker_url"] = key_broker_url
    objects = install_app.render(agent_image, settings)
    if dry_run == "client":
        _emit_objects(objects, output)
        return
    if dry_run == "server":  # every object through the API server's validation and admission, none stored
        result = install_app.server_dry_run(objects, kube=wiring.kube_client())
        if result.unchecked:
            namespaces = sorted({str(o["metadata"]["namespace"]) for o in result.unchecked})
            click.echo(
                f"note: {len(result.unchecked)} objects in namespace {', '.join(namespaces)} were not checked by the "
                "API server: that namespace does not exist before the install creates it (shown as rendered)",
                err=True,
            )
        _emit_objects(result.checked + result.unchecked, output)
        return
    kube = wiring.kube_client()
    pems = []
    for path in trust_keys:
        with open(path, "rb") as f:
            pems.append(f.read())
    signing = install_app.trust_objects(
        kube, trust_keys=pems, importer_keys=importer_keys, allow_unverified=allow_unverified
    )
    keys = install_app.key_objects(kube)
    if key_broker:
        keys += install_app.key_broker_tls_objects(kube)
    objects = objects[:-1] + signing + keys + objects[-1:]  # before the DaemonSet, after its namespace
    # switching key modes: the other mode's objects go (the broker, or the agents' Role on the key Secret)
    stale = install_app.other_mode_objects(agent_image, settings, key_broker=key_broker)
    with RemoteProgress("install") as bar:
        install_app.install(objects, kube=kube, timeout_s=timeout, on_step=lambda what, _d, _t: bar.step(what))
        if stale:
            bar.step("delete the other key mode's objects")
            kube.delete_objects(stale)
    emit({"installed": [f"{o['kind']}/{o['metadata']['name']}" for o in objects]}, output, lambda _d: "installed")


@click.command("uninstall")
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
    """Remove the runtime wrapper from every node, then what `install` created (PodSnapshots go with the CRD).

    Waits for pods of the kubectl-snapshot runtime class that are being deleted, and refuses while others
    run (restored and resuming pods): containerd stops their containers through the runtime wrapper.

    \b
    Keeps the keys unless --purge-keys: Secrets kubectl-snapshot-keys (namespace keys of sealed
    snapshots) and kubectl-snapshot-signing-key (earlier releases' cluster-wide signing key, where there
    is one), ConfigMap kubectl-snapshot-trust (the nodes' public keys among it), and so their
    namespace kubectl-snapshot-system. A later install uses them again, so earlier snapshots restore.
    """
    objects = install_app.all_mode_objects(None, {})  # with or without the key broker
    if dry_run == "client":
        plan = install_app.removal(objects, kube=None, purge_keys=purge_keys)
    elif dry_run == "server":
        kube = wiring.kube_client()
        plan = install_app.removal(objects, kube=kube, purge_keys=purge_keys)
        kube.delete_objects(plan.delete, dry_run=True)
    else:
        with RemoteProgress("uninstall") as bar:
            done = install_app.uninstall(
                objects,
                kube=wiring.kube_client(),
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
