"""The one fake of the controller's Kubernetes port (shim/controller/kube_api.KubeApi), type-checked against it.

`StrictKube` answers every call with a failed test: a unit test subclasses it and implements only the
calls its code path is expected to make, so an unexpected call is a failure that names the method,
not a silent default. mypy checks each subclass against the port wherever it is passed as a `KubeApi`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from shim.controller.kube_api import Obj, WatchEvents


def _unexpected(name: str) -> NoReturn:
    raise AssertionError(f"unexpected Kubernetes call in this test: {name}")


class StrictKube:
    def get_snapshot(self, ns: str, name: str) -> Obj:
        _unexpected("get_snapshot")

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]:
        _unexpected("list_snapshots")

    def list_snapshots_versioned(
        self, ns: str | None, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> tuple[list[Obj], str]:
        _unexpected("list_snapshots_versioned")

    def watch_snapshots(
        self,
        namespace: str | None,
        timeout_s: int = 300,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
    ) -> WatchEvents:
        _unexpected("watch_snapshots")

    def create_snapshot(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj:
        _unexpected("create_snapshot")

    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        _unexpected("delete_snapshot")

    def patch_snapshot_status(self, ns: str, name: str, status: Obj, *, resource_version: str | None = None) -> Obj:
        _unexpected("patch_snapshot_status")

    def patch_snapshot_metadata(
        self,
        ns: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> Obj:
        _unexpected("patch_snapshot_metadata")

    def list_snapshot_grants(self, ns: str) -> list[Obj]:
        _unexpected("list_snapshot_grants")

    def get_policy(self, ns: str, name: str) -> Obj:
        _unexpected("get_policy")

    def list_policies_versioned(self, ns: str | None, *, label_selector: str | None = None) -> tuple[list[Obj], str]:
        _unexpected("list_policies_versioned")

    def watch_policies(
        self, namespace: str | None, timeout_s: int = 300, *, resource_version: str | None = None
    ) -> WatchEvents:
        _unexpected("watch_policies")

    def apply_policy_pods(self, ns: str, name: str, pods: list[Obj], *, field_manager: str) -> Obj:
        _unexpected("apply_policy_pods")

    def get_pod(self, ns: str, name: str) -> Obj:
        _unexpected("get_pod")

    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[Obj]:
        _unexpected("list_pods")

    def list_pods_versioned(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> tuple[list[Obj], str]:
        _unexpected("list_pods_versioned")

    def watch_pods(
        self,
        *,
        field_selector: str | None,
        namespace: str | None = None,
        timeout_s: int = 300,
        resource_version: str | None = None,
    ) -> WatchEvents:
        _unexpected("watch_pods")

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> Obj:
        _unexpected("patch_pod_annotations")

    def delete_pod(self, ns: str, name: str, *, grace_period_seconds: int | None = None) -> None:
        _unexpected("delete_pod")

    def get_replicaset(self, ns: str, name: str) -> Obj | None:
        _unexpected("get_replicaset")

    def get_node(self, name: str) -> Obj:
        _unexpected("get_node")

    def patch_node_annotations(self, name: str, annotations: dict[str, str | None]) -> Obj:
        _unexpected("patch_node_annotations")

    def create_event(
        self,
        ns: str,
        *,
        involved: Obj,
        reason: str,
        message: str,
        type: str = "Normal",
        component: str = "kubectl-snapshot-agent",
    ) -> Obj:
        _unexpected("create_event")

    def get_secret(self, ns: str, name: str) -> Obj:
        _unexpected("get_secret")

    def replace_secret(self, ns: str, name: str, body: Obj) -> Obj:
        _unexpected("replace_secret")

    def get_config_map(self, ns: str, name: str) -> Obj:
        _unexpected("get_config_map")

    def patch_config_map_data(self, ns: str, name: str, data: dict[str, str]) -> Obj:
        _unexpected("patch_config_map_data")


__all__ = ["StrictKube"]


@dataclass(frozen=True)
class RecordedEvent:
    kind: str  # of the involved object
    reason: str
    message: str
    type: str


class EventRecorder(StrictKube):
    """A StrictKube that records the Events the code under test creates; a subclass initialises
    `events` (a dataclass field or in __init__)."""

    events: list[RecordedEvent]

    def create_event(
        self,
        ns: str,
        *,
        involved: Obj,
        reason: str,
        message: str,
        type: str = "Normal",
        component: str = "kubectl-snapshot-agent",
    ) -> Obj:
        self.events.append(RecordedEvent(str(involved.get("kind", "")), reason, message, type))
        return {}
