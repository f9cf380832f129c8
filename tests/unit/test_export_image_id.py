"""podman's image id for an export (shim/engine/export.image_id_lookup): from --image-id, else the
config digest of the image as containerd has it; refused where it is absent or another digest."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kubectl_snapshot.core.oci import Descriptor, sha256_digest
from shim.containerd.imageconfig import host_architecture
from shim.containerd.model import ImageInfo
from shim.engine.export import image_id_lookup
from tests.unit.test_oci_model import config

CONFIG = sha256_digest(b"image config")
MANIFEST = json.dumps({"schemaVersion": 2, "config": {"digest": CONFIG, "size": 12}, "layers": []}).encode()
INDEX = json.dumps(
    {
        "schemaVersion": 2,
        "manifests": [
            {"mediaType": C.OCI_MANIFEST, "digest": sha256_digest(MANIFEST), "size": len(MANIFEST),
             "platform": {"os": "linux", "architecture": host_architecture()}},
        ],
    }
).encode()  # fmt: skip


class FakeContainerd:
    """The two calls the lookup makes, over an in-memory content store."""

    def __init__(self, images: dict[str, Descriptor]) -> None:
        self.images = images
        self.blobs = {sha256_digest(b): b for b in (MANIFEST, INDEX)}

    def get_image(self, name: str) -> ImageInfo:
        if name not in self.images:
            raise NotFound(f"image {name!r} not found")
        return ImageInfo(name=name, target=self.images[name])

    def read_content(self, digest: str, *, max_size: int = 16 << 20) -> bytes:
        return self.blobs[digest]


def record(image_digest: str) -> Any:
    return dataclasses.replace(config().containers[0], image="localhost/busybox:1", image_digest=image_digest)


def test_the_config_digest_of_the_image_containerd_has() -> None:
    manifest = Descriptor(C.OCI_MANIFEST, sha256_digest(MANIFEST), len(MANIFEST))
    fake = FakeContainerd({"localhost/busybox:1": manifest})
    assert image_id_lookup(None, lambda: fake)(record(manifest.digest)) == CONFIG.removeprefix("sha256:")
    # an index: the manifest for this machine's platform
    index = Descriptor(C.OCI_INDEX, sha256_digest(INDEX), len(INDEX))
    fake = FakeContainerd({"localhost/busybox:1": index})
    assert image_id_lookup(None, lambda: fake)(record(index.digest)) == CONFIG.removeprefix("sha256:")


def test_an_explicit_id_is_taken_without_asking_containerd_and_checked() -> None:
    def no_containerd() -> Any:
        raise AssertionError("containerd was asked")

    hexid = CONFIG.removeprefix("sha256:")
    assert image_id_lookup(CONFIG, no_containerd)(record("")) == hexid
    with pytest.raises(InvalidArgument, match="image id"):
        image_id_lookup("busybox:1", no_containerd)(record(""))


def test_an_absent_image_or_another_digest_is_refused_with_the_way_out() -> None:
    manifest = Descriptor(C.OCI_MANIFEST, sha256_digest(MANIFEST), len(MANIFEST))
    with pytest.raises(FailedPrecondition, match="not in this containerd") as absent:
        image_id_lookup(None, lambda: FakeContainerd({}))(record(manifest.digest))
    assert "--image-id" in (absent.value.hint or "")
    fake = FakeContainerd({"localhost/busybox:1": manifest})
    with pytest.raises(FailedPrecondition, match="the snapshot ran") as other:
        image_id_lookup(None, lambda: fake)(record(sha256_digest(b"another manifest")))
    assert "--image-id" in (other.value.hint or "")
