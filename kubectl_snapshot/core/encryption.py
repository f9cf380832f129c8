"""The config's record of how a snapshot is encrypted (docs/format.md, "Encryption at rest").

Kept apart from the cryptography (core/sealing.py) so that reading a config, as the kubectl plugin
does, needs no native crypto library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.oci import is_digest

SCHEME = "aes-256-gcm-segmented/v1"
KEY_BYTES = 32
WRAPPED_BYTES = 12 + KEY_BYTES + 16  # nonce || AES-GCM(data key) || tag


@dataclass(frozen=True)
class EncryptionInfo:
    """The config's ``encryption`` object: how every blob it names is sealed, and their wrapped keys."""

    scheme: str
    namespace: str  # whose key wraps the data keys (part of every wrap's AAD)
    key_id: str
    keys: Mapping[str, str]  # blob (ciphertext) digest -> base64 wrapped data key

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "namespace": self.namespace, "keyId": self.key_id, "keys": dict(self.keys)}

    @classmethod
    def from_dict(cls, d: Any) -> EncryptionInfo:
        hint = "the artifact is damaged or was not made by kubectl-snapshot"
        if not isinstance(d, dict):
            raise FailedPrecondition("snapshot config: encryption is not an object", hint=hint)
        scheme, ns, kid, keys = d.get("scheme"), d.get("namespace"), d.get("keyId"), d.get("keys")
        if scheme != SCHEME:
            raise FailedPrecondition(
                f"snapshot is encrypted with {scheme!r}, this build reads {SCHEME}",
                hint="use a kubectl-snapshot release that matches the one that made the snapshot",
            )
        if not isinstance(ns, str) or not isinstance(kid, str) or not kid:
            raise FailedPrecondition("snapshot config: encryption lacks its namespace or key id", hint=hint)
        if not isinstance(keys, dict):
            raise FailedPrecondition("snapshot config: encryption keys is not an object", hint=hint)
        for digest, wrapped in keys.items():
            if not is_digest(digest) or not isinstance(wrapped, str) or len(wrapped) != 4 * -(-WRAPPED_BYTES // 3):
                raise FailedPrecondition(f"snapshot config: invalid wrapped key for {digest!r}", hint=hint)
        return cls(scheme, ns, kid, dict(keys))

    def check_covers(self, digests: Iterable[str]) -> None:
        """Every blob the config names must have a key (no blob read in clear by mistake), and only those."""
        wanted = set(digests)
        missing = wanted - set(self.keys)
        extra = set(self.keys) - wanted
        if missing or extra:
            raise FailedPrecondition(
                "snapshot config: the encryption keys do not match its blobs "
                f"({len(missing)} without a key, {len(extra)} keys for no blob)",
                hint="the artifact is damaged or was not made by kubectl-snapshot",
            )
