"""The node agent's DaemonSet, its per-node path ConfigMap and the RuntimeClass of restored pods.

Why the DaemonSet looks like this:

- privileged, hostPID: containerd runs CRIU for us, but the agent must see the host's processes and
  mounts (container rootfs upperdirs, /proc/PID of frozen tasks) to capture and stage state;
- no hostNetwork by default: the agent needs nothing of the node's network (its metrics port works on
  a pod IP; CRIU runs in containerd's process, its network-lock probe in a namespace of its own).
  ``host_network`` puts it in the node's network namespace only where the registry is reachable from
  the nodes alone (the local cluster's registry listens on loopback); ``api_server`` sets
  KUBERNETES_SERVICE_HOST/PORT where the kubernetes Service is not reachable;
- host directories are mounted at the SAME path inside, because paths cross the boundary: containerd
  (on the host) writes CRIU images into the agent's state dir, the wrapper (on the host) reads staged
  data from it, and the kubelet's pod volume dirs are named by host path. Directories, never socket
  files, are mounted, so the agent still reaches containerd after it restarts (a new socket inode);
- no mount propagation: containerd refuses HostToContainer when the host's / is a private mount (hosts
  without systemd, like the project's VMs: "is mounted on / but it is not a shared or slave mount").
  Mounts made on the host after the agent started (memory-backed emptyDirs are tmpfs) are reached
  through the host's mount namespace instead: /proc/1/root/<path> (hostPID);
- a second container, ``guard``, holds every freeze the agent makes (shim/freeze_guard.py): the agent asks it
  over a Unix socket in an emptyDir both mount, and it thaws a pod as soon as the agent's connection
  closes (the agent died, or its container restarted) or the freeze's deadline passes (it hangs). Its
  own container, so nothing that kills or hangs the agent's touches it; privileged for the cgroupfs;
- one machine may run several nodes (the local cluster): ``per_node_paths`` becomes a ConfigMap the
  agent reads at start, picking its entry by NODE_NAME; the DaemonSet mounts the smallest set of host
  directories that covers every node's paths.

The agent's command lines (``install-node`` in the init container, ``run``) take the same flags as
render()'s parameters; docs/deploy.md lists them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.deploy import keybroker

NODE_CONFIG_MAP = f"{K.AGENT_NAME}-nodes"
NODE_CONFIG_KEY = "nodes.json"
NODE_CONFIG_DIR = "/etc/kubectl-snapshot/nodes"
# What may differ per node (the node map), declared with every other setting in core/nodesettings.py.
NODE_PATH_KEYS = tuple(k for k in NS.PER_NODE_KEYS if NS.option_of(k).kind == "path")
NODE_ADDRESS_KEYS = tuple(k for k in NS.PER_NODE_KEYS if NS.option_of(k).kind == "address")
WRAPPER_IN_IMAGE = "/opt/kubectl-snapshot-runc.pyz"
READY_FILE = K.READY_FILE
METRICS_PORT = 9443  # HTTPS, authorised scrapers only (shim/service/metrics_server.py)
DEFAULT_DROPIN_DIR = NS.DEFAULTS.containerd_dropin_dir  # containerd 2.x's default config imports *.toml from here
GUARD_DIR = "/run/kubectl-snapshot-guard"  # an emptyDir shared by the agent and guard containers
GUARD_SOCKET = f"{GUARD_DIR}/guard.sock"
# The agent's requests are what it uses saving 50 small pods at a 1-minute interval (bench/density.py,
# docs/node-loss.md): on average 0.17 cores and a working set of 150 MiB there, so 200m and 256Mi.
# No memory limit: what it writes into the memory work area (a tmpfs: rootfs diffs and volume tars of
# dumps that fit, up to KUBECTL_SNAPSHOT_MEMORY_WORK_MIB for all saves at once) is charged to its cgroup
# and cannot be reclaimed, so a limit that did not grow with that setting would have the kernel kill the
# agent in the middle of a final save. No CPU limit: a throttled agent would stretch the freezes it
# holds. CRIU's own memory is containerd's, not the agent's.
AGENT_RESOURCES = {"requests": {"cpu": "200m", "memory": "256Mi"}}
GUARD_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "128Mi"}}


@dataclass(frozen=True)
class AgentSettings:
    """render()'s parameters, checked once."""

    image: str
    api_server: str | None
    state_root: str
    opt_root: str
    kubelet_root: str
    containerd_socket: str
    containerd_dropin_dir: str
    restart_command: str | None
    per_node_paths: Mapping[str, Mapping[str, str]]
    host_network: bool = False
    key_broker_url: str | None = None  # key broker (deploy/keybroker.py): the agents ask it for keys


check_path = NS.check_path


def check_per_node_paths(per_node: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """Validate {node: {setting: value}} for the settings that may differ per node (each optional)."""
    out: dict[str, dict[str, str]] = {}
    for node, paths in sorted(per_node.items()):
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", node):
            raise InvalidArgument(f"per_node_paths: {node!r} is not a node name")
        unknown = sorted(k for k in paths if NS.per_node_key(k) is None)
        if unknown:
            raise InvalidArgument(
                f"per_node_paths[{node!r}]: unknown key(s) {', '.join(unknown)}",
                hint=f"use {', '.join(NS.PER_NODE_KEYS)}",
            )
        named = {str(NS.per_node_key(k)): v for k, v in paths.items()}
        out[node] = {k: NS.check_value(k, named[k], f"per_node_paths[{node!r}].{k}") for k in sorted(named)}
    return out


def api_server_env(api_server: str) -> list[dict[str, str]]:
    """KUBERNETES_SERVICE_HOST/PORT for an https://HOST:PORT API server URL (what in-cluster config reads)."""
    url = urlsplit(api_server)
    try:
        port = url.port or 443
    except ValueError as e:
        raise InvalidArgument(f"api_server {api_server!r}: {e}") from e
    if url.scheme != "https" or not url.hostname or url.path not in ("", "/"):
        raise InvalidArgument(f"api_server must look like https://HOST[:PORT], got {api_server!r}")
    return [
        {"name": "KUBERNETES_SERVICE_HOST", "value": url.hostname},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)},
    ]


def host_mounts(settings: AgentSettings) -> list[tuple[str, str]]:
    """(host dir, hostPath type) to mount at the same path: the fewest directories covering every path.

    A default path that every per-node entry overrides is not mounted: on a machine running several
    nodes it usually does not exist, and a missing ``Directory`` hostPath keeps the pod from starting.
    """
    per_node = list(settings.per_node_paths.values())

    def host_dir(key: str, path: str) -> str:
        return posixpath.dirname(path) if key == "containerd_socket" else path

    defaults = {
        "containerd_socket": settings.containerd_socket,
        "kubelet_root": settings.kubelet_root,
        "containerd_dropin_dir": settings.containerd_dropin_dir,
    }
    needed = {settings.state_root, settings.opt_root}  # ours: created if missing
    must_exist: set[str] = set()  # containerd's and the kubelet's: their absence is a misconfiguration
    for key, default in defaults.items():
        dirs = {host_dir(key, p[key]) for p in per_node if key in p}
        if not per_node or any(key not in p for p in per_node):
            dirs.add(host_dir(key, default))
        # One node's paths live in its own subdirectory (/run/ks-cluster/ks-n1/...): mount the parent
        # they share rather than one volume per node, so the same DaemonSet fits every node.
        if len(dirs) > 1 and posixpath.commonpath(sorted(dirs)) != "/":
            dirs = {posixpath.commonpath(sorted(dirs))}
        needed |= dirs
        if key != "containerd_dropin_dir":
            must_exist |= dirs
    kept = sorted(d for d in needed if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in needed))
    return [(d, "Directory" if d in must_exist else "DirectoryOrCreate") for d in kept]


def volume_name(path: str) -> str:
    """host-var-lib-kubelet: readable, a DNS label (hashed suffix if too long)."""
    slug = "host-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")
    if len(slug) > 63:
        slug = slug[:54].rstrip("-") + "-" + hashlib.sha256(path.encode()).hexdigest()[:8]
    return slug


def node_config_map(per_node: Mapping[str, Mapping[str, str]], labels: dict[str, str]) -> dict[str, Any]:
    """The per-node paths as JSON, read by the agent at start (its entry is picked by NODE_NAME)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NODE_CONFIG_MAP, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
        "data": {NODE_CONFIG_KEY: json.dumps(per_node, indent=2, sort_keys=True) + "\n"},
    }


def runtime_class(labels: dict[str, str]) -> dict[str, Any]:
    """Restored pods run under the project's runc wrapper, registered by install-node as this handler."""
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": K.RUNTIME_CLASS, "labels": dict(labels)},
        "handler": K.RUNTIME_CLASS,
    }


def _path_flags(settings: AgentSettings) -> list[str]:
    """The node options `install-node` and `run` share (shim/agent_cli.py node_options), from the install's
    settings (core/nodesettings.py); the restart command is install-node's alone."""
    flags = [f"{NS.flag(k)}={getattr(settings, k)}" for k in NS.INSTALL_KEYS if NS.option_of(k).kind == "path"]
    if settings.per_node_paths:
        flags.append(f"--node-config={NODE_CONFIG_DIR}/{NODE_CONFIG_KEY}")
    return flags


def _env(settings: AgentSettings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # $(NODE_NAME) is expanded by the kubelet: one state dir per node, even with several per machine.
        {"name": C.ENV_STATE_DIR, "value": f"{settings.state_root}/$(NODE_NAME)"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if settings.api_server:
        env += api_server_env(settings.api_server)
    if settings.key_broker_url:
        env.append({"name": K.ENV_KEY_BROKER, "value": settings.key_broker_url})
    return env


def daemonset(settings: AgentSettings, labels: dict[str, str]) -> dict[str, Any]:
    mounts = host_mounts(settings)
    volumes: list[dict[str, Any]] = [
        {"name": volume_name(d), "hostPath": {"path": d, "type": kind}} for d, kind in mounts
    ]
    volume_mounts: list[dict[str, Any]] = [{"name": volume_name(d), "mountPath": d} for d, _ in mounts]
    if settings.per_node_paths:
        volumes.append({"name": "node-config", "configMap": {"name": NODE_CONFIG_MAP}})
        volume_mounts.append({"name": "node-config", "mountPath": NODE_CONFIG_DIR, "readOnly": True})
    pull = "IfNotPresent" if "@sha256:" in settings.image else "Always"
    common: dict[str, Any] = {
        "image": settings.image,
        "imagePullPolicy": pull,
        "env": _env(settings),
        "securityContext": {"privileged": True},
        "volumeMounts": volume_mounts,
    }
    install_args = ["install-node", f"--wrapper={WRAPPER_IN_IMAGE}", *_path_flags(settings)]
    if settings.restart_command:
        install_args.append(f"--restart-command={settings.restart_command}")
    run_args = [
        "run",
        *_path_flags(settings),
        f"--ready-file={READY_FILE}",
        f"--metrics-bind-address=:{METRICS_PORT}",
        f"--guard-socket={GUARD_SOCKET}",
    ]
    guard_mount = {"name": "guard", "mountPath": GUARD_DIR}
    selector = dict(K.AGENT_LABEL)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels | selector},
                "spec": {
                    "serviceAccountName": K.AGENT_NAME,
                    "hostNetwork": settings.host_network,
                    "hostPID": True,
                    "dnsPolicy": "ClusterFirstWithHostNet" if settings.host_network else "ClusterFirst",
                    "priorityClassName": "system-node-critical",
                    "tolerations": [{"operator": "Exists"}],
                    # Long enough for an interrupted dump to thaw the pod it froze (never lose the workload).
                    "terminationGracePeriodSeconds": 30,
                    "initContainers": [{"name": "install-node", "args": install_args, **copy.deepcopy(common)}],
                    "containers": [
                        {
                            "name": "agent",
                            "args": run_args,
                            **copy.deepcopy(common),
                            "readinessProbe": {
                                "exec": {"command": ["test", "-f", READY_FILE]},
                                "periodSeconds": 5,
                            },
                            "resources": copy.deepcopy(AGENT_RESOURCES),
                            "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
                        }
                        | {
                            "volumeMounts": [
                                *volume_mounts,
                                guard_mount,
                                memory_work_mount(),
                                *agent_key_mounts(settings),
                            ]
                        },
                        {
                            "name": "guard",
                            "image": settings.image,
                            "imagePullPolicy": pull,
                            "command": ["python3", "-m", "shim.guard"],
                            "args": [f"--socket={GUARD_SOCKET}", f"--state-dir={GUARD_DIR}/holds"],
                            "env": [e for e in _env(settings) if e["name"] != C.ENV_STATE_DIR],
                            "securityContext": {"privileged": True},
                            "volumeMounts": [guard_mount],
                            "resources": copy.deepcopy(GUARD_RESOURCES),
                        },
                    ],
                    "volumes": [
                        *volumes,
                        {"name": "guard", "emptyDir": {}},
                        memory_work_volume(),
                        *agent_key_volumes(settings),
                    ],
                },
            },
        },
    }


def agent_key_volumes(settings: AgentSettings) -> list[dict[str, Any]]:
    """The trust ConfigMap, and with the key broker its token and certificate (deploy/keybroker.py)."""
    return [*provenance_volumes(), *(keybroker.agent_volumes() if settings.key_broker_url else [])]


def agent_key_mounts(settings: AgentSettings) -> list[dict[str, Any]]:
    return [*provenance_mounts(), *(keybroker.agent_mounts() if settings.key_broker_url else [])]


def memory_work_volume() -> dict[str, Any]:
    """The host's tmpfs directory for dumps that clearly fit in memory (shim/host/memwork.py): a host path,
    because containerd's runtime writes a dump there from the host's mount namespace; the agent uses it
    only if it is a tmpfs and root's alone, else the state dir on disk."""
    return {"name": "memory-work", "hostPath": {"path": C.DEFAULT_MEMORY_WORK_DIR, "type": "DirectoryOrCreate"}}


def memory_work_mount() -> dict[str, Any]:
    """Into the agent container only, at the same path."""
    return {"name": "memory-work", "mountPath": C.DEFAULT_MEMORY_WORK_DIR}


def provenance_volumes() -> list[dict[str, Any]]:
    """What the cluster trusts (ConfigMap, made by `kubectl snapshot install`; the agents add their nodes'
    public keys). No signing key is mounted: each agent signs with its node's own key, made in its state
    dir (shim/service/nodekey.py). Optional, so an agent applied without it still starts; it then refuses to
    restore (nothing trusted) and to save (its key cannot be registered), each with a hint."""
    return [{"name": "trust", "configMap": {"name": K.TRUST_CONFIG_MAP, "optional": True}}]


def provenance_mounts() -> list[dict[str, Any]]:
    """Into the agent container only (not install-node, not the guard)."""
    return [{"name": "trust", "mountPath": K.TRUST_DIR, "readOnly": True}]


CLEANUP_NAME = "kubectl-snapshot-uninstall"


def cleanup_daemonset(live: Mapping[str, Any]) -> dict[str, Any]:
    """A one-shot DaemonSet that undoes install-node on every node the agent ran on.

    Derived from the live agent DaemonSet, so it has the same image, node paths and host mounts:
    its init container runs ``uninstall-node`` (remove the runtime wrapper and the containerd drop-in,
    restart containerd if configured), then its main container idles until `uninstall` deletes it.
    """
    ds = copy.deepcopy(dict(live))
    labels = {"app.kubernetes.io/name": CLEANUP_NAME, "app.kubernetes.io/part-of": "kubectl-snapshot"}
    meta = ds.get("metadata") or {}
    ds["metadata"] = {"name": CLEANUP_NAME, "namespace": meta.get("namespace", K.AGENT_NAMESPACE), "labels": labels}
    ds.pop("status", None)
    spec = ds["spec"]
    spec["selector"] = {"matchLabels": dict(labels)}
    template = spec["template"]
    template["metadata"] = {"labels": dict(labels)}
    pod = template["spec"]
    for init in pod.get("initContainers") or []:
        if init.get("args") and init["args"][0] == "install-node":
            init["args"] = ["uninstall-node", *(a for a in init["args"][1:] if not a.startswith("--wrapper"))]
    for c in pod.get("containers") or []:
        c.pop("args", None)
        c.pop("readinessProbe", None)
        # no ports: on a host network they are host ports, which the agent's pods still hold while
        # this runs (its pods would stay Pending, and uninstall would time out leaving it behind)
        c.pop("ports", None)
        c["command"] = ["sleep", "3600"]
    return ds
