"""Which agent takes a PodSnapshot, and what it refuses, over a fake of the Kubernetes port.

(The real flow, with the real API server and two agents, is in tests/e2e/test_snapshot_flows.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound
from kubectl_snapshot.core.model import HostFacts
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker
from tests.support.fakekube import EventRecorder, RecordedEvent


@dataclass
class FakeKube(EventRecorder):
    pods: dict[tuple[str, str], dict[str, Any]]
    conflict: bool = False
    patches: list[tuple[str, str, dict[str, Any], str | None]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return self.pods[(ns, name)]
        except KeyError:
            raise NotFound(f"pod {ns}/{name} not found") from None

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        if resource_version is not None and self.conflict:
            raise FailedPrecondition("conflict", retryable=True)
        self.patches.append((ns, name, status, resource_version))
        return {}


def snapshot(spec: dict[str, Any], phase: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": "s1", "namespace": "a", "resourceVersion": "7"},
        "spec": {"destination": "127.0.0.1:5005/x", **spec},
    }
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def pod(node: str) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "a", "uid": "u"}, "spec": {"nodeName": node}, "status": {}}


class Recording(SnapshotWorker):
    ran: list[str]

    def run(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        self.ran.append(obj["metadata"]["name"])


def worker(kube: FakeKube, node: str = "n1") -> Recording:
    w = Recording(kube=kube, settings=NodeSettings(node=node), facts=HostFacts())
    w.ran = []
    return w


def test_the_agent_of_the_pods_node_claims_and_runs_it() -> None:
    kube = FakeKube({("a", "p"): pod("n1")})
    w = worker(kube)
    w.consider(snapshot({"podName": "p"}))
    assert w.ran == ["s1"]
    (_, _, status, rv) = kube.patches[0]
    assert status["phase"] == K.PHASE_RUNNING and status["node"] == "n1" and rv == "7"


def test_other_nodes_and_finished_objects_are_left_alone() -> None:
    kube = FakeKube({("a", "p"): pod("n2")})
    w = worker(kube)
    w.consider(snapshot({"podName": "p"}))
    w.consider(snapshot({"podName": "p"}, phase=K.PHASE_SUCCEEDED))
    assert w.ran == [] and kube.patches == []


def test_losing_the_claim_race_means_not_running_it() -> None:
    kube = FakeKube({("a", "p"): pod("n1")}, conflict=True)
    w = worker(kube)
    w.consider(snapshot({"podName": "p"}))
    assert w.ran == [] and kube.patches == []


def test_a_pod_of_another_namespace_is_refused_without_looking_it_up() -> None:
    kube = FakeKube({("b", "p"): pod("n1")})
    w = worker(kube)
    w.consider(snapshot({"podName": "p", "podNamespace": "b"}))
    assert w.ran == []
    final = kube.patches[-1][2]
    assert final["phase"] == K.PHASE_FAILED and "refused" in final["message"]


def test_an_unknown_pod_fails_the_snapshot() -> None:
    kube = FakeKube({})
    w = worker(kube)
    w.consider(snapshot({"podName": "ghost"}))
    final = kube.patches[-1][2]
    assert final["phase"] == K.PHASE_FAILED and "ghost" in final["message"] and "not found" in final["message"]


def test_a_snapshot_left_running_by_an_earlier_agent_is_failed_once() -> None:
    kube = FakeKube({("a", "p"): pod("n1")})
    w = worker(kube)
    obj = snapshot({"podName": "p"}, phase=K.PHASE_RUNNING)
    obj["status"]["node"] = "n1"
    obj["metadata"]["uid"] = "u1"
    w.consider(obj)
    w.consider(obj)  # a later event for the same object changes nothing
    assert len(kube.patches) == 1
    final = kube.patches[0][2]
    assert final["phase"] == K.PHASE_FAILED and "restarted" in final["message"]
    other = snapshot({"podName": "p"}, phase=K.PHASE_RUNNING)
    other["status"]["node"] = "n2"  # another node's agent is working on it
    w.consider(other)
    assert len(kube.patches) == 1


def test_our_own_claim_seen_again_is_not_taken_for_a_restart() -> None:
    kube = FakeKube({("b", "p"): pod("n1")})
    w = worker(kube)
    obj = snapshot({"podName": "p", "podNamespace": "b"})
    obj["metadata"]["uid"] = "u2"
    w.consider(obj)  # claimed, then refused
    stale = snapshot({"podName": "p", "podNamespace": "b"}, phase=K.PHASE_RUNNING)
    stale["status"]["node"] = "n1"
    stale["metadata"]["uid"] = "u2"
    w.consider(stale)  # the watch delivers our claim after the fact
    assert "refused" in kube.patches[-1][2]["message"]


def test_a_final_save_stops_only_a_pod_already_being_terminated() -> None:
    """The label that lets an agent create a stop save (admission) never stops a pod that would have
    run on: the agent of the pod's node refuses it unless the pod is being deleted."""
    kube = FakeKube({("a", "p"): pod("n1")})
    w = worker(kube)
    final = snapshot({"podName": "p", "stop": True})
    final["metadata"]["labels"] = {K.LABEL_FINAL_SAVE: "true"}
    w.consider(final)
    assert w.ran == []
    status = kube.patches[-1][2]
    assert (
        status["phase"] == K.PHASE_FAILED and "refused" in status["message"] and "being terminated" in status["message"]
    )
    kube.pods[("a", "p")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:30Z"
    w.consider(snapshot({"podName": "p", "stop": True}) | {"metadata": final["metadata"] | {"name": "s2"}})
    assert w.ran == ["s2"]


def test_a_pod_replaced_since_the_request_is_refused_as_source_pod_replaced() -> None:
    """spec.podUID is the pod the plugin checked; a new pod of the same name is another pod (A8)."""
    kube = FakeKube({("a", "p"): pod("n1")})  # uid "u"
    w = worker(kube)
    w.consider(snapshot({"podName": "p", "podUID": "u-old"}))
    assert w.ran == []
    final = kube.patches[-1][2]
    assert final["phase"] == K.PHASE_FAILED and final["reason"] == "SourcePodReplaced"
    assert "replaced" in final["message"] and "u-old" in final["message"]
    assert [e.reason for e in kube.events] == [K.EVENT_SOURCE_POD_REPLACED]


def test_the_same_pod_and_a_snapshot_without_a_pod_uid_are_taken() -> None:
    kube = FakeKube({("a", "p"): pod("n1")})
    w = worker(kube)
    w.consider(snapshot({"podName": "p", "podUID": "u"}))
    w.consider(snapshot({"podName": "p"}) | {"metadata": {"name": "s2", "namespace": "a", "resourceVersion": "8"}})
    assert w.ran == ["s1", "s2"]
    assert all(p[2]["phase"] == K.PHASE_RUNNING for p in kube.patches)
