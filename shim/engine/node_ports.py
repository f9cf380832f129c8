"""The ports the node use cases depend on, as Protocols.

The real adapters are `shim.containerd.client.ContainerdClient` and
`kubectl_snapshot.adapters.registry.RegistryClient`; unit tests of the orchestration logic pass fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, BinaryIO, Protocol

from kubectl_snapshot.core.reference import Reference

ProgressFn = Callable[[int], None]


class ContainerInfoLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def image(self) -> str: ...
    @property
    def spec(self) -> dict[str, Any]: ...
    @property
    def snapshotter(self) -> str: ...
    @property
    def snapshot_key(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


class TaskInfoLike(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def status(self) -> str: ...


class Freezer(Protocol):
    """One container's cgroup freezer: written directly (shim.host.freezer.CgroupFreezer) or held through the
    freeze guard (shim.freeze_guard.GuardedFreezer), which thaws by itself at `deadline_s` or if we die."""

    def ready(self) -> None: ...  # block until freeze() can act at once (a freeze guard still starting)
    def freeze(self, *, deadline_s: float | None = None) -> None: ...
    def thaw(self) -> None: ...
    def frozen(self) -> bool: ...


FreezerFor = Callable[[int], Freezer | None]  # task pid -> its freezer, or None (use containerd)


class Containerd(Protocol):
    def version(self) -> tuple[str, str]: ...
    def get_container(self, cid: str) -> Any: ...
    def get_task(self, cid: str) -> Any: ...
    def pause_task(self, cid: str) -> None: ...
    def resume_task(self, cid: str) -> None: ...
    def checkpoint_task(
        self,
        cid: str,
        *,
        image_path: str,
        work_path: str,
        exit: bool = False,
        open_tcp: bool = True,
        file_locks: bool = False,
        external_unix_sockets: bool = False,
        terminal: bool = False,
    ) -> None: ...
    def kill_task(self, cid: str, signal: int = 15, *, all: bool = False) -> None: ...
    def wait_task(self, cid: str, timeout: float | None = None) -> int: ...
    def get_image(self, name: str) -> Any: ...
    def snapshot_mounts(self, snapshotter: str, key: str) -> Sequence[Any]: ...


class Registry(Protocol):
    def ping(self, ref: Reference) -> None: ...
    def push_blob(
        self,
        ref: Reference,
        *,
        digest: str,
        size: int,
        path: str | None = None,
        data: bytes | bytearray | None = None,
        progress: ProgressFn | None = None,
        fresh: bool = False,
    ) -> bool: ...
    def push_blob_stream(
        self, ref: Reference, chunks: Iterable[bytes], *, progress: ProgressFn | None = None
    ) -> tuple[str, int]: ...
    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str: ...
    def delete_manifest(self, ref: Reference, digest: str) -> None: ...
    def blob_exists(self, ref: Reference, digest: str) -> bool: ...
    def get_manifest(self, ref: Reference, *, max_size: int = ...) -> tuple[bytes, str, str]: ...
    def read_blob(self, ref: Reference, digest: str, *, max_size: int = ...) -> bytes: ...
    def fetch_blob(
        self,
        ref: Reference,
        digest: str,
        out: BinaryIO,
        *,
        expected_size: int | None = None,
        max_size: int | None = None,
        progress: ProgressFn | None = None,
    ) -> int: ...
