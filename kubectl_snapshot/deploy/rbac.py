"""Who may do what: the agent's least-privilege ClusterRole and the aggregated roles for users.

The agent's rules are the whole list of what it calls (docs/kubernetes.md), nothing more, and
docs/security.md says why it keeps each. What RBAC cannot narrow (one node, one annotation) the
agent-side ValidatingAdmissionPolicies do (deploy/admission.py):

- podsnapshots get/list/watch, podsnapshots/status get/update/patch: claim and report, never edit specs;
- pods get/list/watch: find the pod it snapshots or stages a restore for;
- pods/status patch, never ``pods patch``: the restore-status annotation; admission lets it change
  only that annotation, and only on pods bound to its own node;
- pods delete: ``spec.stop`` deletes the snapshotted pod once its snapshot is pushed (before its
  frozen containers are killed); admission limits it to pods of its own node, and the PodSnapshot
  policy lets ``stop`` through only for requesters who may delete that pod themselves;
- events create/patch: SnapshotStarted/Succeeded/Failed, RestoreStaged/Failed on the pod;
- nodes get/patch: the host-facts annotation; admission: only its own node, only that annotation;
- no ``secrets`` at all cluster-wide. Registry credentials named by a PodSnapshot or a restore pod
  are read through ``kubectl-snapshot-agent-registry-secrets`` (secrets get), which a namespace's
  admin binds in that namespace (RoleBinding) when its snapshots need credentials; admission has
  already checked that the requester may get the Secret they name.
- tokenreviews/subjectaccessreviews create: a scraper of the agent's metrics is authenticated and
  authorised by the API server (bind ``kubectl-snapshot-metrics-reader`` to the scraper's identity).

Users get PodSnapshot rights through the built-in roles by aggregation: creating a PodSnapshot is the
permission to snapshot a pod of that namespace, so it goes with ``edit``/``admin``; ``view`` can read.
Restoring is its own verb (``restore`` on podsnapshots, ClusterRole kubectl-snapshot-restore), also
aggregated to ``edit``/``admin`` and grantable alone with a RoleBinding.
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K

RBAC = "rbac.authorization.k8s.io/v1"
EDIT_ROLE = "kubectl-snapshot-edit"
METRICS_READER_ROLE = "kubectl-snapshot-metrics-reader"
VIEW_ROLE = "kubectl-snapshot-view"
RESTORE_ROLE = "kubectl-snapshot-restore"
_AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


def agent_rules() -> list[dict[str, Any]]:
    """The agent's ClusterRole rules (exactly the least-privilege list above)."""
    return [
        _rule(K.GROUP, [K.PLURAL], ["get", "list", "watch"]),
        _rule(K.GROUP, [f"{K.PLURAL}/status"], ["get", "update", "patch"]),
        _rule("", ["pods"], ["get", "list", "watch", "delete"]),
        _rule("", ["pods/status"], ["patch"]),
        _rule("", ["events"], ["create", "patch"]),
        _rule("", ["nodes"], ["get", "patch"]),
        # Who may read /metrics is the API server's call (TokenReview + SubjectAccessReview).
        _rule("authentication.k8s.io", ["tokenreviews"], ["create"]),
        _rule("authorization.k8s.io", ["subjectaccessreviews"], ["create"]),
        _rule(K.GROUP, [K.GRANT_PLURAL], ["get", "list"]),  # provenance: may A's snapshot go to B?
        *autosave_agent_rules(),
    ]


def autosave_agent_rules() -> list[dict[str, Any]]:
    """Autosave (SnapshotPolicy): read the policies, apply this node's entries of their status, create
    the saves and delete those retention drops, read a ReplicaSet's owner (a Deployment's pods)."""
    return [
        _rule(K.GROUP, [K.POLICY_PLURAL], ["get", "list", "watch"]),
        _rule(K.GROUP, [f"{K.POLICY_PLURAL}/status"], ["patch"]),
        _rule(K.GROUP, [K.PLURAL], ["create", "delete"]),
        _rule("apps", ["replicasets"], ["get"]),
    ]


def agent_secrets_role(labels: dict[str, str]) -> dict[str, Any]:
    """secrets get, bound to the agent per namespace (RoleBinding) by that namespace's admin; never cluster-wide."""
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": K.AGENT_SECRETS_ROLE, "labels": dict(labels)},
        "rules": [_rule("", ["secrets"], ["get"])],
    }


def agent_secrets_binding(namespace: str) -> dict[str, Any]:
    """The RoleBinding a namespace admin creates so that the agent may read that namespace's registry Secrets."""
    return {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": {"name": K.AGENT_SECRETS_ROLE, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": K.AGENT_SECRETS_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}],
    }


def agent_own_role(name: str, labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, Any]:
    """A Role in the agent's own namespace (its rules name single objects there by resourceNames)."""
    meta = {"name": name, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)}
    return {"apiVersion": RBAC, "kind": "Role", "metadata": meta, "rules": rules}


def agent_own_role_binding(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The agent's service account bound to `agent_own_role(name, ...)`."""
    return {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}],
    }


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
    """kubectl-snapshot-edit and -restore (aggregated to edit and admin), kubectl-snapshot-view (to view)."""
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
            "metadata": {"name": RESTORE_ROLE, "labels": dict(edit_labels)},
            "rules": [_rule(K.GROUP, [K.PLURAL], [K.RESTORE_VERB])],
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


POLICY_EDIT_ROLE = "kubectl-snapshot-policy-edit"
POLICY_VIEW_ROLE = "kubectl-snapshot-policy-view"


def policy_cluster_roles(labels: dict[str, str]) -> list[dict[str, Any]]:
    """SnapshotPolicies: edit/admin write them (admission also wants create and restore on podsnapshots
    of the creator), view reads them."""
    edit_labels = labels | {_AGGREGATE + "edit": "true", _AGGREGATE + "admin": "true"}
    view_labels = labels | {_AGGREGATE + "view": "true"}
    return [
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": POLICY_EDIT_ROLE, "labels": edit_labels},
            "rules": [
                _rule(K.GROUP, [K.POLICY_PLURAL], ["create", "get", "list", "watch", "update", "patch", "delete"])
            ],
        },
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": POLICY_VIEW_ROLE, "labels": view_labels},
            "rules": [_rule(K.GROUP, [K.POLICY_PLURAL], ["get", "list", "watch"])],
        },
    ]


GRANT_ROLE = "kubectl-snapshot-grant"


def grant_cluster_role(labels: dict[str, str]) -> dict[str, Any]:
    """SnapshotGrants give a namespace's snapshots (its pods' memory) away: `admin` only, by aggregation."""
    return {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": GRANT_ROLE, "labels": labels | {_AGGREGATE + "admin": "true"}},
        "rules": [_rule(K.GROUP, [K.GRANT_PLURAL], ["create", "get", "list", "watch", "update", "patch", "delete"])],
    }
