"""The OCI model: descriptors and image manifests, separate from where bytes live.

Manifests are serialized canonically (sorted keys, no spaces) so that the same snapshot always has the
same manifest digest. Parsing validates everything a later step relies on: a manifest from a registry is
untrusted input.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import FailedPrecondition

_DIGEST_RE = re.compile(r"^sha256:[a-f0-9]{64}$")
_MEDIA_TYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}$")

EMPTY_JSON = b"{}"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def is_digest(value: str) -> bool:
    return bool(_DIGEST_RE.match(value))


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    artifact_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.artifact_type:
            d["artifactType"] = self.artifact_type
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "descriptor") -> Descriptor:
        if not isinstance(d, dict):
            raise _bad(f"{where} is not an object")
        media_type, digest, size = d.get("mediaType"), d.get("digest"), d.get("size")
        if not isinstance(media_type, str) or not _MEDIA_TYPE_RE.match(media_type):
            raise _bad(f"{where} has an invalid mediaType {media_type!r}")
        if not isinstance(digest, str) or not is_digest(digest):
            raise _bad(f"{where} has an invalid or unsupported digest {digest!r} (only sha256 is accepted)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _bad(f"{where} has an invalid size {size!r}")
        annotations = d.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()
        ):
            raise _bad(f"{where} has invalid annotations")
        artifact_type = d.get("artifactType")
        if artifact_type is not None and not isinstance(artifact_type, str):
            raise _bad(f"{where} has an invalid artifactType")
        return cls(media_type, digest, size, dict(annotations), artifact_type)


@dataclass(frozen=True)
class Manifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]
    artifact_type: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    media_type: str = C.OCI_MANIFEST

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schemaVersion": 2,
            "mediaType": self.media_type,
            "config": self.config.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.artifact_type:
            d["artifactType"] = self.artifact_type
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    @property
    def digest(self) -> str:
        return sha256_digest(self.to_bytes())

    def layer(self, digest: str) -> Descriptor:
        for layer in self.layers:
            if layer.digest == digest:
                return layer
        raise _bad(f"manifest has no layer {digest}")


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """`body` (untrusted) parsed as one JSON object; FailedPrecondition naming `what` otherwise."""
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(f"{what} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise _bad(f"{what} is not a JSON object")
    return d


def parse_manifest(body: bytes) -> Manifest:
    """Parse and validate an OCI image manifest (untrusted input)."""
    d = json_object(body, "manifest")
    if d.get("schemaVersion") != 2:
        raise _bad(f"unsupported manifest schemaVersion {d.get('schemaVersion')!r}")
    media_type = d.get("mediaType", C.OCI_MANIFEST)
    if media_type != C.OCI_MANIFEST:
        raise _bad(
            f"reference is a {media_type}, not an OCI image manifest",
            hint="point at a snapshot made by kubectl-snapshot (an image index or a container image is not one)",
        )
    layers_raw = d.get("layers")
    if not isinstance(layers_raw, list):
        raise _bad("manifest has no layers list")
    config = Descriptor.from_dict(d.get("config"), where="manifest config")
    layers = tuple(Descriptor.from_dict(x, where=f"manifest layer {i}") for i, x in enumerate(layers_raw))
    annotations = d.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise _bad("manifest annotations are not an object")
    artifact_type = d.get("artifactType")
    return Manifest(config, layers, artifact_type, {str(k): str(v) for k, v in annotations.items()})


def build_manifest(
    *,
    config: Descriptor,
    layers: Sequence[Descriptor],
    artifact_type: str,
    annotations: Mapping[str, str],
) -> Manifest:
    if not layers:
        raise ValueError("an artifact manifest needs at least one layer")
    return Manifest(config, tuple(layers), artifact_type, dict(annotations))


def _bad(message: str, hint: str | None = None) -> FailedPrecondition:
    return FailedPrecondition(message, hint=hint or "the artifact is damaged or was not made by kubectl-snapshot")
