"""ks-agent: the node engine as a command, usable against any containerd like `ctr`.

ks-agent checkpoint --address SOCK --namespace NS [--stop] [--volume DIR]... --to REF CONTAINER...
ks-agent restore    --address SOCK --namespace NS [--volume DIR]... REF NEWNAME...
ks-agent inspect    REF [-o json|yaml]
ks-agent export     REF [--container NAME] -o FILE   (podman's checkpoint archive)
ks-agent import     ARCHIVE --to REF [--signing-key KEY]   (a kubelet or podman checkpoint archive)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import click

from kubectl_snapshot.adapters.keystore import FileKeyProvider
from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient
from kubectl_snapshot.adapters.signatures import load_signing_key, load_trust, provenance_of
from kubectl_snapshot.console import leave
from kubectl_snapshot.console.errors import handle_errors
from kubectl_snapshot.console.inspect import inspect_data, inspect_text
from kubectl_snapshot.console.output import emit, output_option
from kubectl_snapshot.console.progress import Progress
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.artifact import load_artifact
from kubectl_snapshot.core.errors import CriuFailed, InvalidArgument, SnapshotError, render
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Sealer
from shim import freeze_guard as guard
from shim.criu import parasite
from shim.engine import criufail
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.lazyrestore import session_failure
from shim.engine.nodelazy import NodeLazyPhase, end_orphaned
from shim.engine.restore import RestoreRequest, restore
from shim.engine.staging import StatePaths
from shim.host import freezer, malloc
from shim.net import dumplock
from shim.service import localapi
from shim.service import text as agent_text
from shim.service.text import checkpoint_text, restore_text

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)
DEFAULT_ADDRESS = "/run/containerd/containerd.sock"


def find_wrapper(argv0: str | None = None, executable: str | None = None) -> str | None:
    """The runtime wrapper installed with this agent: beside the script that runs us (a venv's bin/,
    called by its full path), beside the interpreter, and only then on PATH."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    dirs = [os.path.dirname(os.path.abspath(argv0))] if os.sep in argv0 else []
    if executable:
        dirs.append(os.path.dirname(executable))
    for d in dirs:
        candidate = os.path.join(d, C.WRAPPER_BINARY_NAME)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which(C.WRAPPER_BINARY_NAME)


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


def key_options(fn: F) -> F:
    fn = click.option(
        "--key-namespace",
        default=None,
        help="Whose key seals/opens the snapshot (default: the containerd --namespace).",
    )(fn)
    fn = click.option(
        "--key-dir",
        type=click.Path(file_okay=False),
        default=None,
        show_default="$KUBECTL_SNAPSHOT_STATE_DIR/keys",
        help="Directory of the namespace keys (one 0600 file per namespace, created on first use).",
    )(fn)
    return fn


def trusted_key_option(help: str) -> Callable[[F], F]:
    """--trusted-key (repeatable; $KUBECTL_SNAPSHOT_TRUSTED_KEYS): the public keys whose signatures count."""
    return click.option(
        "--trusted-key",
        "trusted_keys",
        multiple=True,
        envvar="KUBECTL_SNAPSHOT_TRUSTED_KEYS",
        type=click.Path(exists=True),
        help=help,
    )


def key_provider(key_dir: str | None) -> FileKeyProvider:
    return FileKeyProvider(key_dir or os.path.join(StatePaths.from_env().root, "keys"))


def make_registry(ref: Reference, opts: dict[str, Any]) -> RegistryClient:
    store = CredentialStore.from_docker_config(opts.get("docker_config"))
    user, password = opts.get("registry_username"), opts.get("registry_password")
    if bool(user) != bool(password):
        raise InvalidArgument("--registry-username and --registry-password go together")
    if user and password:
        store = store.with_explicit(ref.registry, user, password)
    return RegistryClient(credentials=store, plain_http=bool(opts.get("plain_http")))


def _held_guard(socket_path: str, *, persistent: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The freeze guard at `socket_path` (the agent pod's guard container), else a private one: for one
    checkpoint, or for as long as a serving process runs (`persistent`)."""
    if socket_path:
        return contextlib.nullcontext(guard.GuardClient(socket_path))
    return guard.private_guard(persistent=persistent)


def _client(address: str, namespace: str) -> Any:
    from shim.containerd.client import ContainerdClient

    # the node's state dir: RCU grace periods expedited while it dumps (shim/host/rcu.py)
    return ContainerdClient(address, namespace, state_dir=StatePaths.from_env().root)


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
@click.option(
    "--mount-from",
    "mount_from",
    multiple=True,
    help="Another repository of --to's registry (REPO or REGISTRY/REPO) whose blobs the registry may mount "
    "instead of receiving them again (repeatable).",
)
@click.option(
    "--guard-socket",
    envvar=guard.ENV_SOCKET,
    default="",
    help="A running freeze guard's socket (default: a private guard that outlives this process).",
)
@click.option(
    "--encrypt/--no-encrypt",
    default=False,
    show_default=True,
    help="Seal every layer and chunk with AES-256-GCM under the namespace's key (docs/format.md).",
)
@click.option(
    "--signing-key",
    envvar="KUBECTL_SNAPSHOT_SIGNING_KEY",
    type=click.Path(exists=True),
    help="ECDSA P-256 PEM key (or a dir with signing.key) that signs the snapshot, cosign-style. "
    "Without it the snapshot is unsigned, and restores refuse it unless told to trust unverified ones.",
)
@key_options
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
    mount_from: tuple[str, ...],
    guard_socket: str,
    encrypt: bool,
    key_dir: str | None,
    key_namespace: str | None,
    signing_key: str | None,
    output: str,
    containers: tuple[str, ...],
    **registry_opts: Any,
) -> None:
    """Freeze CONTAINER... together, dump them with CRIU and push one snapshot to --to.

    The freeze is held through a freeze guard (shim/freeze_guard.py): if this process is killed or hangs past
    the freeze's deadline, the guard thaws the containers within moments."""
    with (
        _held_guard(guard_socket) as guard_client,
        _client(address, namespace) as containerd,
        Progress("checkpoint") as bar,
    ):
        data = checkpoint_data(
            _args_from(_CheckpointArgs, click.get_current_context().params),
            guard_client=guard_client,
            containerd=containerd,
            on_phase=bar.phase,
            on_bytes=bar.advance,
        )
    emit(data, output, checkpoint_text)


REGISTRY_OPTIONS = ("plain_http", "registry_username", "registry_password", "docker_config")
A = TypeVar("A")


def _args_from(cls: Callable[..., A], params: dict[str, Any]) -> A:
    """A command's arguments from its parsed options, by name (the fields are named as the options)."""
    names = [f.name for f in fields(cls) if f.name != "registry_opts"]  # type: ignore[arg-type]
    return cls(**{n: params[n] for n in names}, registry_opts={k: params[k] for k in REGISTRY_OPTIONS})


@dataclass(frozen=True)
class _CheckpointArgs:
    namespace: str
    to: str
    stop: bool
    volumes: tuple[str, ...]
    no_tcp_established: bool
    keep_work: bool
    mount_from: tuple[str, ...]
    encrypt: bool
    key_dir: str | None
    key_namespace: str | None
    signing_key: str | None
    containers: tuple[str, ...]
    registry_opts: dict[str, Any]


def checkpoint_data(
    a: _CheckpointArgs,
    *,
    guard_client: Any,
    containerd: Any,
    on_phase: Callable[[str], None],
    on_bytes: Callable[[int, int], None],
) -> dict[str, Any]:
    """`checkpoint`'s work and its result as data (run here, or by the node's agent for a client)."""
    target = Reference.parse(a.to)
    registry = make_registry(target, a.registry_opts)
    sealer = None
    if a.encrypt:
        ns = a.key_namespace or a.namespace
        sealer = Sealer(key_provider(a.key_dir).namespace_key(ns, create=True), ns)
    sources = [
        Reference.parse(m if m.startswith(target.registry + "/") else f"{target.registry}/{m}") for m in a.mount_from
    ]
    registry.add_mount_sources(sources)
    result = checkpoint(
        CheckpointRequest(
            containers=a.containers,
            target=target,
            volumes=a.volumes,
            stop=a.stop,
            namespace=a.namespace,
            tcp_established=not a.no_tcp_established,
            keep_work=a.keep_work,
            signing_key=load_signing_key(a.signing_key) if a.signing_key else None,
            node=os.uname().nodename,
        ),
        containerd=containerd,
        registry=registry,
        paths=StatePaths.from_env(),
        freezer_for=guard_client.freezer_for,
        memory_of=freezer.task_memory,
        on_phase=on_phase,
        on_bytes=on_bytes,
        sealer=sealer,
        net_lock=dumplock.pod_network_locked,
        criu_lock=criufail.cleaned_after_failure,
        criu_cure=parasite.cured_after_failure,
    )
    return {
        "reference": str(result.reference),
        "tag": str(result.tagged),
        "encrypted": sealer is not None,
        "size": result.size,
        "uploaded": result.uploaded,
        "mounted": len(registry.mounted),
        "timingsMs": {k: round(v, 1) for k, v in result.timings_ms.items()},
        "frozenBy": result.frozen_by,
        "dumpedTo": "memory" if result.work_in_memory else "disk",
        "containers": [c.name for c in result.config.containers],
        "stopped": a.stop,
        "signedBy": result.signed_by,
    }


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
    default=lambda: find_wrapper() or "",
    show_default=f"{C.WRAPPER_BINARY_NAME} beside ks-agent, else on PATH",
    help="The runc-compatible wrapper the new containers run under.",
)
@click.option("--runc-root", default="", help="runc state root for the new containers (default: the shim's).")
@click.option(
    "--log-dir",
    default="/var/log/kubectl-snapshot",
    show_default=True,
    help="Where container stdout/stderr go.",
)
@key_options
@trusted_key_option(
    "Public key PEM (or a dir of *.pub, e.g. the trust ConfigMap) whose signatures are trusted (repeatable)."
)
@click.option(
    "--allow-unverified",
    is_flag=True,
    help="Restore even without a signature from a trusted key (you vouch for the snapshot yourself).",
)
@click.option(
    "--lazy",
    is_flag=True,
    help="Run the containers before their memory is back: this command serves their pages from the "
    "registry and returns once every page is in (docs/lazy-restore.md); stopping it (Ctrl-C) ends them.",
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
    key_dir: str | None,
    key_namespace: str | None,
    trusted_keys: tuple[str, ...],
    allow_unverified: bool,
    lazy: bool,
    output: str,
    ref: str,
    names: tuple[str, ...],
    **registry_opts: Any,
) -> None:
    """Pull REF, verify it and restore its containers as NAME... (one per snapshotted container)."""
    with _client(address, namespace) as containerd, Progress("restore") as bar, _stopped_as_interrupt():
        data = restore_data(
            _args_from(_RestoreArgs, click.get_current_context().params),
            containerd=containerd,
            on_phase=bar.phase,
            on_bytes=bar.advance,
        )
    emit(data, output, restore_text)


@contextlib.contextmanager
def _stopped_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt as SIGINT does, so that a lazy restore's containers are
    ended before the pages they wait for stop coming (shim/engine/nodelazy.py)."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class _RestoreArgs:
    namespace: str
    volumes: tuple[str, ...]
    runtime_binary: str
    runc_root: str
    log_dir: str
    key_dir: str | None
    key_namespace: str | None
    trusted_keys: tuple[str, ...]
    allow_unverified: bool
    lazy: bool
    ref: str
    names: tuple[str, ...]
    registry_opts: dict[str, Any]


def restore_data(
    a: _RestoreArgs, *, containerd: Any, on_phase: Callable[[str], None], on_bytes: Callable[[int, int], None]
) -> dict[str, Any]:
    """`restore`'s work and its result as data (run here, or by the node's agent for a client)."""
    source = Reference.parse(a.ref)
    registry = make_registry(source, a.registry_opts)
    if not a.runtime_binary:
        raise InvalidArgument(
            f"{C.WRAPPER_BINARY_NAME} was not found beside {sys.argv[0]} nor on PATH",
            hint=f"pass --runtime-binary /path/to/{C.WRAPPER_BINARY_NAME}",
        )
    result = restore(
        RestoreRequest(
            source=source,
            new_ids=a.names,
            runtime_binary=os.path.abspath(a.runtime_binary),
            volumes=[os.path.abspath(v) for v in a.volumes],
            runc_root=a.runc_root,
            log_dir=a.log_dir,
            trust=load_trust(list(a.trusted_keys), allow_unverified=a.allow_unverified),
            early_create=os.environ.get(C.ENV_EARLY_CREATE, "1") != "0",
            early_restore=os.environ.get(C.ENV_EARLY_RESTORE, "1") != "0",
            lazy=a.lazy,
        ),
        containerd=containerd,
        registry=registry,
        paths=StatePaths.from_env(),
        namespace=a.namespace,
        on_phase=on_phase,
        on_bytes=on_bytes,
        keys=key_provider(a.key_dir),
        key_namespace=a.key_namespace,
    )
    data: dict[str, Any] = {
        "reference": str(result.reference),
        "containers": [{"name": cid, "pid": pid} for cid, pid in result.containers],
        "provenance": result.provenance,
        "timingsMs": {k: round(v, 1) for k, v in result.timings_ms.items()},
    }
    if result.eager_because:
        data["eagerBecause"] = result.eager_because
    if result.lazy is not None:
        data["lazy"] = _serve_lazily(result.lazy, source, on_phase, on_bytes)
    return data


def _serve_lazily(
    phase: NodeLazyPhase, source: Reference, on_phase: Callable[[str], None], on_bytes: Callable[[int, int], None]
) -> list[dict[str, Any]]:
    """Serve the restored containers' pages until every one is in; a container whose pages could not all
    come was ended (killed), and the command fails saying which and why."""
    on_phase("lazy")
    total = phase.total_bytes()
    try:
        outcomes = phase.wait(lambda n: on_bytes(n, total))
    except BaseException as e:  # stopped (Ctrl-C, SIGTERM): the containers still waiting for pages are ended
        why = "the restore command was stopped before every page was in"
        ended = phase.end(why)
        if isinstance(e, KeyboardInterrupt):
            raise CriuFailed(
                f"{why}: container(s) {', '.join(ended) or '(none)'} were ended (killed), since the pages they "
                "still waited for would never have come",
                hint="restore again, and let the command run until it returns (without --lazy it returns once "
                "the memory is back, and the containers need nothing from it after)",
            ) from e
        raise
    failed = [o for o in outcomes if o.error]
    if failed:
        raise session_failure(
            ", ".join(o.container for o in failed), source.registry, "; ".join(o.error for o in failed)
        )
    return [{"name": o.container, "pages": o.pages, "seconds": round(o.seconds, 2)} for o in outcomes]


class WarmAgent:
    """Serves `checkpoint` and `restore` for clients on the node-local socket (shim/service/localapi.py) with this
    process's containerd connection and freeze guard: one request at a time, each answered as the
    standalone command would have answered it, or declined where it could not be."""

    def __init__(self, address: str, namespace: str, containerd: Any, guard_client: Any) -> None:
        self.address, self.namespace = address, namespace
        self.containerd, self.guard_client = containerd, guard_client
        self._lock = threading.Lock()

    def handle(self, request: dict[str, Any], send: localapi.Send) -> None:
        why = self._unlike_here(request)
        if why:
            self._decline(send, why)
            return
        name = str(request["command"])
        command = cli.commands[name]
        try:
            with command.make_context(name, [str(a) for a in request.get("argv") or ()]) as ctx:
                params = dict(ctx.params)
        except (click.exceptions.Exit, click.ClickException) as e:  # standalone, it prints the usage error
            self._decline(send, f"usage: {e}")
            return
        if (params["address"], params["namespace"]) != (self.address, self.namespace):
            self._decline(send, f"this agent serves containerd {self.address} namespace {self.namespace}")
            return
        if params.get("lazy"):  # its pages are served by the process that restored it, for as long as it takes
            self._decline(send, "a lazy restore is served by the command that runs it")
            return
        with self._lock:
            send({"phase": "queued"})
            try:
                data = self._run(name, params, send)
            except SnapshotError as e:
                log.info("node-local %s failed: %s", name, e.message)
                send({"error": render(e), "exit": e.exit_code})
                return
            except Exception as e:
                log.exception("node-local %s failed", name)
                send({"error": f"error: internal error in the node's agent: {type(e).__name__}: {e}", "exit": 1})
                return
        log.info("node-local %s served: %s", name, data.get("reference"))
        answer = {"result": data, "output": params["output"]}
        try:  # printed as is by the client (launcher/agentclient.go knows no formats)
            answer["rendered"] = agent_text.rendered(name, data, str(params["output"]))
        except SnapshotError as e:  # a bad -o jsonpath= template: the work is done, the client says why
            answer["render_error"] = render(e)
        send(answer)

    @staticmethod
    def _decline(send: localapi.Send, why: str) -> None:
        log.info("node-local request declined (the client runs it itself): %s", why)
        send({"declined": why})

    def _unlike_here(self, request: dict[str, Any]) -> str:
        if request.get("cwd") != os.getcwd():
            return "another working directory"
        env = request.get("env")
        differ = localapi.env_differences(env if isinstance(env, dict) else {}, os.environ)
        return f"other values of {', '.join(differ)}" if differ else ""

    def _run(self, name: str, p: dict[str, Any], send: localapi.Send) -> dict[str, Any]:
        sent = threading.Lock()
        last, pending = [0.0], [0]

        def on_bytes(n: int, total: int) -> None:  # progress lines at most every 50 ms (from worker threads)
            with sent:
                pending[0] += n
                now = time.monotonic()
                if now - last[0] < 0.05:
                    return
                last[0], count, pending[0] = now, pending[0], 0
            send({"bytes": [count, total]})

        def on_phase(phase: str) -> None:
            send({"phase": phase})

        if name == "checkpoint":
            own_guard = p["guard_socket"]
            return checkpoint_data(
                _args_from(_CheckpointArgs, p),
                guard_client=guard.GuardClient(own_guard) if own_guard else self.guard_client,
                containerd=self.containerd,
                on_phase=on_phase,
                on_bytes=on_bytes,
            )
        return restore_data(
            _args_from(_RestoreArgs, p),
            containerd=self.containerd,
            on_phase=on_phase,
            on_bytes=on_bytes,
        )


def _socket_option(fn: F) -> F:
    return click.option(
        "--socket",
        "socket_path",
        default=lambda: localapi.socket_path(os.environ, StatePaths.from_env().root) or "",
        show_default=f"${localapi.SOCKET_ENV}, else {localapi.SOCKET_NAME} in the state dir",
        help="The node-local socket `ks-agent checkpoint|restore` reach this agent on (empty: none).",
    )(fn)


@cli.command("serve")
@containerd_options
@_socket_option
@click.option(
    "--guard-socket",
    envvar=guard.ENV_SOCKET,
    default="",
    help="A running freeze guard's socket (default: a private guard for as long as this runs).",
)
@handle_errors
def serve_cmd(address: str, namespace: str, socket_path: str, guard_socket: str) -> None:
    """Serve `checkpoint` and `restore` for one containerd on the node-local socket, without Kubernetes
    (the DaemonSet's `run` serves the node's containerd the same way)."""
    import signal

    if not socket_path:
        raise InvalidArgument("no socket to serve on", hint=f"pass --socket PATH or set {localapi.SOCKET_ENV}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with _held_guard(guard_socket, persistent=True) as guard_client, _client(address, namespace) as containerd:
        server = localapi.LocalServer(socket_path, WarmAgent(address, namespace, containerd, guard_client).handle)
        server.start()
        try:
            while not stop.wait(1.0):
                pass
        finally:
            server.stop()


@cli.command("key-broker")
@click.option("--listen", default=f":{K.KEY_BROKER_PORT}", show_default=True, help="HOST:PORT to serve on.")
@click.option(
    "--tls-dir",
    default=K.KEY_BROKER_TLS_DIR,
    show_default=True,
    help="tls.crt and tls.key (the Secret `kubectl snapshot install` makes with the key broker).",
)
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Out-of-cluster use (development).")
@handle_errors
def key_broker_cmd(listen: str, tls_dir: str, kubeconfig: str | None) -> None:
    """Serve the namespace keys' operations to the agents, each for a pod of the caller's own node
    (the Deployment `kubectl snapshot install` makes unless --no-key-broker; docs/security.md)."""
    import signal

    from kubectl_snapshot.adapters.keystore import SecretKeyProvider
    from kubectl_snapshot.adapters.kube import KubeClient
    from shim.service import keybroker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise InvalidArgument(f"--listen must be [HOST]:PORT, got {listen!r}")
    kube = KubeClient.from_config(kubeconfig, None) if kubeconfig else KubeClient.in_cluster()
    broker = keybroker.Broker(kube, SecretKeyProvider(kube))
    server = keybroker.serve(
        broker,
        host=host or "0.0.0.0",
        port=int(port),
        cert_file=os.path.join(tls_dir, "tls.crt"),
        key_file=os.path.join(tls_dir, "tls.key"),
    )
    log.info("key broker: https://%s%s", listen, keybroker.PATH)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()


@cli.command("recover")
@containerd_options
@handle_errors
def recover_cmd(address: str, namespace: str) -> None:
    """Thaw containers a killed `checkpoint` left frozen (the agent DaemonSet does this at start), and end
    those a killed `restore --lazy` left running with pages still to come."""
    from shim.engine.checkpoint import recover_interrupted

    paths = StatePaths.from_env()
    with _client(address, namespace) as containerd:
        thawed = recover_interrupted(containerd, paths, freezer.lookup, dumplock.release_leftover)
        ended = end_orphaned(
            os.path.dirname(paths.staged_by_id("x")),
            lambda cid: containerd.kill_task(cid, 9, all=True),
            f"{containerd.address} {namespace}",
        )
    lines = [f"{cid}\tthawed" for cid in thawed] + [
        f"{cid}\tended (its lazy restore was killed with pages still to come)" for cid in ended
    ]
    click.echo("\n".join(lines) or "nothing to recover")


@cli.command("inspect")
@registry_options
@trusted_key_option("Public key PEM (or a dir of *.pub) to verify the signature with (repeatable).")
@output_option
@click.argument("ref")
@handle_errors
def inspect_cmd(output: str, ref: str, trusted_keys: tuple[str, ...], **registry_opts: Any) -> None:
    """Show what a snapshot holds: containers, process trees, memory, host facts, signature."""
    source = Reference.parse(ref)
    registry = make_registry(source, registry_opts)
    artifact = load_artifact(registry, source)
    prov = provenance_of(registry, artifact.reference, load_trust(list(trusted_keys)))
    emit(inspect_data(artifact, prov), output, inspect_text)


@cli.command("export")
@containerd_options
@registry_options
@key_options
@click.option("--container", default=None, help="The snapshot's container to export (default: its only one).")
@click.option("-o", "--output", "output_file", required=True, type=click.Path(dir_okay=False), help="The new file.")
@click.option(
    "--oci-image",
    default=None,
    help="Also push the archive as the OCI checkpoint image CRI-O restores (REGISTRY/REPO[:TAG]).",
)
@click.option("--name", default=None, help="The name podman gives the restored container (default: the container's).")
@click.option(
    "--image-id",
    default=None,
    help="podman's id of the container's image (its config digest; default: looked up in containerd).",
)
@trusted_key_option("Public key PEM (or a dir of *.pub) whose signatures are trusted (repeatable).")
@click.option("--allow-unverified", is_flag=True, help="Export even without a signature from a trusted key.")
@click.option(
    "--from-cluster",
    is_flag=True,
    help="A cluster's snapshot: its namespace keys and trust from the agent's Secret and ConfigMap "
    "(needs read access to both, in the agent's namespace; --kubeconfig or $KUBECONFIG).",
)
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="With --from-cluster: the cluster.")
@click.argument("ref")
@handle_errors
def export_cmd(
    address: str,
    namespace: str,
    key_dir: str | None,
    key_namespace: str | None,
    container: str | None,
    output_file: str,
    oci_image: str | None,
    name: str | None,
    image_id: str | None,
    trusted_keys: tuple[str, ...],
    allow_unverified: bool,
    from_cluster: bool,
    kubeconfig: str | None,
    ref: str,
    **registry_opts: Any,
) -> None:
    """Write one container of REF as the checkpoint archive `podman container restore --import` and
    checkpointctl read (verified and authorised as a restore; the file holds its memory unencrypted)."""
    from shim.engine.export import UNENCRYPTED_WARNING, ExportRequest, export, image_id_lookup

    source = Reference.parse(ref)
    image_ref = Reference.parse(oci_image) if oci_image else None
    trust = load_trust(list(trusted_keys), allow_unverified=allow_unverified)
    keys: Any = key_provider(key_dir)
    if from_cluster:
        keys, trust = _cluster_keys_and_trust(kubeconfig, trust)
    with contextlib.ExitStack() as stack:
        result = export(
            ExportRequest(
                source=source,
                output=output_file,
                container=container,
                name=name,
                trust=trust,
                key_namespace=key_namespace,
                oci_image=image_ref,
            ),
            registry=make_registry(source, registry_opts),
            image_registry=make_registry(image_ref, registry_opts) if image_ref is not None else None,
            paths=StatePaths.from_env(),
            keys=keys,
            image_id_of=image_id_lookup(image_id, lambda: stack.enter_context(_client(address, namespace))),
        )
    where = [result.output, *([result.image] if result.image else [])]
    for w in (UNENCRYPTED_WARNING.format(path=" and ".join(where), name=result.container), *result.warnings):
        click.echo(f"warning: {w}", err=True)
    click.echo("\n".join(where))
    flags = " ".join(result.restore_flags)
    click.echo(f"restore it with: podman container restore --import {result.output} {flags}".rstrip(), err=True)


@cli.command("import")
@registry_options
@click.option("--to", required=True, help="Where to push the snapshot: REGISTRY/REPO[:TAG].")
@click.option(
    "--signing-key",
    envvar="KUBECTL_SNAPSHOT_SIGNING_KEY",
    type=click.Path(exists=True),
    help="The importer's own ECDSA P-256 PEM key (or a dir with signing.key): restores trust it only where "
    "an administrator lists it. Without it the snapshot is unsigned.",
)
@click.option("--name", default=None, help="The container's name (default: the archive's).")
@click.option("--namespace", "origin_namespace", default=None, help="The origin namespace (default: the archive's).")
@click.option("--pod", default=None, help="The origin pod's name (default: the archive's).")
@click.option("--node", default="", help="The node the checkpoint was taken on.")
@click.option("--image-digest", default="", help="The image's manifest digest, which a restore then requires.")
@click.option(
    "--pod-manifest",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The pod the checkpoint was taken from (kubectl get pod NAME -o json): recorded so that "
    "`kubectl snapshot restore` recreates it. Without it the snapshot restores on a node only.",
)
@output_option
@click.argument("archive", type=click.Path(dir_okay=False))
@handle_errors
def import_cmd(
    to: str,
    signing_key: str | None,
    name: str | None,
    origin_namespace: str | None,
    pod: str | None,
    node: str,
    image_digest: str,
    pod_manifest: str | None,
    output: str,
    archive: str,
    **registry_opts: Any,
) -> None:
    """Turn the checkpoint archive ARCHIVE (the kubelet's checkpoint API, `podman container checkpoint
    --export`) into a snapshot at --to, signed by --signing-key: restore it like any snapshot."""
    from shim.engine.importer import ImportRequest, import_archive

    target = Reference.parse(to)
    pod_record = None
    if pod_manifest:
        import json

        from shim.controller.podinfo import record_pod

        with open(pod_manifest) as f:
            pod_obj = json.load(f)
        pod_record = record_pod(pod_obj, node or str((pod_obj.get("spec") or {}).get("nodeName") or ""))
    result = import_archive(
        ImportRequest(
            archive=archive,
            target=target,
            signing_key=load_signing_key(signing_key) if signing_key else None,
            name=name,
            namespace=origin_namespace,
            pod=pod,
            node=node,
            image_digest=image_digest,
            pod_record=pod_record,
        ),
        registry=make_registry(target, registry_opts),
        paths=StatePaths.from_env(),
    )
    if not result.signed_by:
        click.echo("warning: unsigned: restores refuse it unless they allow unverified snapshots", err=True)
    click.echo("warning: stored unencrypted (the memory as the archive held it)", err=True)
    src = result.source
    emit(
        {
            "reference": str(result.reference),
            "tag": str(result.tagged),
            "container": src.name,
            "image": src.image,
            "pod": result.config.group,
            "namespace": result.config.namespace,
            "from": src.runtime,
            "signedBy": result.signed_by,
        },
        output,
        lambda d: f"{d['reference']}\n",
    )


def _cluster_keys_and_trust(kubeconfig: str | None, trust: Any) -> tuple[Any, Any]:
    """The namespace keys of the cluster's key Secret and its trust ConfigMap (merged with `trust`): the
    agents' own, readable by cluster administrators only (docs/security.md)."""
    from kubectl_snapshot.adapters.keystore import SecretKeyProvider
    from kubectl_snapshot.adapters.kube import KubeClient
    from kubectl_snapshot.adapters.signatures import merge_trust, trust_from_data

    kube = KubeClient.from_config(kubeconfig) if kubeconfig else KubeClient.in_cluster()
    data = kube.get_config_map(K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP).get("data") or {}
    cluster_trust = trust_from_data({str(k): str(v) for k, v in data.items()})
    return SecretKeyProvider(kube), merge_trust([trust, cluster_trust], allow_unverified=trust.allow_unverified)


def main() -> None:
    """The `ks-agent` program (tests call `cli` in-process instead)."""
    malloc.tune()  # chunk buffers reused from the heap, not mmapped and faulted in per chunk
    leave.run(lambda: cli(prog_name="ks-agent"))


# --- the DaemonSet side -------------------------------------------------------------------------


def node_options(fn: F) -> F:
    """The node settings as options, from their one declaration (kubectl_snapshot/core/nodesettings.py)."""
    opts = []
    for name, opt, default in NS.options():
        if not opt.cli:
            continue
        if name == "node":
            opts.append(click.option("--node", envvar=opt.env, required=True, help=opt.help))
            continue
        opts.append(
            click.option(
                NS.flag(name), name, envvar=opt.env, default=default, show_default=bool(default), help=opt.help
            )
        )
    opts.append(
        click.option(
            "--node-config",
            "--node-map",
            "node_map",
            type=click.Path(dir_okay=False),
            default=None,
            help="JSON/YAML {node: {" + ", ".join(NS.PER_NODE_KEYS) + "}} overriding these settings per node.",
        )
    )
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _node_settings(kw: dict[str, Any]) -> NS.NodeSettings:
    from shim.controller.settings import apply_node_map

    values = {name: kw.pop(name) for name, opt, _ in NS.options() if opt.cli}
    for name, value in values.items():
        if value and name != "node":
            NS.check_value(name, value, NS.flag(name))
    return apply_node_map(NS.NodeSettings(**values), kw.pop("node_map"))


@cli.command("run")
@node_options
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Out-of-cluster use (development).")
@click.option("--ready-file", default=K.READY_FILE, show_default=True, help="Written once the agent is watching.")
@handle_errors
def run_cmd(kubeconfig: str | None, ready_file: str, **kw: Any) -> None:
    """Run the agent: take PodSnapshots for pods on this node, stage restores for pods created here."""
    import logging

    from kubectl_snapshot.adapters.kube import KubeClient
    from shim.controller.run import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _node_settings(kw)
    kube = KubeClient.from_config(kubeconfig, None) if kubeconfig else KubeClient.in_cluster()
    with _node_local_api(settings):
        run(kube, settings, ready_file=ready_file, metrics_address=settings.metrics_bind_address)


@contextlib.contextmanager
def _node_local_api(settings: Any) -> Iterator[None]:
    """`ks-agent checkpoint|restore -n k8s.io` on this node (in the agent's container) served by this
    agent: its containerd connection, its freeze guard (shim/service/localapi.py). Off with
    $KUBECTL_SNAPSHOT_AGENT_SOCKET=none."""
    path = localapi.socket_path(os.environ, settings.state_dir)
    if not path:
        yield
        return
    address, namespace = settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE
    with _held_guard(settings.guard_socket, persistent=True) as guard_client, _client(address, namespace) as containerd:
        server = localapi.LocalServer(path, WarmAgent(address, namespace, containerd, guard_client).handle)
        try:
            server.start()
        except OSError as e:  # a convenience for node-level commands: the agent's work goes on without it
            log.warning("no node-local API on %s: %s (ks-agent checkpoint|restore run standalone)", path, e)
        try:
            yield
        finally:
            server.stop()


@cli.command("install-node")
@node_options
@click.option(
    "--wrapper",
    "--wrapper-pyz",
    "wrapper_pyz",
    default="/opt/kubectl-snapshot-runc.pyz",
    show_default=True,
    help="The runtime wrapper zipapp to install.",
)
@click.option(
    "--bundle",
    default="/usr/local/lib/kubectl-snapshot/node-bundle",
    show_default=True,
    help="The node bundle (CRIU, the hook's Python, their loader and libraries) to install.",
)
@handle_errors
def install_node_cmd(wrapper_pyz: str, bundle: str, **kw: Any) -> None:
    """Install the node bundle, the runtime wrapper and the containerd drop-in on this node (init container)."""
    from shim.controller.node_install import install

    r = install(_node_settings(kw), wrapper_pyz=wrapper_pyz, bundle=bundle)
    click.echo(f"node bundle {r.bundle}; CRIU {r.criu}")
    click.echo(
        f"runtime wrapper {r.launcher}; drop-in {r.dropin} ({'changed' if r.changed else 'unchanged'}"
        f"{', containerd restarted' if r.restarted else ''})"
    )
    if r.criu_config is not None:
        c = r.criu_config
        click.echo(f"CRIU configuration {c.path}: {c.state}" + (f" ({c.detail})" if c.detail else ""))
    if r.kdat is not None:
        k = r.kdat
        click.echo(f"CRIU kernel-feature cache {k.path}: {k.state}" + (f" ({k.detail})" if k.detail else ""))
    if r.rcu:
        click.echo(f"expedited RCU grace periods: {r.rcu}")
    if r.work_fs is not None:
        w = r.work_fs
        click.echo(f"memory work area {w.path}: {w.state}" + (f" ({w.detail})" if w.detail else ""))


@cli.command("uninstall-node")
@node_options
@handle_errors
def uninstall_node_cmd(**kw: Any) -> None:
    """Remove the runtime wrapper and the containerd drop-in from this node."""
    from shim.controller.node_install import uninstall

    uninstall(_node_settings(kw))
    click.echo("removed")


if __name__ == "__main__":
    main()
