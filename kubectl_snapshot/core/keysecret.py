"""The Secret that holds the namespace keys (encryption at rest), as an object (pure).

One Secret of fixed name in the agent's namespace, one data entry per namespace (adapters/keystore.py
reads and updates it). `kubectl snapshot install` creates it, empty, when it is absent and never
touches it again (re-applying would replace, and so destroy, the keys); the agents only ever update it
by name. The agent creates no Secrets: a Role that may create Secrets in its namespace would let a
stolen agent token mint a ServiceAccount token Secret that outlives the node (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K

KEY_SECRET = K.KEY_SECRET
PURPOSE = (
    "per-namespace snapshot encryption keys; deleting an entry makes that namespace's snapshots unreadable. Back it up."
)


def key_secret(data: dict[str, str], *, resource_version: str | None = None) -> dict[str, Any]:
    """The Secret with `data` (namespace -> base64 key); with `resource_version`, an update of that version."""
    meta: dict[str, Any] = {
        "name": KEY_SECRET,
        "namespace": K.AGENT_NAMESPACE,
        "labels": {"app.kubernetes.io/part-of": "kubectl-snapshot"},
        "annotations": {f"{K.GROUP}/purpose": PURPOSE},
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta, "data": dict(data)}
