"""Fakes of the checkpoint use case's two ports (shim/engine/node_ports.py): a containerd that "dumps" a
one-file image and records the order of pauses, dumps and resumes, and an in-memory registry that can
fail, be down, or lose what it acknowledged. For unit tests of orchestration; the real components are
tested in tests/integration."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from kubectl_snapshot.core.errors import CriuFailed, NotFound, Unavailable
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference


@dataclass
class FakeContainerd:
    running: set[str]
    fail_checkpoint: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    paused: set[str] = field(default_factory=set)
    killed: set[str] = field(default_factory=set)

    def version(self) -> tuple[str, str]:
        return ("v2.3.7", "x")

    def get_container(self, cid: str) -> Any:
        if cid not in self.running:
            raise NotFound(f"container {cid} not found")
        return SimpleNamespace(
            id=cid,
            image="img",
            spec={"process": {"args": ["app"], "env": ["TOKEN=s3cret"]}},
            snapshotter="overlayfs",
            snapshot_key=cid,
            labels={},
        )

    def get_task(self, cid: str) -> Any:
        return SimpleNamespace(pid=1, status="paused" if cid in self.paused else "running")

    def pause_task(self, cid: str) -> None:
        self.calls.append(("pause", cid))
        self.paused.add(cid)

    def resume_task(self, cid: str) -> None:
        self.calls.append(("resume", cid))
        self.paused.discard(cid)

    def checkpoint_task(self, cid: str, *, image_path: str, work_path: str, **kw: Any) -> None:
        self.calls.append(("checkpoint", cid))
        assert self.paused == self.running, "every container is frozen before any is dumped"
        if cid == self.fail_checkpoint:
            raise CriuFailed(f"checkpoint of {cid} failed", details="Error (criu/sk-unix.c): boom")
        Path(image_path, "inventory.img").write_bytes(b"fake")

    def kill_task(self, cid: str, signal: int = 15, *, all: bool = False) -> None:
        self.calls.append(("kill", cid))
        self.killed.add(cid)

    def wait_task(self, cid: str, timeout: float | None = None) -> int:
        return 137

    def get_image(self, name: str) -> Any:
        return SimpleNamespace(target=SimpleNamespace(digest="sha256:" + "a" * 64))

    def snapshot_mounts(self, snapshotter: str, key: str) -> list[Any]:
        return []


@dataclass
class FakeRegistry:
    fail_push: bool = False
    down: bool = False
    loses: list[str] = field(default_factory=list)
    loses_last_layer: bool = False  # ... and the last layer of the manifest pushed (digests vary with the time)
    keeps_no_layers: bool = False  # acknowledges every upload but the config's (pushed fresh) and keeps none
    keeps_no_manifest: bool = False  # acknowledges the manifest's PUT and keeps nothing
    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, bytes] = field(default_factory=dict)
    mount_sources: list[Reference] = field(default_factory=list)
    manifest_puts: list[str] = field(default_factory=list)  # the tag (or "") of every manifest PUT

    def add_mount_sources(self, sources: Any) -> None:
        self.mount_sources.extend(sources)

    def ping(self, ref: Reference) -> None:
        if self.down:
            raise Unavailable("cannot reach registry")

    def push_blob(
        self,
        ref: Reference,
        *,
        digest: str,
        size: int,
        path: str | None = None,
        data: bytes | bytearray | None = None,
        progress: Any = None,
        fresh: bool = False,
    ) -> bool:
        if self.fail_push:
            raise Unavailable("connection reset mid-push")
        if self.keeps_no_layers and not fresh:
            return True
        self.blobs[digest] = bytes(data) if data is not None else Path(path or "").read_bytes()
        return True

    def push_blob_stream(self, ref: Reference, chunks: Any, *, progress: Any = None) -> tuple[str, int]:
        if self.fail_push:
            raise Unavailable("connection reset mid-push")
        data = b"".join(chunks)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self.keeps_no_layers:
            self.blobs[digest] = data
        return digest, len(data)

    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str:
        self.manifest_puts.append(ref.tag or "")
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if self.keeps_no_manifest:
            return digest
        self.manifests[ref.tag or ""] = manifest
        self.manifests[digest] = manifest
        if self.loses_last_layer and parse_manifest(manifest).layers:
            self.loses.append(parse_manifest(manifest).layers[-1].digest)
        for lost in self.loses:  # a registry (or proxy) that acknowledged uploads it did not keep
            self.blobs.pop(lost, None)
        return digest

    def get_manifest(self, ref: Reference, *, max_size: int = 0) -> tuple[bytes, str, str]:
        body = self.manifests.get(ref.digest or ref.tag or "")
        if body is None:
            raise NotFound(f"manifest {ref} unknown")
        return body, "application/vnd.oci.image.manifest.v1+json", "sha256:" + hashlib.sha256(body).hexdigest()

    def delete_manifest(self, ref: Reference, digest: str) -> None:
        body = self.manifests.pop(digest, None)
        for name in [n for n, b in self.manifests.items() if b == body]:
            del self.manifests[name]

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        return digest in self.blobs

    def read_blob(self, ref: Reference, digest: str, *, max_size: int = 0) -> bytes:
        return self.blobs[digest]

    def fetch_blob(
        self,
        ref: Reference,
        digest: str,
        out: BinaryIO,
        *,
        expected_size: int | None = None,
        max_size: int | None = None,
        progress: Any = None,
    ) -> int:
        return out.write(self.blobs[digest])
