"""A snapshot's manifest and config as bytes, for tests of what checks them by digest (the key broker's
``open``: core/keyaccess.opened_keys)."""

from __future__ import annotations

from collections.abc import Sequence

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import Chunk, PagesFile
from kubectl_snapshot.core.encryption import EncryptionInfo
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest


def snapshot_bytes(
    namespace: str, layer: str, volumes: str, encryption: EncryptionInfo | None, chunks: Sequence[str] = ()
) -> tuple[bytes, bytes]:
    """(manifest, config) of a snapshot of `namespace` whose config names a container layer and a volumes
    layer (and a page file stored as `chunks`, 64 bytes each), sealed with `encryption`'s keys (None: in
    clear)."""
    pages = (PagesFile("pages-1.img", 64 * len(chunks), tuple(Chunk(64 * i, 64, d, 64) for i, d in enumerate(chunks))),)
    rec = ContainerRecord(
        name="c", id="c", image="i", image_digest="", layer_digest=layer, spec={}, pages=pages if chunks else ()
    )
    cfg = SnapshotConfig(
        group="g", namespace=namespace, created="t", containers=(rec,), host=HostFacts(), encryption=encryption,
        volumes_layer=volumes,
    ).to_bytes()  # fmt: skip
    manifest = build_manifest(
        config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(cfg), len(cfg)),
        layers=[
            *(Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, d, 1) for d in (layer, volumes)),
            *(Descriptor(C.CHUNK_MEDIA_TYPE, d, 64) for d in chunks),
        ],
        artifact_type=C.ARTIFACT_TYPE,
        annotations={},
    ).to_bytes()
    return manifest, cfg
