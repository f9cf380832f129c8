"""What the agent's controller needs of the Kubernetes API, as a Protocol (the port).

The real adapter is `kubectl_snapshot.adapters.kube.KubeClient`; unit tests pass
`tests.support.fakekube.FakeKube` (or a subclass of it), which mypy checks against this Protocol,
so a fake cannot drift from what the controller calls. Every object is a plain dict as the API
server serves it; errors are `kubectl_snapshot.core.errors` (NotFound, Conflict, PermissionDenied, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kubectl_snapshot.core.reference import Reference
from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.engine.node_ports import Containerd, Registry

Obj = dict[str, Any]
WatchEvents = Iterator[tuple[str, Obj]]


class KubeApi(Protocol):
    # --- PodSnapshots ---------------------------------------------------------------------------------
    def get_snapshot(self, ns: str, name: str) -> Obj: ...
    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]: ...
    def list_snapshots_versioned(
        self, ns: str | None, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> tuple[list[Obj], str]: ...
    def watch_snapshots(
        self,
        namespace: str | None,
        timeout_s: int = 300,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
    ) -> WatchEvents: ...
    def create_snapshot(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj: ...
    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None: ...
    def patch_snapshot_status(self, ns: str, name: str, status: Obj, *, resource_version: str | None = None) -> Obj: ...
    def patch_snapshot_metadata(
        self,
        ns: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> Obj: ...
    def list_snapshot_grants(self, ns: str) -> list[Obj]: ...

    # --- SnapshotPolicies -----------------------------------------------------------------------------
    def get_policy(self, ns: str, name: str) -> Obj: ...
    def list_policies_versioned(
        self, ns: str | None, *, label_selector: str | None = None
    ) -> tuple[list[Obj], str]: ...
    def watch_policies(
        self, namespace: str | None, timeout_s: int = 300, *, resource_version: str | None = None
    ) -> WatchEvents: ...
    def apply_policy_pods(self, ns: str, name: str, pods: list[Obj], *, field_manager: str) -> Obj: ...

    # --- pods, their owners, nodes, events ------------------------------------------------------------
    def get_pod(self, ns: str, name: str) -> Obj: ...
    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[Obj]: ...
    def list_pods_versioned(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> tuple[list[Obj], str]: ...
    def watch_pods(
        self,
        *,
        field_selector: str | None,
        namespace: str | None = None,
        timeout_s: int = 300,
        resource_version: str | None = None,
    ) -> WatchEvents: ...
    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> Obj: ...
    def delete_pod(self, ns: str, name: str, *, grace_period_seconds: int | None = None) -> None: ...
    def get_replicaset(self, ns: str, name: str) -> Obj | None: ...
    def get_node(self, name: str) -> Obj: ...
    def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> Obj: ...
    def create_event(
        self, ns: str, *, involved: Obj, reason: str, message: str, type: str = "Normal", component: str = ...
    ) -> Obj: ...

    # --- Secrets (registry credentials, the sealing keys) ----------------------------------------------
    def get_secret(self, ns: str, name: str) -> Obj: ...
    def replace_secret(self, ns: str, name: str, body: Obj) -> Obj: ...

    # --- the trust ConfigMap (this node's signing key is registered there) -----------------------------
    def get_config_map(self, ns: str, name: str) -> Obj: ...
    def patch_config_map_data(self, ns: str, name: str, data: dict[str, str]) -> Obj: ...


class SnapshotRegistry(Registry, Protocol):
    """The registry a snapshot is pushed to (adapters/registry.RegistryClient)."""

    def add_mount_sources(self, sources: Iterable[Reference]) -> None: ...


# (namespace, registrySecret or None, insecure) -> a client with that Secret's credentials
RegistryFor = Callable[[str, str | None, bool], SnapshotRegistry]
# the checkpointer runc dumps with -> the node's containerd, open for the snapshot's length
ContainerdFor = Callable[[RuncCheckpointer], AbstractContextManager[Containerd]]
