"""The agent's access to the trust ConfigMap: it registers its node's signing key there.

A Role in the agent's own namespace: ``get`` and ``patch`` on exactly one ConfigMap,
``kubectl-snapshot-trust``, by name (`resourceNames`); no ``create`` (it cannot be limited by name)
and no ``delete``. What a patch may change is narrowed by the ValidatingAdmissionPolicy
``kubectl-snapshot-agent-trust`` (deploy/admission.py): only new entries for its own node's key.
The ConfigMap itself is made by `kubectl snapshot install` (app/install.py `trust_objects`).
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy.rbac import agent_own_role, agent_own_role_binding

ROLE = "kubectl-snapshot-agent-trust"


def trust_role(labels: dict[str, str]) -> dict[str, Any]:
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [K.TRUST_CONFIG_MAP],
        "verbs": ["get", "patch"],
    }
    return agent_own_role(ROLE, labels, [rule])


def trust_role_binding(labels: dict[str, str]) -> dict[str, Any]:
    return agent_own_role_binding(ROLE, labels)
