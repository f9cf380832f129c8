"""Threat E2: a burst of requests from one namespace. At most `--namespace-backlog` snapshots, and as many
restores, of one namespace wait or run on a node: the next one fails at once (phase Failed, reason
TooManyRequests, a hint), another namespace's goes on, and one finished makes room again. A final save and a
resume are never refused. In pairs: the Nth accepted beside the N+1th refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.backlog import DEFAULT_NAMESPACE_BACKLOG, Backlog, parse_bound
from kubectl_snapshot.core.errors import InvalidArgument, NotFound, TooManyRequests, Unavailable
from kubectl_snapshot.core.model import HostFacts, PodRecord
from kubectl_snapshot.core.podspec import restore_pod
from kubectl_snapshot.core.reference import Reference
from shim.controller.restores import RestoreWorker
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker
from tests.support.fakekube import EventRecorder, RecordedEvent

# --- the decision -----------------------------------------------------------------------------------


def test_the_nth_request_is_admitted_and_the_next_refused_with_a_hint() -> None:
    b = Backlog(3, "snapshots", "n1")
    assert [b.admit("a") for _ in range(3)] == [None, None, None]
    refused = b.admit("a")
    assert isinstance(refused, TooManyRequests)
    assert refused.message.startswith("refused: namespace a already has 3 snapshots queued or running on node n1")
    assert refused.hint and "wait for those snapshots to finish" in refused.hint
    assert b.counts == {"a": 3}  # the refused one is not counted


def test_another_namespace_is_not_affected_and_a_finished_one_makes_room() -> None:
    b = Backlog(2, "restores")
    assert b.admit("a") is None and b.admit("a") is None and b.admit("a") is not None
    assert b.admit("b") is None
    b.done("a")
    assert b.admit("a") is None and b.admit("a") is not None


def test_an_exempt_request_is_admitted_over_the_bound_and_counted() -> None:
    b = Backlog(1, "snapshots")
    assert b.admit("a") is None and b.admit("a", exempt=True) is None
    assert b.counts == {"a": 2}
    b.done("a")
    assert b.admit("a") is not None  # still one there


def test_the_bound_setting() -> None:
    assert parse_bound("") == DEFAULT_NAMESPACE_BACKLOG and parse_bound(" 5 ") == 5
    for bad in ("0", "-1", "x"):
        with pytest.raises(InvalidArgument, match="--namespace-backlog"):
            parse_bound(bad)


# --- the agent's snapshots ------------------------------------------------------------------------


@dataclass
class FakeKube(EventRecorder):
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    patches: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    annotations: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return self.pods[(ns, name)]
        except KeyError:
            raise NotFound(f"pod {ns}/{name} not found") from None

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        self.patches.append((ns, name, status))
        return {}

    def patch_pod_annotations(self, ns: str, name: str, annotations: dict[str, Any], *, status: bool = False) -> Any:
        self.annotations.append((name, annotations))
        return {}


class HeldQueue:
    """The node's save queue, holding every job until the test runs it."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, Any]] = []

    def submit(self, job: Any, *, key: str = "", order: Any = None, on_drop: Any = None) -> None:
        self.jobs.append((key, job))


def snap(name: str, ns: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"{ns}-{name}", "resourceVersion": "1", "labels": labels},
        "spec": {"podName": "p", "destination": "127.0.0.1:5005/x", **({"stop": True} if labels else {})},
    }


def running_pod(ns: str, *, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": ns, "uid": f"pod-{ns}"}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {}}


def snapshots(bound: int) -> tuple[SnapshotWorker, FakeKube, HeldQueue]:
    kube, queue = FakeKube(pods={("a", "p"): running_pod("a"), ("b", "p"): running_pod("b")}), HeldQueue()
    settings = NodeSettings(node="n1", namespace_backlog=str(bound))
    w = SnapshotWorker(kube=kube, settings=settings, facts=HostFacts(), queue=queue)  # type: ignore[arg-type]
    w.run = lambda obj, pod: None  # type: ignore[method-assign]
    return w, kube, queue


def final_status(kube: FakeKube, name: str) -> dict[str, Any]:
    return [s for _, n, s in kube.patches if n == name][-1]


def test_a_burst_of_snapshots_is_queued_up_to_the_bound_and_the_next_fails_at_once() -> None:
    w, kube, queue = snapshots(3)
    for i in range(3):
        w.consider(snap(f"s{i}", "a"))
    assert [k for k, _ in queue.jobs] == ["a", "a", "a"]
    assert all(final_status(kube, f"s{i}")["phase"] == K.PHASE_RUNNING for i in range(3))
    w.consider(snap("s3", "a"))
    assert len(queue.jobs) == 3  # not queued
    failed = final_status(kube, "s3")
    assert failed["phase"] == K.PHASE_FAILED and failed["reason"] == "TooManyRequests"
    assert "namespace a already has 3 snapshots queued or running on node n1" in failed["message"]
    assert failed["hint"] and "--namespace-backlog" in failed["hint"]
    assert [e.reason for e in kube.events if e.kind == "PodSnapshot"] == [K.EVENT_SNAPSHOT_FAILED]
    # another namespace's goes on
    w.consider(snap("t0", "b"))
    assert [k for k, _ in queue.jobs] == ["a", "a", "a", "b"]
    # one of a's finished: room for the next
    queue.jobs.pop(0)[1]()
    w.consider(snap("s4", "a"))
    assert final_status(kube, "s4")["phase"] == K.PHASE_RUNNING and len(queue.jobs) == 4


def test_a_claim_that_fails_gives_its_place_back() -> None:
    w, kube, queue = snapshots(1)

    def unreachable(*a: Any, **kw: Any) -> Any:
        raise Unavailable("the API server went away")

    kube.patch_snapshot_status = unreachable  # type: ignore[method-assign]
    with pytest.raises(Unavailable):
        w.consider(snap("s0", "a"))
    assert w.backlog.count("a") == 0 and queue.jobs == []


def test_a_final_save_is_never_refused() -> None:
    w, kube, queue = snapshots(1)
    kube.pods[("a", "p")] = running_pod("a", terminating=True)
    w.consider(snap("s0", "a"))
    w.consider(snap("final", "a", **{K.LABEL_FINAL_SAVE: "true"}))
    assert len(queue.jobs) == 2 and final_status(kube, "final")["phase"] == K.PHASE_RUNNING


# --- the agent's restores -------------------------------------------------------------------------


class HeldScheduler:
    def __init__(self) -> None:
        self.jobs: list[tuple[str, Any]] = []

    def submit(self, key: str, job: Any) -> None:
        self.jobs.append((key, job))


def restore_of(ns: str, i: int) -> dict[str, Any]:
    record = PodRecord(
        name="app",
        namespace=ns,
        uid="old",
        node="n0",
        spec={"containers": [{"name": "c", "image": "r/b@sha256:" + "2" * 64}]},
    )
    pod = restore_pod(
        record,
        reference=Reference.parse("127.0.0.1:1/x@sha256:" + "1" * 64),
        namespace=ns,
        gate_image="g:1",
        name=f"r{i}",
    )
    pod["metadata"]["uid"] = f"{ns}-{i}-0000-0000-0000-000000000000"
    pod["spec"]["nodeName"] = "n1"
    return pod


def restores(tmp_path: Path, bound: int) -> tuple[RestoreWorker, FakeKube, HeldScheduler]:
    kube, scheduler = FakeKube(), HeldScheduler()
    settings = NodeSettings(
        node="n1", state_root=str(tmp_path / "state"), kubelet_root=str(tmp_path / "k"), namespace_backlog=str(bound)
    )
    w = RestoreWorker(kube=kube, settings=settings, facts=HostFacts(), scheduler=scheduler)  # type: ignore[arg-type]
    w.run = lambda pod: True  # type: ignore[method-assign]
    return w, kube, scheduler


def test_a_burst_of_restores_is_queued_up_to_the_bound_and_the_next_fails_at_once(tmp_path: Path) -> None:
    w, kube, scheduler = restores(tmp_path, 2)
    w.consider(restore_of("a", 0))
    w.consider(restore_of("a", 1))
    assert [k for k, _ in scheduler.jobs] == ["a", "a"] and kube.annotations == []
    w.consider(restore_of("a", 2))
    assert len(scheduler.jobs) == 2
    [(name, annotations)] = kube.annotations
    assert name == "r2"
    assert annotations[K.ANN_RESTORE_STATUS].startswith(
        K.RESTORE_FAILED_PREFIX + "refused: namespace a already has 2 restores queued or running on node n1"
    )
    assert [(e.reason, e.type) for e in kube.events] == [(K.EVENT_RESTORE_FAILED, "Warning")]
    assert "hint: wait for those restores to finish" in kube.events[0].message
    w.consider(restore_of("b", 0))  # another namespace's goes on
    assert [k for k, _ in scheduler.jobs] == ["a", "a", "b"]
    scheduler.jobs.pop(0)[1]()  # one of a's finished: room for the next
    w.consider(restore_of("a", 3))
    assert [k for k, _ in scheduler.jobs] == ["a", "b", "a"] and len(kube.annotations) == 1


def test_a_resume_is_never_refused_but_counts(tmp_path: Path) -> None:
    """A workload's replacement pod resumes (or starts fresh) whatever its namespace has queued here."""
    w, kube, scheduler = restores(tmp_path, 1)
    w.consider(restore_of("a", 0))
    resuming = {
        "metadata": {"name": "web-1", "namespace": "a", "uid": "resume-1", "annotations": {K.ANN_RESUME_POLICY: "p"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "app"}]},
        "status": {},
    }
    w.consider(resuming)
    assert [k for k, _ in scheduler.jobs] == ["a", "a"] and kube.annotations == []
    w.consider(restore_of("a", 1))  # and it counts: a's next restore waits for room
    assert len(scheduler.jobs) == 2 and "refused: namespace a already has 2 restores" in str(kube.annotations)
