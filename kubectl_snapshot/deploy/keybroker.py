"""The namespace-key broker's objects (`kubectl snapshot install`'s default, on host-network when asked;
docs/security.md, "Namespace keys released per node").

The broker (a Deployment, the agent image running ``ks-agent key-broker``: two replicas behind its
Service with a PodDisruptionBudget, one on host-network installs) is then the
only reader of the namespace-key Secret: its Role reaches that Secret by name (``get``, ``update``: it
adds a namespace's key on a save's first use, as the agents did), its ClusterRole reads pods and
PodSnapshots (is the pod on the caller's node, which save does a resuming pod restore) and creates
TokenReviews (which node the caller's token is bound to). The agents lose their key Role and get, in
their pod, a projected token for audience ``kubectl-snapshot-keys`` (only the broker accepts it; the
API server refuses it), the broker's certificate (ConfigMap made by install with the TLS Secret), and
the broker's URL.
"""

from __future__ import annotations

import copy
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy.rbac import RBAC

NAME = K.KEY_BROKER_NAME
TOKEN_S = 3600
SELECTOR = {"app.kubernetes.io/name": NAME}
REPLICAS = 2


def default_url() -> str:
    return f"https://{NAME}.{K.AGENT_NAMESPACE}.svc:{K.KEY_BROKER_PORT}"


def objects(
    *, image: str, labels: dict[str, str], host_network: bool, env: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """ServiceAccount, roles and bindings, Service, Deployment, PodDisruptionBudget (in apply order)."""
    meta = {"name": NAME, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)}
    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": K.AGENT_NAMESPACE}]
    secret_rule = {
        "apiGroups": [""],
        "resources": ["secrets"],
        "resourceNames": [K.KEY_SECRET],
        "verbs": ["get", "update"],
    }
    cluster_rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [K.GROUP], "resources": [K.PLURAL], "verbs": ["list"]},
        {"apiGroups": [K.GROUP], "resources": [K.GRANT_PLURAL], "verbs": ["list"]},  # a granted restore
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
    ]
    pull = "IfNotPresent" if "@sha256:" in image else "Always"
    port = K.KEY_BROKER_PORT
    # Behind its Service, two replicas on different nodes where there are (any answers any request: an
    # unwrap shows its snapshot), kept by a PodDisruptionBudget through drains; on the nodes' network,
    # one (a second would find the port taken where nodes share a network namespace)
    replicas = 1 if host_network else REPLICAS
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "replicas": replicas,
            # host-network clusters: one listener on the port at a time; behind the Service: a new replica
            # is ready before an old one goes
            "strategy": (
                {"type": "Recreate"}
                if host_network
                else {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
            ),
            "selector": {"matchLabels": dict(SELECTOR)},
            "template": {
                "metadata": {"labels": labels | SELECTOR},
                "spec": {
                    "serviceAccountName": NAME,
                    "hostNetwork": host_network,
                    "dnsPolicy": "ClusterFirstWithHostNet" if host_network else "ClusterFirst",
                    "priorityClassName": "system-cluster-critical",
                    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
                    "affinity": {
                        **({} if replicas == 1 else {"podAntiAffinity": _apart()}),
                        "nodeAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "preference": {
                                        "matchExpressions": [
                                            {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                                        ]
                                    },
                                }
                            ]
                        },
                    },
                    "containers": [
                        {
                            "name": "key-broker",
                            "image": image,
                            "imagePullPolicy": pull,
                            "args": ["key-broker", f"--listen=:{port}", f"--tls-dir={K.KEY_BROKER_TLS_DIR}"],
                            "env": [*copy.deepcopy(env), {"name": "PYTHONUNBUFFERED", "value": "1"}],
                            "ports": [{"name": "keys", "containerPort": port, "protocol": "TCP"}],
                            "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}},
                            "volumeMounts": [
                                {"name": "tls", "mountPath": K.KEY_BROKER_TLS_DIR, "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "tls", "secret": {"secretName": K.KEY_BROKER_TLS_SECRET}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": copy.deepcopy(meta)},
        {"apiVersion": RBAC, "kind": "Role", "metadata": copy.deepcopy(meta), "rules": [secret_rule]},
        {
            "apiVersion": RBAC,
            "kind": "RoleBinding",
            "metadata": copy.deepcopy(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            "subjects": copy.deepcopy(subject),
        },
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": dict(labels)},
            "rules": cluster_rules,
        },
        {
            "apiVersion": RBAC,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": dict(labels)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": copy.deepcopy(subject),
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": copy.deepcopy(meta),
            "spec": {"selector": dict(SELECTOR), "ports": [{"name": "keys", "port": port, "targetPort": port}]},
        },
        deployment,
        *([] if replicas == 1 else [_budget(meta)]),
    ]


def _apart() -> dict[str, Any]:
    term = {"labelSelector": {"matchLabels": dict(SELECTOR)}, "topologyKey": "kubernetes.io/hostname"}
    return {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}


def _budget(meta: dict[str, Any]) -> dict[str, Any]:
    """A drain evicts one replica at a time: saves and restores of the drained node's pods find the other."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": copy.deepcopy(meta),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": dict(SELECTOR)}},
    }


def agent_volumes() -> list[dict[str, Any]]:
    """The agent's projected token for the broker (only the broker accepts its audience) and the
    broker's certificate."""
    token = {"serviceAccountToken": {"audience": K.KEY_BROKER_AUDIENCE, "expirationSeconds": TOKEN_S, "path": "token"}}
    return [
        {"name": "key-broker-token", "projected": {"sources": [token]}},
        {"name": "key-broker-ca", "configMap": {"name": K.KEY_BROKER_CA_CONFIG_MAP}},
    ]


def agent_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "key-broker-token", "mountPath": K.KEY_BROKER_TOKEN_DIR, "readOnly": True},
        {"name": "key-broker-ca", "mountPath": K.KEY_BROKER_CA_DIR, "readOnly": True},
    ]
