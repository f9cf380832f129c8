"""The agent signs its node's saves with its node's own key, registered in the trust ConfigMap.

At start the agent makes (or reads) its key (shim/service/nodekey.py) and adds two entries to
``kubectl-snapshot-trust``: ``<key id>.pub`` (the public key) and ``<key id>.node`` (this node). A
merge patch names only those two, so the agents of several nodes never overwrite each other; the
admission policy ``kubectl-snapshot-agent-trust`` lets an agent add only entries of the node its token
is bound to, and change nothing that is there. A save is signed only once the key is registered:
a signature no other node could verify is a save nobody can restore.

An administrator retires a key by adding ``<key id>.not-after`` to the ConfigMap (docs/security.md):
it then vouches only for what it signed before that time. Before each save (read again at most every
RETIREMENT_CHECK_S) the agent looks for its key's not-after; once the retirement is less than
ROTATE_AHEAD_S away (or already past, or unreadable), it makes a new key, registers it and signs with
that: a save signed with a retired key would be refused at every restore.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import FailedPrecondition, SnapshotError
from kubectl_snapshot.core.provenance import TRUST_NOT_AFTER_SUFFIX, SigningKey, node_key_entries
from shim.controller.kube_api import KubeApi
from shim.service import nodekey

log = logging.getLogger(__name__)

RETIREMENT_CHECK_S = 5.0  # the trust ConfigMap is read for this key's retirement at most this often
ROTATE_AHEAD_S = 120.0  # a key retired within this is replaced before it signs again

_HINT = (
    f"kubectl snapshot install creates ConfigMap {K.AGENT_NAMESPACE}/{K.TRUST_CONFIG_MAP}; the agent needs "
    "get and patch on it (Role kubectl-snapshot-agent-trust) and admission must let it add its node's key "
    "(kubectl snapshot doctor)"
)


class NodeSigner:
    def __init__(self, kube: KubeApi, node: str, state_dir: str, *, clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.node = node
        self.state_dir = state_dir
        self.clock = clock
        self._key: SigningKey | None = None
        self._registered = False
        self._checked_until = 0.0
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
        self._replace_if_retired()
        return self.key()

    def _replace_if_retired(self) -> None:
        """A new key (registered) in place of one an administrator retired, before it signs again."""
        now = self.clock()
        if now < self._checked_until:
            return
        old = self.key()
        try:
            data = self.kube.get_config_map(K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP).get("data") or {}
        except SnapshotError as e:  # read again at the next save; the key was registered, so it signs on
            log.warning("could not read %s for this key's retirement: %s", K.TRUST_CONFIG_MAP, e.message)
            return
        self._checked_until = now + RETIREMENT_CHECK_S
        raw = data.get(old.public.id + TRUST_NOT_AFTER_SUFFIX)
        if raw is None:
            return
        parsed = T.parse(raw)  # not readable, or without a zone: the verifier refuses all it signs (expired)
        if parsed is not None and parsed.tzinfo is not None and parsed.timestamp() > now + ROTATE_AHEAD_S:
            return
        with self._lock:
            self._key = nodekey.replace(self.state_dir)
            self._registered = False
        try:
            self.register()
        except SnapshotError as e:
            raise FailedPrecondition(
                f"this node's signing key {old.public.id} is retired ({raw}) and its new key "
                f"{self.key().public.id} could not be registered in ConfigMap {K.AGENT_NAMESPACE}/"
                f"{K.TRUST_CONFIG_MAP}: {e.message}",
                hint=_HINT,
            ) from e
        log.info("this node's signing key %s is retired (%s): signing with new key %s", old.public.id, raw,
                 self.key().public.id)  # fmt: skip
