"""`migrate` of a controller-owned pod (app/migrate.py): refused without a resuming policy, before
anything is created; --node/--name do not apply. (The whole flow is tests/e2e/test_autosave_resume.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from kubectl_snapshot.app.migrate import MigrateRequest, migrate
from kubectl_snapshot.app.snapshot import SnapshotRequest
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument


class Kube:
    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.created: list[Any] = []

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        return self.pod

    def create_snapshot(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        self.created.append(body)
        raise AssertionError("nothing may be created")


def owned_pod(kind: str, **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "web-0",
            "namespace": "ns",
            "uid": "u",
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind, "name": "web", "uid": "o", "controller": True}],
        },
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]},
    }


def request(**kw: Any) -> MigrateRequest:
    return MigrateRequest(snapshot=SnapshotRequest(namespace="ns", pod="web-0", repository="reg:5000/x"), **kw)


def test_a_controller_owned_pod_without_a_resuming_policy_is_refused_with_a_hint() -> None:
    kube = Kube(owned_pod("StatefulSet"))
    with pytest.raises(FailedPrecondition) as e:
        migrate(request(), kube=kube, stores=None)  # type: ignore[arg-type]
    assert "duplicate" in e.value.message and "SnapshotPolicy" in (e.value.hint or "")
    with pytest.raises(FailedPrecondition) as e:
        migrate(request(), kube=Kube(owned_pod("DaemonSet", **{K.ANN_RESUME_POLICY: "p"})), stores=None)  # type: ignore[arg-type]
    assert "DaemonSet" in e.value.message
    assert kube.created == []


def test_node_and_name_do_not_apply_to_a_resuming_workload() -> None:
    kube = Kube(owned_pod("StatefulSet", **{K.ANN_RESUME_POLICY: "p"}))
    with pytest.raises(InvalidArgument):
        migrate(request(node="n2"), kube=kube, stores=None)  # type: ignore[arg-type]
    assert kube.created == []
