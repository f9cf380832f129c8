"""The agent signs its node's saves with its node's own key, registered in the trust ConfigMap.

At start the agent makes (or reads) its key (shim/service/nodekey.py) and adds two entries to
``kubectl-snapshot-trust``: ``<key id>.pub`` (the public key) and ``<key id>.node`` (this node). A
merge patch names only those two, so the agents of several nodes never overwrite each other; the
admission policy ``kubectl-snapshot-agent-trust`` lets an agent add only entries of the node its token
is bound to, and change nothing that is there. A save is signed only once the key is registered:
a signature no other node could verify is a save nobody can restore.
"""

from __future__ import annotations

import logging
import threading

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, SnapshotError
from kubectl_snapshot.core.provenance import SigningKey, node_key_entries
from shim.controller.kube_api import KubeApi
from shim.service import nodekey

log = logging.getLogger(__name__)

_HINT = (
    f"kubectl snapshot install creates ConfigMap {K.AGENT_NAMESPACE}/{K.TRUST_CONFIG_MAP}; the agent needs "
    "get and patch on it (Role kubectl-snapshot-agent-trust) and admission must let it add its node's key "
    "(kubectl snapshot doctor)"
)


class NodeSigner:
    def __init__(self, kube: KubeApi, node: str, state_dir: str) -> None:
        self.kube = kube
        self.node = node
        self.state_dir = state_dir
        self._key: SigningKey | None = None
        self._registered = False
        self._lock = threading.Lock()

    def key(self) -> SigningKey:
        with self._lock:
            if self._key is None:
                self._key = nodekey.load_or_create(self.state_dir)
            return self._key

    def register(self) -> None:
        """Add this node's entries to the trust ConfigMap unless they are there already (raises)."""
        key = self.key()
        entries = node_key_entries(key.public, self.node)
        live = self.kube.get_config_map(K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
        data = live.get("data") or {}
        if all(data.get(k) == v for k, v in entries.items()):
            self._registered = True
            return
        self.kube.patch_config_map_data(K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP, entries)
        self._registered = True
        log.info("registered this node's signing key %s in %s", key.public.id, K.TRUST_CONFIG_MAP)

    def try_register(self) -> None:
        """At start: register, or say why not (a save registers again before it signs)."""
        try:
            self.register()
        except SnapshotError as e:
            log.warning("could not register this node's signing key: %s", e.message)

    def key_for_save(self) -> SigningKey:
        """The key to sign a save with, registered first; raises (before anything is frozen) if it cannot be."""
        if not self._registered:
            try:
                self.register()
            except SnapshotError as e:
                raise FailedPrecondition(
                    f"this node's signing key is not registered in ConfigMap {K.AGENT_NAMESPACE}/"
                    f"{K.TRUST_CONFIG_MAP}, so no restore could verify this save: {e.message}",
                    hint=_HINT,
                ) from e
        return self.key()
