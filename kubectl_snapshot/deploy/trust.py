"""The agent's access to the trust ConfigMap: it registers its node's signing key there.

A Role in the agent's own namespace: ``get`` and ``patch`` on exactly one ConfigMap,
``kubectl-snapshot-trust``, by name (`resourceNames`); no ``create`` (it cannot be limited by name)
and no ``delete``. What a patch may change is narrowed by the ValidatingAdmissionPolicy
``kubectl-snapshot-agent-trust`` (deploy/admission.py): only new entries for its own node's key.
The ConfigMap itself is made by `kubectl snapshot install` (app/install.py `trust_objects`).
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.deploy.rbac import RBAC

ROLE = "kubectl-snapshot-agent-trust"


def trust_role(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": RBAC,
        "kind": "Role",
        "metadata": {"name": ROLE, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [K.TRUST_CONFIG_MAP],
                "verbs": ["get", "patch"],
            },
        ],
    }


def trust_role_binding(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": {"name": ROLE, "namespace": K.AGENT_NAMESPACE, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}],
    }
