"""A snapshot artifact: its manifest and config, pinned by digest, validated as they are read.

Shared by the plugin (restore, inspect) and the node agent. The registry is a port (`ManifestReader`);
only manifest + config are read, layers stay in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import chunk_digests
from kubectl_snapshot.core.errors import FailedPrecondition, SnapshotError, Unavailable
from kubectl_snapshot.core.model import SnapshotConfig, check_layers_match, parse_config
from kubectl_snapshot.core.oci import Manifest, parse_manifest
from kubectl_snapshot.core.reference import Reference

MAX_CONFIG_BYTES = 16 << 20


class ManifestReader(Protocol):
    def get_manifest(self, ref: Reference, *, max_size: int = ...) -> tuple[bytes, str, str]: ...
    def read_blob(self, ref: Reference, digest: str, *, max_size: int = ...) -> bytes: ...


@dataclass(frozen=True)
class Artifact:
    reference: Reference  # pinned by digest
    manifest: Manifest
    config: SnapshotConfig
    # both as read (the digests name these bytes): what a restore shows the key broker (core/keyaccess.py)
    manifest_bytes: bytes = field(default=b"", repr=False)
    config_bytes: bytes = field(default=b"", repr=False)


def load_artifact(
    registry: ManifestReader, ref: Reference, *, on_pinned: Callable[[Reference], None] | None = None
) -> Artifact:
    """The manifest and config of `ref`, validated; `on_pinned` gets the reference pinned by the
    manifest's digest before the config is read (to look up its signatures meanwhile)."""
    body, _media_type, digest = registry.get_manifest(ref)
    manifest = parse_manifest(body)
    if manifest.artifact_type != C.ARTIFACT_TYPE or manifest.config.media_type != C.CONFIG_MEDIA_TYPE:
        raise FailedPrecondition(
            f"{ref} is not a kubectl-snapshot snapshot (artifactType {manifest.artifact_type!r})",
            hint="name a reference that `kubectl snapshot` or `ks-agent checkpoint` printed",
        )
    if manifest.config.size > MAX_CONFIG_BYTES:
        raise FailedPrecondition(f"snapshot config of {ref} is too large ({manifest.config.size} bytes)")
    pinned = Reference(ref.registry, ref.repository, tag=ref.tag, digest=digest)
    if on_pinned is not None:
        on_pinned(pinned)
    raw_config = registry.read_blob(pinned, manifest.config.digest, max_size=MAX_CONFIG_BYTES)
    config = parse_config(raw_config)
    check_layers_match(config, [layer.digest for layer in manifest.layers])
    return Artifact(pinned, manifest, config, manifest_bytes=body, config_bytes=raw_config)


def blob_digests(manifest: Manifest) -> list[str]:
    """Every blob a manifest names (its config, layers and chunks), each once, in the manifest's order."""
    return list(dict.fromkeys(d.digest for d in (manifest.config, *manifest.layers)))


def checked_before_restore(artifact: Artifact, *, lazy: bool = False) -> list[str]:
    """The blobs a restore HEADs before it reserves, downloads or stages anything (threat B3): every one,
    but a lazy restore leaves out the chunks of the page files. Those are what a lazy restore serves while
    the pod runs, one HEAD each before it could run (an 8 GiB pod's 500 round trips), and each is verified
    as it is fetched, served or staged: one the registry lost ends the pod with the lazy failure's Event
    and its eager restore is refused (docs/lazy-restore.md)."""
    digests = blob_digests(artifact.manifest)
    if not lazy:
        return digests
    served = set(chunk_digests(p for c in artifact.config.containers for p in c.pages))
    return [d for d in digests if d not in served]


def dangling_after_push(ref: Reference, missing: list[str], total: int) -> SnapshotError:
    """A save whose registry lacks blobs it acknowledged: no manifest (and no tag) is pushed for it."""
    return Unavailable(
        f"the registry lacks {len(missing)} of the {total} blobs of {ref} it acknowledged (first: {missing[0]}); "
        "no manifest or tag was pushed for this snapshot",
        hint="check the registry's storage (or a proxy in front of it), then snapshot again",
        retryable=True,
    )


def dangling_before_restore(ref: Reference, missing: list[str], total: int) -> SnapshotError:
    """A restore of a manifest whose registry lacks blobs: refused before anything is downloaded or staged."""
    return FailedPrecondition(
        f"snapshot {ref} is incomplete: the registry lacks {len(missing)} of its {total} blobs "
        f"(first: {missing[0]}); nothing was staged",
        hint="the registry lost part of this snapshot (storage fault, or a garbage collection); "
        "restore another snapshot of the pod",
    )
