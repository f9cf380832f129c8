"""Retention's registry side against a real docker-registry (distribution 2.8): a save's manifest and
its cosign-style signature are deleted by digest (tags go with them), blobs shared with a kept save
stay readable (only the registry's garbage collection frees blobs)."""

from __future__ import annotations

import pytest

from kubectl_snapshot.adapters.registry import sha256_digest
from kubectl_snapshot.core import constants
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.provenance import signature_tag
from kubectl_snapshot.core.reference import Reference
from shim.controller.policies import delete_manifest
from tests.integration.test_registry_client import blob, fast_client, manifest_for, push_artifact, unique_ref
from tests.support.registry import RegistryServer, registry_server

__all__ = ["registry_server"]
pytestmark = pytest.mark.integration


def test_retention_deletes_manifest_and_signature_and_keeps_shared_blobs(registry: RegistryServer) -> None:
    client = fast_client()
    old = unique_ref(registry, tag="web-0-1")
    shared, shared_digest = blob(4096, seed=7)
    old_digest, _ = push_artifact(client, old, shared)
    # the kept save shares the layer and has one of its own
    kept = Reference(old.registry, old.repository, tag="web-0-2")
    own, own_digest = blob(1024, seed=8)
    client.push_blob(kept, digest=own_digest, size=len(own), data=own)
    config = b'{"pod":"x"}'
    kept_manifest = manifest_for(config, [(shared_digest, len(shared)), (own_digest, len(own))])
    kept_digest = client.push_manifest(kept, kept_manifest, constants.OCI_MANIFEST)
    # the old save's signature, where cosign keeps it
    sig = Reference(old.registry, old.repository, tag=signature_tag(old_digest))
    sig_config = b'{"sig":1}'
    client.push_blob(sig, digest=sha256_digest(sig_config), size=len(sig_config), data=sig_config)
    sig_digest = client.push_manifest(sig, manifest_for(sig_config, []), constants.OCI_MANIFEST)

    delete_manifest(client, Reference(old.registry, old.repository, digest=old_digest))

    for gone in (Reference(old.registry, old.repository, digest=old_digest), old, sig):
        with pytest.raises(NotFound):
            client.get_manifest(gone)
    with pytest.raises(NotFound):
        client.get_manifest(Reference(old.registry, old.repository, digest=sig_digest))
    assert client.get_manifest(kept)[2] == kept_digest
    assert client.read_blob(kept, shared_digest, max_size=1 << 20) == shared  # shared blob kept
    assert sorted(client.list_tags(kept)) == ["web-0-2"]
    # deleting again (a retried retention pass) is not an error
    delete_manifest(client, Reference(old.registry, old.repository, digest=old_digest))
