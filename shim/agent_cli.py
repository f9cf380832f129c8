"""kubectl-snapshot-agent: the node engine as a command, usable against any containerd like `ctr`.

kubectl-snapshot-agent checkpoint --address SOCK --namespace NS [--stop] [--volume DIR]... --to REF CONTAINER...
kubectl-snapshot-agent restore    --address SOCK --namespace NS [--volume DIR]... REF NEWNAME...
kubectl-snapshot-agent inspect    REF [-o json|yaml]
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient
from kubectl_snapshot.cli.errors import handle_errors
from kubectl_snapshot.cli.output import emit, human_bytes, output_option
from kubectl_snapshot.cli.progress import Progress
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.reference import Reference
from shim.engine.artifact import load_artifact
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.restore import RestoreRequest, restore
from shim.engine.staging import StatePaths

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_ADDRESS = "/run/containerd/containerd.sock"


def containerd_options(fn: F) -> F:
    fn = click.option(
        "--namespace",
        "-n",
        default=lambda: os.environ.get("CONTAINERD_NAMESPACE", "default"),
        show_default="$CONTAINERD_NAMESPACE or default",
        help="containerd namespace (k8s.io for Kubernetes pods).",
    )(fn)
    fn = click.option(
        "--address",
        "-a",
        default=lambda: os.environ.get("CONTAINERD_ADDRESS", DEFAULT_ADDRESS),
        show_default=DEFAULT_ADDRESS,
        help="containerd socket.",
    )(fn)
    return fn


def registry_options(fn: F) -> F:
    fn = click.option(
        "--plain-http", is_flag=True, help="Talk HTTP, not HTTPS, to the registry (loopback is always plain)."
    )(fn)
    fn = click.option("--registry-username", envvar="KUBECTL_SNAPSHOT_REGISTRY_USERNAME", help="Registry user.")(fn)
    fn = click.option(
        "--registry-password",
        envvar="KUBECTL_SNAPSHOT_REGISTRY_PASSWORD",
        help="Registry password (prefer the environment variable).",
    )(fn)
    fn = click.option(
        "--docker-config",
        type=click.Path(dir_okay=False),
        help="docker config.json with credentials (default: $DOCKER_CONFIG/config.json, ~/.docker/config.json).",
    )(fn)
    return fn


def make_registry(ref: Reference, opts: dict[str, Any]) -> RegistryClient:
    store = CredentialStore.from_docker_config(opts.get("docker_config"))
    user, password = opts.get("registry_username"), opts.get("registry_password")
    if bool(user) != bool(password):
        raise InvalidArgument("--registry-username and --registry-password go together")
    if user and password:
        store = store.with_explicit(ref.registry, user, password)
    return RegistryClient(credentials=store, plain_http=bool(opts.get("plain_http")))


def _client(address: str, namespace: str) -> Any:
    from shim.containerd.client import ContainerdClient

    return ContainerdClient(address, namespace)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="kubectl-snapshot")
def cli(verbose: bool) -> None:
    """Checkpoint, push, pull and restore groups of containers through containerd."""


@cli.command("checkpoint")
@containerd_options
@registry_options
@click.option("--to", "to", required=True, help="Destination REGISTRY/REPO[:TAG].")
@click.option("--stop", is_flag=True, help="Stop the containers once the snapshot is safely pushed.")
@click.option(
    "--volume",
    "volumes",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Host dir to include (repeatable).",
)
@click.option("--no-tcp-established", is_flag=True, help="Do not dump established TCP connections.")
@click.option("--keep-work", is_flag=True, help="Keep the dump directory (for debugging).")
@output_option
@click.argument("containers", nargs=-1, required=True)
@handle_errors
def checkpoint_cmd(
    address: str,
    namespace: str,
    to: str,
    stop: bool,
    volumes: tuple[str, ...],
    no_tcp_established: bool,
    keep_work: bool,
    output: str,
    containers: tuple[str, ...],
    **registry_opts: Any,
) -> None:
    """Freeze CONTAINER... together, dump them with CRIU and push one snapshot to --to."""
    target = Reference.parse(to)
    registry = make_registry(target, registry_opts)
    with _client(address, namespace) as containerd, Progress("checkpoint") as bar:
        result = checkpoint(
            CheckpointRequest(
                containers=containers,
                target=target,
                volumes=volumes,
                stop=stop,
                namespace=namespace,
                tcp_established=not no_tcp_established,
                keep_work=keep_work,
            ),
            containerd=containerd,
            registry=registry,
            paths=StatePaths.from_env(),
            on_phase=bar.phase,
            on_bytes=bar.advance,
        )
    data = {
        "reference": str(result.reference),
        "tag": str(result.tagged),
        "size": result.size,
        "uploaded": result.uploaded,
        "timingsMs": {k: round(v, 1) for k, v in result.timings_ms.items()},
        "containers": [c.name for c in result.config.containers],
        "stopped": stop,
    }
    emit(data, output, lambda d: d["reference"])


@cli.command("restore")
@containerd_options
@registry_options
@click.option(
    "--volume",
    "volumes",
    multiple=True,
    type=click.Path(file_okay=False),
    help="Host dir for each snapshotted volume, in order.",
)
@click.option(
    "--runtime-binary",
    default=lambda: shutil.which(C.WRAPPER_BINARY_NAME) or "",
    show_default="kubectl-snapshot-runc on PATH",
    help="The runc-compatible wrapper the new containers run under.",
)
@click.option("--runc-root", default="", help="runc state root for the new containers (default: the shim's).")
@click.option(
    "--log-dir",
    default="/var/log/kubectl-snapshot",
    show_default=True,
    help="Where container stdout/stderr go.",
)
@output_option
@click.argument("ref")
@click.argument("names", nargs=-1, required=True)
@handle_errors
def restore_cmd(
    address: str,
    namespace: str,
    volumes: tuple[str, ...],
    runtime_binary: str,
    runc_root: str,
    log_dir: str,
    output: str,
    ref: str,
    names: tuple[str, ...],
    **registry_opts: Any,
) -> None:
    """Pull REF, verify it and restore its containers as NAME... (one per snapshotted container)."""
    source = Reference.parse(ref)
    registry = make_registry(source, registry_opts)
    if not runtime_binary:
        raise InvalidArgument(
            f"{C.WRAPPER_BINARY_NAME} was not found on PATH",
            hint="pass --runtime-binary /path/to/kubectl-snapshot-runc",
        )
    with _client(address, namespace) as containerd, Progress("restore") as bar:
        result = restore(
            RestoreRequest(
                source=source,
                new_ids=names,
                runtime_binary=os.path.abspath(runtime_binary),
                volumes=[os.path.abspath(v) for v in volumes],
                runc_root=runc_root,
                log_dir=log_dir,
            ),
            containerd=containerd,
            registry=registry,
            paths=StatePaths.from_env(),
            namespace=namespace,
            on_phase=bar.phase,
            on_bytes=bar.advance,
        )
    data = {
        "reference": str(result.reference),
        "containers": [{"name": cid, "pid": pid} for cid, pid in result.containers],
    }
    emit(data, output, lambda d: "\n".join(f"{c['name']}\trunning (pid {c['pid']})" for c in d["containers"]))


@cli.command("inspect")
@registry_options
@output_option
@click.argument("ref")
@handle_errors
def inspect_cmd(output: str, ref: str, **registry_opts: Any) -> None:
    """Show what a snapshot holds: containers, process trees, memory, host facts."""
    source = Reference.parse(ref)
    artifact = load_artifact(make_registry(source, registry_opts), source)
    cfg = artifact.config
    sizes = {layer.digest: layer.size for layer in artifact.manifest.layers}
    data = {
        "reference": f"{source.registry}/{source.repository}@{artifact.reference.digest}",
        "created": cfg.created,
        "group": cfg.group,
        "namespace": cfg.namespace,
        "stopped": cfg.stopped,
        "freezeMs": cfg.freeze_ms,
        "host": cfg.host.to_dict(),
        "containers": [
            {
                "name": c.name,
                "image": c.image,
                "imageDigest": c.image_digest,
                "layer": c.layer_digest,
                "layerSize": sizes.get(c.layer_digest, 0),
                **c.stats.to_dict(),
            }
            for c in cfg.containers
        ],
        "volumes": [v.to_dict() for v in cfg.volumes],
        "size": sum(sizes.values()) + artifact.manifest.config.size,
    }
    emit(data, output, _inspect_text)


def _inspect_text(d: dict[str, Any]) -> str:
    h = d["host"]
    lines = [
        f"Reference:  {d['reference']}",
        f"Created:    {d['created']}",
        f"Group:      {d['group']} (namespace {d['namespace'] or '-'})",
        f"Size:       {human_bytes(d['size'])}; frozen for {d['freezeMs']:.0f} ms; "
        f"{'stopped' if d['stopped'] else 'left running'} after the snapshot",
        f"Host:       {h['arch']} kernel {h['kernel']}, CRIU {h['criuVersion']}, runc {h['runcVersion']}, "
        f"containerd {h['containerdVersion']}, cgroup {h['cgroupVersion']}",
        "Containers:",
    ]
    for c in d["containers"]:
        lines.append(
            f"  {c['name']}: image {c['image']}; {c['processCount']} process(es), "
            f"{c['pagesWritten']} pages ({human_bytes(c['memoryBytes'])}) of memory; "
            f"layer {human_bytes(c['layerSize'])}"
        )
        for p in c["processes"]:
            lines.append(f"    pid {p['pid']:<6} ppid {p['ppid']:<6} {p['comm']}")
    for v in d["volumes"]:
        lines.append(f"Volume:     {v['name']} (from {v['source']})")
    return "\n".join(lines)


def main() -> None:
    cli(prog_name="kubectl-snapshot-agent")


if __name__ == "__main__":
    main()
