"""Two snapshots of one pod in the same second get distinct names and default tags."""

from __future__ import annotations

import datetime
import json

import pytest

from kubectl_snapshot.adapters.kube import map_api_error
from kubectl_snapshot.adapters.kubeconn import ApiError
from kubectl_snapshot.app.snapshot import NAME_ATTEMPTS, SnapshotRequest, start_snapshot
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import AlreadyExists, FailedPrecondition
from tests.support.fakeplugin import FakeKube, running_pod, snapshot

NOW = datetime.datetime(2026, 11, 30, 20, 31, 41, tzinfo=datetime.UTC)


def cluster(*taken: str) -> FakeKube:
    """Pod ns/live running, and PodSnapshots of it already holding the names `taken`."""
    kube = FakeKube()
    kube.add(running_pod("live", "ns"))
    for name in taken:
        kube.add(snapshot(name, "ns", pod="live"))
    return kube


def _req(repo: str = "127.0.0.1:5005/e2e/live") -> SnapshotRequest:
    return SnapshotRequest(namespace="ns", pod="live", repository=repo, now=NOW)


def test_a_second_snapshot_in_the_same_second_is_numbered_name_and_tag() -> None:
    kube = cluster()
    first = start_snapshot(_req(), kube=kube)
    second = start_snapshot(_req(), kube=kube)
    assert first["metadata"]["name"] == "live-20261130-203141"
    assert second["metadata"]["name"] == "live-20261130-203141-2"
    assert first["spec"]["destination"].endswith(":20261130-203141")
    assert second["spec"]["destination"].endswith(":20261130-203141-2")
    assert kube.names(K.KIND, "ns") == ["live-20261130-203141", "live-20261130-203141-2"]


def test_an_explicit_tag_is_kept_only_the_name_is_numbered() -> None:
    kube = cluster("live-20261130-203141")
    made = start_snapshot(_req("127.0.0.1:5005/e2e/live:v1"), kube=kube)
    assert made["metadata"]["name"] == "live-20261130-203141-2"
    assert made["spec"]["destination"].endswith(":v1")


def test_after_every_name_is_taken_the_conflict_is_reported() -> None:
    taken = ["live-20261130-203141"] + [f"live-20261130-203141-{n}" for n in range(2, NAME_ATTEMPTS + 1)]
    kube = cluster(*taken)
    with pytest.raises(AlreadyExists) as e:
        start_snapshot(_req(), kube=kube)
    assert "already exists" in e.value.message and e.value.hint and kube.journal == []


def test_without_the_crd_it_says_install() -> None:
    kube = FakeKube(crds=False)
    kube.add(running_pod("live", "ns"))
    with pytest.raises(FailedPrecondition, match="PodSnapshot resource is not installed") as e:
        start_snapshot(_req(), kube=kube)
    assert "kubectl snapshot install" in (e.value.hint or "")


def _api(status: int, reason: str) -> ApiError:
    return ApiError(status, "Conflict", json.dumps({"kind": "Status", "reason": reason, "message": f"it is {reason}"}))


def test_409_already_exists_and_409_conflict_are_told_apart() -> None:
    exists = map_api_error(_api(409, "AlreadyExists"), "create podsnapshot ns/x", "s")
    conflict = map_api_error(_api(409, "Conflict"), "update podsnapshot ns/x", "s")
    assert isinstance(exists, AlreadyExists)
    assert isinstance(conflict, FailedPrecondition) and not isinstance(conflict, AlreadyExists)
    assert conflict.retryable and "it is Conflict" in conflict.message


def test_the_podsnapshot_records_the_uid_of_the_pod_that_was_checked() -> None:
    """A pod deleted and recreated under the same name before the agent claims the PodSnapshot is another
    pod: the agent compares this uid (threat A8; tests/unit/test_snapshot_worker.py)."""
    kube = FakeKube()
    live = running_pod("live", "ns")
    live["metadata"]["uid"] = "uid-live"
    kube.add(live)
    made = start_snapshot(_req(), kube=kube)
    assert made["spec"]["podUID"] == "uid-live"
