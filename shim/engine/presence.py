"""Which blobs of a snapshot the registry really has: one HEAD per blob, several at once.

A registry (or a proxy in front of it) may acknowledge an upload it did not keep, or accept a manifest
whose blobs are missing (threat B3). A save asks before it pushes its manifest, a restore before it
downloads or stages anything."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kubectl_snapshot.core.reference import Reference

WORKERS = 8  # HEADs in flight at once: a snapshot of a few hundred chunks costs tens of round trips


class BlobChecker(Protocol):
    def blob_exists(self, ref: Reference, digest: str) -> bool: ...


def missing_blobs(registry: BlobChecker, ref: Reference, digests: Sequence[str]) -> list[str]:
    """The digests of `digests` the registry does not have, in their order."""
    if len(digests) <= 1:
        return [d for d in digests if not registry.blob_exists(ref, d)]
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(digests)), thread_name_prefix="blob-head") as pool:
        present = list(pool.map(lambda d: registry.blob_exists(ref, d), digests))
    return [d for d, ok in zip(digests, present, strict=True) if not ok]
