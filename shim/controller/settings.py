"""The agent's settings for its node, from flags and (for several nodes on one machine) a node map."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

import yaml

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import InvalidArgument


@dataclass(frozen=True)
class NodeSettings:
    node: str
    state_root: str = "/var/lib/kubectl-snapshot"
    opt_root: str = "/opt/kubectl-snapshot"
    kubelet_root: str = "/var/lib/kubelet"
    containerd_socket: str = "/run/containerd/containerd.sock"
    containerd_dropin_dir: str = "/etc/containerd/conf.d"
    restart_command: str = ""
    criu_path: str = ""  # "": the CRIU install-node puts in the node's own directory (never the host's)
    runc_path: str = ""  # "": the node's runc as containerd's shim finds it (/usr/sbin/runc, ...)
    criu_config: str = "/etc/criu/runc.conf"  # the runc-specific CRIU configuration (shim/criu_config.py)
    metrics_bind_address: str = ""  # from a node map only: several nodes sharing one host network
    guard_socket: str = ""  # the freeze guard's socket (shim/guard.py); "" = a private guard per snapshot
    signing_key_dir: str = K.SIGNING_KEY_DIR  # the mounted signing-key Secret (signs every snapshot)
    trust_dir: str = K.TRUST_DIR  # the mounted trust ConfigMap (public keys, cluster id, policy)

    @property
    def state_dir(self) -> str:
        """Per node, so that several nodes on one machine (the local test cluster) never share state."""
        return os.path.join(self.state_root, self.node)

    @property
    def wrapper_dir(self) -> str:
        return os.path.join(self.opt_root, self.node)

    @property
    def wrapper_launcher(self) -> str:
        return os.path.join(self.wrapper_dir, "kubectl-snapshot-runc")

    @property
    def criu(self) -> str:
        """The CRIU runc is handed (`runc --criu`) for every checkpoint and restore on this node."""
        return self.criu_path or os.path.join(self.wrapper_dir, "criu")


_OVERRIDABLE = (
    "kubelet_root",
    "containerd_socket",
    "containerd_dropin_dir",
    "restart_command",
    "state_root",
    "criu_path",
    "runc_path",
    "criu_config",
    "metrics_bind_address",
)
_ALIASES = {
    "kubeletRoot": "kubelet_root",
    "containerdSocket": "containerd_socket",
    "containerdDropinDir": "containerd_dropin_dir",
    "restartCommand": "restart_command",
    "stateRoot": "state_root",
    "criuPath": "criu_path",
    "runcPath": "runc_path",
    "criuConfig": "criu_config",
    "metricsBindAddress": "metrics_bind_address",
}


def apply_node_map(settings: NodeSettings, path: str | None) -> NodeSettings:
    """Override paths with this node's entry of a node map file ({node: {key: value}}), if any."""
    if not path or not os.path.exists(path):
        return settings
    with open(path) as f:
        text = f.read()
    try:
        data: Any = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidArgument(f"node map {path} is not valid JSON/YAML: {e}") from e
    entry = (data or {}).get(settings.node) or {}
    changes = {}
    for key, value in entry.items():
        name = _ALIASES.get(key, key)
        if name in _OVERRIDABLE and isinstance(value, str):
            changes[name] = value
    return replace(settings, **changes)
