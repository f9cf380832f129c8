"""Pure helpers for reading an image from containerd's content store: which manifest, which snapshot.

containerd unpacks an image's layers into committed snapshots named by the *chain id* of the layers'
uncompressed digests (``rootfs.diff_ids`` of the image config); a container's rootfs is a snapshot
prepared on top of that. The chain id is defined by the OCI image spec:
``chain(L0) = diff(L0)`` and ``chain(L0..Ln) = sha256(chain(L0..Ln-1) + " " + diff(Ln))``.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping, Sequence
from typing import Any

from kubectl_snapshot.core import constants as c
from kubectl_snapshot.core.errors import DigestMismatch, InvalidArgument, NotFound

_INDEX_TYPES = (c.OCI_INDEX, c.DOCKER_MANIFEST_LIST)
_MANIFEST_TYPES = (c.OCI_MANIFEST, c.DOCKER_MANIFEST_V2)
_GO_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def host_architecture() -> str:
    """This machine's architecture in Go/OCI spelling (amd64, arm64)."""
    machine = platform.machine().lower()
    return _GO_ARCH.get(machine, machine)


def chain_id(diff_ids: Sequence[str]) -> str:
    """The chain id of a layer stack (the name of the committed snapshot of its top layer)."""
    if not diff_ids:
        raise InvalidArgument("an image without layers has no chain id", hint="check the image config")
    chain = diff_ids[0]
    for diff in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {diff}".encode()).hexdigest()
    return chain


def verify_digest(digest: str, data: bytes) -> None:
    """Content read from a store is trusted only once it hashes to the digest that named it."""
    algo, _, want = digest.partition(":")
    if algo != "sha256" or not want:
        raise DigestMismatch(f"unsupported digest {digest!r}", hint="only sha256 digests are supported")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise DigestMismatch(f"content {digest} hashes to sha256:{got}", hint="the content store is corrupt")


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise InvalidArgument(f"{what} is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{what} is not a JSON object")
    return doc


def is_index(media_type: str, doc: Mapping[str, Any]) -> bool:
    return media_type in _INDEX_TYPES or (media_type not in _MANIFEST_TYPES and "manifests" in doc)


def select_manifest(index: Mapping[str, Any], *, os: str = "linux", arch: str | None = None) -> dict[str, Any]:
    """The descriptor of the manifest for `os`/`arch` (default: this machine) in an image index."""
    arch = arch or host_architecture()
    manifests = index.get("manifests") or []
    for desc in manifests:
        plat = desc.get("platform") or {}
        if plat.get("os") == os and plat.get("architecture") == arch:
            return dict(desc)
    # Single-platform indexes (e.g. from an OCI layout) often carry no platform at all.
    unplatformed = [d for d in manifests if not d.get("platform") and d.get("mediaType") in _MANIFEST_TYPES]
    if len(unplatformed) == 1:
        return dict(unplatformed[0])
    available = sorted(
        f"{(d.get('platform') or {}).get('os')}/{(d.get('platform') or {}).get('architecture')}" for d in manifests
    )
    raise NotFound(
        f"image index has no manifest for {os}/{arch}",
        hint=f"available platforms: {', '.join(available) or 'none'}; get an image for {os}/{arch}",
    )


def diff_ids(config: Mapping[str, Any]) -> list[str]:
    """The uncompressed layer digests of an image config (``rootfs.diff_ids``)."""
    rootfs = config.get("rootfs") or {}
    ids = rootfs.get("diff_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidArgument("image config has no rootfs.diff_ids", hint="the image is not a container image")
    return list(ids)
