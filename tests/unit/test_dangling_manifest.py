"""Threat B3: a registry that acknowledges uploads it did not keep, or accepts a manifest whose blobs are
missing. A save HEADs every blob before its manifest's PUT (none is pushed for a snapshot the registry lacks
part of) and reads its tag back after it; a restore HEADs every blob before it downloads or stages anything.
Each refusal beside the save or restore it lets through."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core.artifact import load_artifact
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, Unavailable
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.restore import stage_artifact
from shim.engine.staging import StatePaths
from tests.support.fakenode import FakeContainerd, FakeRegistry

HOST = HostFacts(kernel="6.18", arch="x86_64", criu_version="4.2.1")
TARGET = Reference.parse("127.0.0.1:5000/snap:v1")


def save(reg: FakeRegistry, tmp_path: Path) -> Any:
    req = CheckpointRequest(containers=["a", "b"], target=TARGET)
    return checkpoint(
        req, containerd=FakeContainerd({"a", "b"}), registry=reg, paths=StatePaths(str(tmp_path)), host=HOST
    )


class CountingRegistry(FakeRegistry):
    def __init__(self, base: FakeRegistry) -> None:
        super().__init__(blobs=dict(base.blobs), manifests=dict(base.manifests))
        self.downloads: list[str] = []

    def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> int:
        self.downloads.append(digest)
        return super().fetch_blob(ref, digest, out, **kw)


def test_a_save_whose_registry_did_not_keep_its_layers_pushes_no_manifest(tmp_path: Path) -> None:
    reg = FakeRegistry(keeps_no_layers=True)
    with pytest.raises(Unavailable, match=r"lacks 2 of the 3 blobs .* no manifest or tag was pushed") as e:
        save(reg, tmp_path)
    assert e.value.hint and "registry's storage" in e.value.hint
    assert reg.manifest_puts == [] and reg.manifests == {}


def test_a_save_whose_registry_keeps_every_blob_is_tagged(tmp_path: Path) -> None:
    reg = FakeRegistry()
    result = save(reg, tmp_path)
    assert reg.manifest_puts == ["v1"]
    assert parse_manifest(reg.manifests["v1"]).digest == result.reference.digest


def test_a_manifest_the_registry_did_not_keep_fails_the_save(tmp_path: Path) -> None:
    reg = FakeRegistry(keeps_no_manifest=True)
    with pytest.raises(Unavailable, match=r"acknowledged manifest sha256:.* but serves nothing there"):
        save(reg, tmp_path)
    assert reg.manifest_puts == ["v1"] and reg.manifests == {}


class SlowToShow(FakeRegistry):
    """Stores the manifest, and serves its tag only from the second read on."""

    reads = 0

    def get_manifest(self, ref: Reference, *, max_size: int = 0) -> tuple[bytes, str, str]:
        self.reads += 1
        if self.reads == 1:
            raise NotFound(f"manifest {ref} unknown")
        return super().get_manifest(ref, max_size=max_size)


def test_a_registry_slow_to_show_the_manifest_it_stored_does_not_fail_the_save(tmp_path: Path) -> None:
    reg = SlowToShow()
    result = save(reg, tmp_path)
    assert reg.reads == 2 and parse_manifest(reg.manifests["v1"]).digest == result.reference.digest


class TagMovedAtOnce(FakeRegistry):
    """Keeps the manifest, and another save of the same tag moves the tag right after this one's PUT."""

    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str:
        digest = super().push_manifest(ref, manifest, media_type)
        self.manifests[ref.tag or ""] = b'{"schemaVersion": 2, "other": "save"}'
        return digest


def test_a_tag_another_save_moved_meanwhile_does_not_fail_a_kept_manifest(tmp_path: Path) -> None:
    reg = TagMovedAtOnce()
    result = save(reg, tmp_path)  # kept: read back by digest, whatever the tag names now
    assert result.reference.digest in reg.manifests


def staged_from(reg: FakeRegistry, tmp_path: Path) -> tuple[CountingRegistry, Any, Path]:
    result = save(reg, tmp_path / "save")
    pulls = CountingRegistry(reg)
    return pulls, load_artifact(pulls, result.reference), tmp_path / "staged"


def test_a_restore_of_a_manifest_with_a_missing_blob_is_refused_before_anything_is_staged(tmp_path: Path) -> None:
    pulls, art, staged = staged_from(FakeRegistry(), tmp_path)
    lost = art.manifest.layers[-1].digest
    del pulls.blobs[lost]
    paths = StatePaths(str(tmp_path / "state"))
    with pytest.raises(
        FailedPrecondition, match=f"is incomplete: the registry lacks 1 of its 3 blobs \\(first: {lost}\\)"
    ):
        stage_artifact(art, [str(staged / "a"), str(staged / "b")], registry=pulls, paths=paths)
    assert pulls.downloads == []
    assert not staged.exists()


def test_a_restore_of_a_complete_manifest_downloads_and_stages(tmp_path: Path) -> None:
    pulls, art, staged = staged_from(FakeRegistry(), tmp_path)
    paths = StatePaths(str(tmp_path / "state"))
    stage_artifact(art, [str(staged / "a"), str(staged / "b")], registry=pulls, paths=paths)
    assert sorted(pulls.downloads) == sorted(layer.digest for layer in art.manifest.layers)
    assert os.listdir(staged / "a") and os.listdir(staged / "b")


def _with_pages() -> Any:
    """A snapshot whose one container keeps its pages in two chunks (one with a delta on a base)."""
    from kubectl_snapshot.core.artifact import Artifact
    from kubectl_snapshot.core.chunks import Chunk, Delta, PagesFile
    from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig
    from kubectl_snapshot.core.oci import Descriptor, Manifest

    layer, base, delta, other, config = ("sha256:" + c * 64 for c in "abcde")
    pages = (PagesFile("pages-1.img", 2 << 20, (Chunk(0, 1 << 20, base, 10, Delta(delta, 5, 1, 0, 1 << 20)),
                                                 Chunk(1 << 20, 1 << 20, other, 10))),)  # fmt: skip
    rec = ContainerRecord(name="c", id="c", image="i", image_digest="", layer_digest=layer, spec={}, pages=pages)
    cfg = SnapshotConfig(group="g", namespace="n", created="", containers=(rec,), host=HOST)
    layers = tuple(Descriptor("application/x", d, 1) for d in (layer, base, delta, other))
    return Artifact(TARGET, Manifest(Descriptor("application/y", config, 1), layers), cfg), (layer, config)


def test_a_lazy_restore_heads_all_but_the_chunks_it_serves_as_the_pod_runs() -> None:
    from kubectl_snapshot.core.artifact import blob_digests, checked_before_restore

    art, (layer, config) = _with_pages()
    # eager: every blob, chunks included, before anything is staged
    assert checked_before_restore(art) == blob_digests(art.manifest) and len(blob_digests(art.manifest)) == 5
    # lazy: the config and the layer still (a missing layer is refused before the pod runs); each chunk is
    # verified as it is fetched, and one that cannot be fetched ends the pod (tests/e2e/test_lazy_restore.py,
    # tests/integration/test_lazy_session.py)
    assert checked_before_restore(art, lazy=True) == [config, layer]
