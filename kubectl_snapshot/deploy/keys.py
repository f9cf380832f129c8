"""The agent's access to the namespace-key Secret (encryption at rest, adapters/keystore.py).

A Role in the agent's own namespace, not a ClusterRole: the agent reads and updates exactly one Secret,
``kubectl-snapshot-keys``, by name (`resourceNames`), and creates none. `create` cannot be limited by
name in RBAC, and a Role that may create Secrets in the agent's namespace lets whoever holds the
agent's token mint a ServiceAccount token Secret for it that never expires and outlives the node. The
Secret itself is not part of the manifests (re-applying them must never replace, and so destroy, the
keys): `kubectl snapshot install` creates it when it is absent (app/install.py, core/keysecret.py).
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy.rbac import agent_own_role, agent_own_role_binding

KEY_SECRET = K.KEY_SECRET
ROLE = "kubectl-snapshot-agent-keys"


def key_role(labels: dict[str, str]) -> dict[str, Any]:
    rule = {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [KEY_SECRET], "verbs": ["get", "update"]}
    return agent_own_role(ROLE, labels, [rule])


def key_role_binding(labels: dict[str, str]) -> dict[str, Any]:
    return agent_own_role_binding(ROLE, labels)
