"""Everything a cluster needs to run kubectl-snapshot, as plain Kubernetes objects.

``render()`` is the single source: ``manifests/`` (kustomize base + overlays) is generated from it by
``hack/gen-manifests.py`` and a test checks they match; the e2e tests and an installer can apply its
output directly. It is pure (dicts in, dicts out), so the objects are unit-testable without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubectl_snapshot import __version__
from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.deploy import admission, agent, crd, keybroker, keys, rbac, resume_admission, trust
from kubectl_snapshot.deploy.agent import DEFAULT_DROPIN_DIR, AgentSettings

DEFAULT_IMAGE = f"kubectl-snapshot-agent:{__version__}"
LABELS = {"app.kubernetes.io/part-of": "kubectl-snapshot"}

__all__ = ["DEFAULT_IMAGE", "LABELS", "render"]


def render(
    image: str,
    *,
    api_server: str | None = None,
    state_root: str = NS.DEFAULTS.state_root,
    opt_root: str = NS.DEFAULTS.opt_root,
    kubelet_root: str = NS.DEFAULTS.kubelet_root,
    containerd_socket: str = NS.DEFAULTS.containerd_socket,
    containerd_dropin_dir: str | None = None,
    restart_command: str | None = None,
    per_node_paths: Mapping[str, Mapping[str, str]] | None = None,
    host_network: bool = False,
    key_broker: bool = False,
    key_broker_url: str | None = None,
) -> list[dict[str, Any]]:
    """The objects to apply, in apply order (CRD and namespace before what lives in them).

    `image`: the agent image (pin it by digest in production). `api_server`: ``https://HOST:PORT`` the
    agent uses instead of the kubernetes Service (hostNetwork clusters without kube-proxy). The paths
    are host paths, mounted at the same path in the agent. `restart_command`: run on the host by
    ``install-node`` when the runtime handler was not active yet; ``{node}`` is replaced by the node
    name. `per_node_paths`: ``{node: {containerd_socket, kubelet_root, containerd_dropin_dir}}`` for
    several nodes on one machine; missing keys fall back to the defaults above. `host_network`: run the
    agent in the node's network namespace, only where the registry is reachable from the nodes alone
    (the local cluster's registry listens on loopback); nothing else in the agent needs it.
    `key_broker` (the CLI install's default; render()'s and the chart's: off): the namespace keys are read
    by the key broker only, the agents ask it (deploy/keybroker.py); `key_broker_url` is where agents reach
    it (default: its Service; a host-network cluster without kube-proxy gives ``https://127.0.0.1:PORT``, the
    broker then runs host-network too).
    """
    if not image or any(c.isspace() for c in image):
        raise InvalidArgument(f"image must be an image reference, got {image!r}")
    settings = AgentSettings(
        image=image,
        api_server=api_server,
        state_root=NS.check_value("state_root", state_root),
        opt_root=NS.check_value("opt_root", opt_root),
        kubelet_root=NS.check_value("kubelet_root", kubelet_root),
        containerd_socket=NS.check_value("containerd_socket", containerd_socket),
        containerd_dropin_dir=NS.check_value("containerd_dropin_dir", containerd_dropin_dir or DEFAULT_DROPIN_DIR),
        restart_command=NS.check_value("restart_command", restart_command) if restart_command else None,
        per_node_paths=agent.check_per_node_paths(per_node_paths or {}),
        host_network=bool(host_network),
        key_broker_url=_broker_url(key_broker, key_broker_url),
    )
    labels = dict(LABELS)
    objects = [
        crd.podsnapshot_crd(labels),
        crd.snapshotgrant_crd(labels),
        crd.snapshotpolicy_crd(labels),
        rbac.namespace(labels),
        rbac.service_account(labels),
        rbac.agent_cluster_role(labels),
        rbac.agent_cluster_role_binding(labels),
        rbac.agent_secrets_role(labels),
        *rbac.user_cluster_roles(labels),
        rbac.grant_cluster_role(labels),
        *rbac.policy_cluster_roles(labels),
        *resume_admission.roles(labels),
        # the agents read the key Secret themselves, or (with the broker) only the key broker does
        *([] if key_broker else [keys.key_role(labels), keys.key_role_binding(labels)]),
        trust.trust_role(labels),
        trust.trust_role_binding(labels),
        *admission.render(labels),
        *resume_admission.policies(labels, settings.image),  # the gate image is the agent image
        agent.runtime_class(labels),
    ]
    if settings.per_node_paths:
        objects.append(agent.node_config_map(settings.per_node_paths, labels))
    if key_broker:
        env = agent.api_server_env(settings.api_server) if settings.api_server else []
        objects += keybroker.objects(image=settings.image, labels=labels, host_network=settings.host_network, env=env)
    objects.append(agent.daemonset(settings, labels))
    return objects


def _broker_url(key_broker: bool, url: str | None) -> str | None:
    if not key_broker:
        if url:
            raise InvalidArgument("key_broker_url is for an install with the key broker (key_broker)")
        return None
    url = url or keybroker.default_url()
    if not url.startswith("https://") or any(c.isspace() for c in url):
        raise InvalidArgument(f"the key broker's URL must be https://HOST:PORT, got {url!r}")
    return url
