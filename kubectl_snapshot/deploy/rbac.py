"""Who may do what: the agent's least-privilege ClusterRole and the aggregated roles for users.

The agent's rules are the whole list of what it calls (docs/kubernetes.md), nothing more:

- podsnapshots get/list/watch, podsnapshots/status get/update/patch: claim and report, never edit specs;
- pods get/list/watch/patch/delete: find the pod, set the restore-status annotation, and for
  ``spec.stop`` delete the snapshotted pod once its snapshot is pushed (before its frozen containers
  are killed, so that the kubelet does not restart them). This lets anyone allowed to create a
  PodSnapshot delete pods of that namespace through ``stop``; grant PodSnapshot create only to those
  who may delete pods there (the aggregated ``edit``/``admin`` roles already can);
- events create/patch: SnapshotStarted/Succeeded/Failed, RestoreStaged/Failed on the pod;
- secrets get: the registrySecret a PodSnapshot or a restored pod names, in its own namespace. It is
  cluster-wide because PodSnapshots come from any namespace; ``get`` (no list/watch) means the agent
  can only read a secret whose name it was given. A tighter setup binds a ClusterRole with just this
  rule per namespace (RoleBinding) where snapshots with credentials are allowed (docs/deploy.md);
- nodes get/patch: the host-facts annotation on its own node;
- tokenreviews/subjectaccessreviews create: a scraper of the agent's metrics is authenticated and
  authorised by the API server (bind ``kubectl-snapshot-metrics-reader`` to the scraper's identity).

Users get PodSnapshot rights through the built-in roles by aggregation: creating a PodSnapshot is the
permission to snapshot a pod of that namespace, so it goes with ``edit``/``admin``; ``view`` can read.
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kube as K

RBAC = "rbac.authorization.k8s.io/v1"
EDIT_ROLE = "kubectl-snapshot-edit"
METRICS_READER_ROLE = "kubectl-snapshot-metrics-reader"
VIEW_ROLE = "kubectl-snapshot-view"
_AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def agent_rules() -> list[dict[str, Any]]:
    """The agent's ClusterRole rules (exactly the least-privilege list above)."""
    return [
        _rule(K.GROUP, [K.PLURAL], ["get", "list", "watch"]),
        _rule(K.GROUP, [f"{K.PLURAL}/status"], ["get", "update", "patch"]),
        _rule("", ["pods"], ["get", "list", "watch", "patch", "delete"]),
        _rule("", ["events"], ["create", "patch"]),
        _rule("", ["secrets"], ["get"]),
        _rule("", ["nodes"], ["get", "patch"]),
        # Who may read /metrics is the API server's call (TokenReview + SubjectAccessReview).
        _rule("authentication.k8s.io", ["tokenreviews"], ["create"]),
        _rule("authorization.k8s.io", ["subjectaccessreviews"], ["create"]),
    ]


def namespace(labels: dict[str, str]) -> dict[str, Any]:
    """The agent's namespace; Pod Security 'privileged' because the agent must be (CRIU, host PID)."""
    psa = {f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE, "labels": labels | psa}}


def service_account(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
    }


def agent_cluster_role(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": K.AGENT_NAME, "labels": dict(labels)},
        "rules": agent_rules(),
    }


def agent_cluster_role_binding(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRoleBinding",
        "metadata": {"name": K.AGENT_NAME, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": K.AGENT_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}],
    }


def user_cluster_roles(labels: dict[str, str]) -> list[dict[str, Any]]:
    """kubectl-snapshot-edit (aggregated to edit and admin) and kubectl-snapshot-view (to view)."""
    edit_labels = labels | {_AGGREGATE + "edit": "true", _AGGREGATE + "admin": "true"}
    view_labels = labels | {_AGGREGATE + "view": "true"}
    return [
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": EDIT_ROLE, "labels": edit_labels},
            "rules": [_rule(K.GROUP, [K.PLURAL], ["create", "get", "list", "watch", "delete"])],
        },
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": VIEW_ROLE, "labels": view_labels},
            "rules": [_rule(K.GROUP, [K.PLURAL], ["get", "list", "watch"])],
        },
        {
            # Not aggregated: bind it to the identity of the Prometheus that scrapes the agents.
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": METRICS_READER_ROLE, "labels": dict(labels)},
            "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
        },
    ]
