"""stage_artifact against the real loopback registry: page files download beside the layer and are
linked into its checkpoint/ once it is extracted; a layer that carries a page file itself, or makes
checkpoint/ a symlink, is refused and nothing staged is left behind."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kubectl_snapshot.adapters.registry import RegistryClient, sha256_digest
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.chunks import Chunk, PagesFile
from kubectl_snapshot.core.errors import DigestMismatch, UnsafeArchive
from kubectl_snapshot.core.model import ContainerRecord, DumpStats, HostFacts, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, Manifest
from kubectl_snapshot.core.reference import Reference
from shim.engine.restore import stage_artifact
from shim.engine.staging import StatePaths
from tests.support.registry import RegistryServer, registry

pytestmark = pytest.mark.integration
PAGES = bytes(range(256)) * 64 + os.urandom(3 * 4096)  # 4 pages, part compressible


def _layer(members: dict[str, bytes | str]) -> bytes:
    """tar+zstd of `members`: bytes are files, a str is a symlink's target."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return zstandard.ZstdCompressor().compress(buf.getvalue())


def _config(client: RegistryClient, ref: Reference) -> Descriptor:
    """The manifest's config blob, in the registry as a snapshot's is (a restore checks every blob is there
    before staging: threat B3); staging reads the config from the Artifact, not from this blob."""
    blob = b"{}"
    client.push_blob(ref, digest=sha256_digest(blob), size=len(blob), data=blob)
    return Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(blob), len(blob))


def _artifact(registry: RegistryServer, layer: bytes) -> Artifact:
    client = RegistryClient()
    ref = Reference.parse(f"{registry.host}/staging/{uuid.uuid4().hex[:10]}:v1")
    chunk = zstandard.ZstdCompressor().compress(PAGES)
    for blob in (layer, chunk):
        client.push_blob(ref, digest=sha256_digest(blob), size=len(blob), data=blob)
    pages = PagesFile("pages-1.img", len(PAGES), (Chunk(0, len(PAGES), sha256_digest(chunk), len(chunk)),))
    rec = ContainerRecord(
        name="app", id="app", image="i", image_digest="", layer_digest=sha256_digest(layer), spec={},
        stats=DumpStats(memory_bytes=len(PAGES)), pages=(pages,),
    )  # fmt: skip
    config = SnapshotConfig(group="g", namespace="n", created="", containers=(rec,), host=HostFacts())
    layers = (
        Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, sha256_digest(layer), len(layer)),
        Descriptor(C.CHUNK_MEDIA_TYPE, sha256_digest(chunk), len(chunk)),
    )
    manifest = Manifest(config=_config(client, ref), layers=layers)
    return Artifact(ref, manifest, config)


def _stage(registry: RegistryServer, tmp_path: Path, layer: bytes) -> tuple[Path, dict[str, float]]:
    paths = StatePaths(str(tmp_path / "state"))
    target = Path(paths.staged_by_id("restored"))
    timings: dict[str, float] = {}
    stage_artifact(_artifact(registry, layer), [str(target)], registry=RegistryClient(), paths=paths, timings=timings)
    return target, timings


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(".pages-"))


def test_page_files_are_rebuilt_beside_the_layer_and_linked_into_place(
    registry: RegistryServer, tmp_path: Path
) -> None:
    layer = _layer({f"{C.CHECKPOINT_DIRECTORY}/core-1.img": b"core", "config.dump": b"{}"})
    target, timings = _stage(registry, tmp_path, layer)
    assert (target / C.CHECKPOINT_DIRECTORY / "pages-1.img").read_bytes() == PAGES
    assert (target / C.CHECKPOINT_DIRECTORY / "core-1.img").read_bytes() == b"core"
    assert (target / C.CHECKPOINT_DIRECTORY / "pages-1.img").stat().st_nlink == 1
    assert _leftovers(target) == []
    assert {"layers_ms", "extract_ms", "pages_ms", "pages_wait_ms"} <= timings.keys()


def test_a_layer_without_a_checkpoint_directory_gets_one(registry: RegistryServer, tmp_path: Path) -> None:
    target, _ = _stage(registry, tmp_path, _layer({"config.dump": b"{}"}))
    assert (target / C.CHECKPOINT_DIRECTORY / "pages-1.img").read_bytes() == PAGES
    assert _leftovers(target) == []


def test_a_page_file_in_the_layer_too_is_refused(registry: RegistryServer, tmp_path: Path) -> None:
    layer = _layer({f"{C.CHECKPOINT_DIRECTORY}/pages-1.img": b"not from a verified chunk"})
    target = Path(StatePaths(str(tmp_path / "state")).staged_by_id("restored"))
    with pytest.raises(UnsafeArchive, match="both in the container layer and stored as chunks"):
        _stage(registry, tmp_path, layer)
    assert not target.exists() and _leftovers(target) == []


def test_a_checkpoint_symlink_in_the_layer_is_refused(registry: RegistryServer, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = Path(StatePaths(str(tmp_path / "state")).staged_by_id("restored"))
    with pytest.raises(UnsafeArchive):
        _stage(registry, tmp_path, _layer({C.CHECKPOINT_DIRECTORY: str(outside)}))
    assert list(outside.iterdir()) == []  # nothing was written through it
    assert not target.exists() and _leftovers(target) == []


class _SlowChunks(RegistryClient):
    """The real client; a page chunk's download is held until `release` is set (a slow link)."""

    def __init__(self, chunk_digests: set[str]) -> None:
        super().__init__()
        self.chunks = chunk_digests
        self.release = threading.Event()

    def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> Any:
        if digest in self.chunks:
            assert self.release.wait(30)
        return super().fetch_blob(ref, digest, out, **kw)


def test_the_images_are_announced_before_the_page_files_arrive(registry: RegistryServer, tmp_path: Path) -> None:
    """on_images (a two-phase gate's first answer): called once, with the layer extracted and checkpoint/
    in place, while the page files are still downloading; they are linked in afterwards."""
    layer = _layer({f"{C.CHECKPOINT_DIRECTORY}/core-1.img": b"core", "config.dump": b"{}"})
    artifact = _artifact(registry, layer)
    client = _SlowChunks({c.digest for c in artifact.config.containers[0].pages[0].chunks})
    paths = StatePaths(str(tmp_path / "state"))
    target = Path(paths.staged_by_id("restored"))
    seen: list[tuple[bool, bool]] = []

    def on_images() -> None:
        cp = target / C.CHECKPOINT_DIRECTORY
        seen.append(((cp / "core-1.img").exists(), (cp / "pages-1.img").exists()))
        client.release.set()

    stage_artifact(artifact, [str(target)], registry=client, paths=paths, on_images=on_images)
    assert seen == [(True, False)]
    assert (target / C.CHECKPOINT_DIRECTORY / "pages-1.img").read_bytes() == PAGES


def test_no_announcement_when_the_page_files_were_there_first(registry: RegistryServer, tmp_path: Path) -> None:
    artifact = _artifact(registry, _layer({"config.dump": b"{}"}))
    paths = StatePaths(str(tmp_path / "state"))
    target = Path(paths.staged_by_id("restored"))
    client = _SlowChunks(set())
    layer_digest = artifact.config.containers[0].layer_digest
    fetched: list[str] = []
    original = client.fetch_blob

    def layer_last(ref: Reference, digest: str, out: Any, **kw: Any) -> Any:
        if digest == layer_digest:  # the layer waits until the page file is rebuilt beside it
            deadline = time.monotonic() + 30
            while not fetched or not [
                p for p in target.parent.glob(".pages-*/pages-1.img") if p.stat().st_size == len(PAGES)
            ]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.5)  # and its worker has returned
        result = original(ref, digest, out, **kw)
        if digest != layer_digest:
            fetched.append(digest)
        return result

    client.fetch_blob = layer_last  # type: ignore[method-assign]
    called: list[bool] = []
    stage_artifact(artifact, [str(target)], registry=client, paths=paths, on_images=lambda: called.append(True))
    assert called == []  # nothing to announce: the staged data is complete, one answer does
    assert (target / C.CHECKPOINT_DIRECTORY / "pages-1.img").read_bytes() == PAGES


def test_zero_pages_stay_holes_and_a_repeated_chunk_is_downloaded_once(
    registry: RegistryServer, tmp_path: Path
) -> None:
    """Issue 44, item 1: a page file rebuilt from the real registry holds every page, its zero pages and
    an all-zero chunk as holes (no disk block), and a chunk used twice is downloaded once."""
    page = 4096
    a = os.urandom(page) + bytes(62 * page) + os.urandom(page)  # mostly zero pages
    zero = bytes(64 * page)
    b = os.urandom(64 * page)
    client = RegistryClient()
    ref = Reference.parse(f"{registry.host}/staging/{uuid.uuid4().hex[:10]}:v1")
    layer = _layer({f"{C.CHECKPOINT_DIRECTORY}/core-1.img": b"core"})
    blobs = {raw: zstandard.ZstdCompressor().compress(raw) for raw in (a, zero, b)}
    for blob in (layer, *blobs.values()):
        client.push_blob(ref, digest=sha256_digest(blob), size=len(blob), data=blob)
    n = len(a)
    order = (a, zero, b, a)  # `a` twice
    chunks = tuple(Chunk(i * n, n, sha256_digest(blobs[raw]), len(blobs[raw])) for i, raw in enumerate(order))
    pages = PagesFile("pages-1.img", len(order) * n, chunks)
    rec = ContainerRecord(
        name="app", id="app", image="i", image_digest="", layer_digest=sha256_digest(layer), spec={},
        stats=DumpStats(memory_bytes=pages.size), pages=(pages,),
    )  # fmt: skip
    config = SnapshotConfig(group="g", namespace="n", created="", containers=(rec,), host=HostFacts())
    layers = (
        Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, sha256_digest(layer), len(layer)),
        *(Descriptor(C.CHUNK_MEDIA_TYPE, sha256_digest(z), len(z)) for z in blobs.values()),
    )
    manifest = Manifest(config=_config(client, ref), layers=layers)
    fetched: list[str] = []

    class Counting(RegistryClient):
        def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> Any:
            fetched.append(digest)
            return super().fetch_blob(ref, digest, out, **kw)

    paths = StatePaths(str(tmp_path / "state"))
    target = Path(paths.staged_by_id("restored"))
    stage_artifact(Artifact(ref, manifest, config), [str(target)], registry=Counting(), paths=paths)
    staged = target / C.CHECKPOINT_DIRECTORY / "pages-1.img"
    assert staged.read_bytes() == a + zero + b + a
    assert sorted(fetched) == sorted([sha256_digest(layer), *(sha256_digest(z) for z in blobs.values())])
    # written: `a`'s two pages at each of its places and `b`; the zero pages and `zero` are holes
    assert staged.stat().st_blocks * 512 < len(b) + 16 * page
    assert _leftovers(target) == []


def test_a_tampered_chunk_is_refused_and_nothing_staged_is_left(registry: RegistryServer, tmp_path: Path) -> None:
    artifact = _artifact(registry, _layer({f"{C.CHECKPOINT_DIRECTORY}/core-1.img": b"core"}))
    chunk = artifact.config.containers[0].pages[0].chunks[0]
    stored = registry.blob_path(chunk.digest)
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other content
    stored.write_bytes(bytes(data))
    paths = StatePaths(str(tmp_path / "state"))
    target = Path(paths.staged_by_id("restored"))
    with pytest.raises(DigestMismatch):
        stage_artifact(artifact, [str(target)], registry=RegistryClient(), paths=paths)
    assert not target.exists() and _leftovers(target) == []
    assert os.listdir(paths.downloads()) == []
