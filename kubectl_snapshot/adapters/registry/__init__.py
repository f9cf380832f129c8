"""OCI distribution client: credentials, auth, push/pull of blobs and manifests.

Public API: ``RegistryClient``, ``CredentialStore``, ``Credentials``, ``ProgressFn``.
"""

from kubectl_snapshot.adapters.registry.auth import Credentials, CredentialStore
from kubectl_snapshot.adapters.registry.client import RegistryClient, sha256_digest
from kubectl_snapshot.adapters.registry.upload import ProgressFn

__all__ = ["CredentialStore", "Credentials", "ProgressFn", "RegistryClient", "sha256_digest"]
