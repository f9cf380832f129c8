"""The agent's autosave loop (shim/controller/policies.py) over an in-memory API: one save in flight
at a time, the schedule read back after a restart, retention deleting manifests before objects,
status entries per node. The real thing runs in tests/e2e/test_autosave_policy.py."""

from __future__ import annotations

import copy
import datetime
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import AlreadyExists, NotFound, SnapshotError
from kubectl_snapshot.core.provenance import signature_tag
from kubectl_snapshot.core.reference import Reference
from shim.controller.policies import Autosave, delete_manifest
from tests.support.fakekube import EventRecorder, RecordedEvent


def iso(t: float) -> str:
    return T.rfc3339(t)


class FakeKube(EventRecorder):
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.applied: list[tuple[str, list[dict[str, Any]], str]] = []
        self.events: list[RecordedEvent] = []
        self.annotations: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in (label_selector or "").split(",") if kv)
        return [
            copy.deepcopy(o)
            for o in self.snapshots.values()
            if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())
        ]

    def get_snapshot(self, ns: str, name: str) -> dict[str, Any]:
        if name not in self.snapshots:
            raise NotFound(name)
        return copy.deepcopy(self.snapshots[name])

    def create_snapshot(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name in self.snapshots:
            raise AlreadyExists(name)
        obj = copy.deepcopy(body)
        obj["metadata"]["creationTimestamp"] = iso(self.clock[0])
        self.snapshots[name] = obj
        return copy.deepcopy(obj)

    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self.calls.append(f"delete podsnapshot {name}")
        self.snapshots.pop(name)

    def apply_policy_pods(
        self, ns: str, name: str, pods: list[dict[str, Any]], *, field_manager: str
    ) -> dict[str, Any]:
        self.applied.append((name, pods, field_manager))
        return {}

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> dict[str, Any]:
        assert status  # through pods/status: the agent has no pods patch
        self.annotations[name] = annotations
        return {}

    def finish(self, name: str, phase: str, digest: str = "") -> None:
        st = self.snapshots[name].setdefault("status", {})
        st.update(phase=phase, completionTime=iso(self.clock[0]), message="boom" if phase == K.PHASE_FAILED else "")
        if digest:
            st["reference"] = f"r.io:5000/saves@{digest}"


class FakeRegistry:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def get_manifest(self, ref: Reference) -> tuple[bytes, str, str]:
        if ref.tag == signature_tag("sha256:" + "1" * 64):
            return b"{}", "application/vnd.oci.image.manifest.v1+json", "sha256:" + "5" * 64
        raise NotFound(str(ref))

    def delete_manifest(self, ref: Reference, digest: str) -> None:
        self.calls.append(f"delete manifest {digest[:9]}")


POD = {
    "metadata": {"name": "web-0", "namespace": "ns", "uid": "u1", "labels": {"app": "web"}},
    "spec": {"nodeName": "n1"},
    "status": {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]},
}
POLICY: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "ns"},
    "spec": {
        "selector": {"matchLabels": {"app": "web"}},
        "interval": "30s",
        "destination": "r.io:5000/saves",
        "retention": {"keepLast": 1},
    },
}


def agent(kube: FakeKube, clock: list[float]) -> Autosave:
    a = Autosave(kube, "n1", registry_for=lambda ns, s, i: FakeRegistry(kube.calls), clock=lambda: clock[0])
    a.policy_changed(POLICY)
    a.pod_changed(POD)
    return a


def test_saves_never_overlap_and_follow_the_interval() -> None:
    clock = [datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()]
    kube = FakeKube(clock)
    a = agent(kube, clock)
    a.tick()
    assert list(kube.snapshots) == ["web-0-20260101-000000"]
    first = kube.snapshots["web-0-20260101-000000"]
    assert first["metadata"]["labels"][K.LABEL_POLICY] == "p" and first["spec"]["destination"].endswith(
        ":web-0-20260101-000000"
    )
    clock[0] += 60  # past the interval, but the first save is still running: no second one
    a.tick()
    assert len(kube.snapshots) == 1
    kube.finish("web-0-20260101-000000", K.PHASE_SUCCEEDED, "sha256:" + "1" * 64)
    clock[0] += 2
    a.tick()  # sees it finished; the next one was due 30 s after the first was created
    assert len(kube.snapshots) == 2
    # status: this node's entry, with its own field manager
    name, pods, manager = kube.applied[-1]
    assert name == "p" and manager == "kubectl-snapshot-agent/n1" and pods[0]["name"] == "web-0"


def test_retention_deletes_the_manifest_and_signature_then_the_object() -> None:
    clock = [1_000_000.0]
    kube = FakeKube(clock)
    a = agent(kube, clock)
    a.tick()
    old = next(iter(kube.snapshots))
    kube.finish(old, K.PHASE_SUCCEEDED, "sha256:" + "1" * 64)
    clock[0] += 1
    a.tick()
    clock[0] += 40
    a.tick()
    new = next(n for n in kube.snapshots if n != old)
    kube.finish(new, K.PHASE_SUCCEEDED, "sha256:" + "2" * 64)
    clock[0] += 3
    a.tick()
    assert list(kube.snapshots) == [new]  # keepLast 1
    assert kube.calls == ["delete manifest sha256:55", "delete manifest sha256:11", f"delete podsnapshot {old}"]


def test_retention_that_could_not_delete_tries_again_without_another_save() -> None:
    clock = [1_500_000.0]
    kube = FakeKube(clock)
    down = [True]

    class FlakyRegistry(FakeRegistry):
        def delete_manifest(self, ref: Reference, digest: str) -> None:
            if down[0]:
                raise SnapshotError("registry unavailable")
            super().delete_manifest(ref, digest)

    a = Autosave(kube, "n1", registry_for=lambda ns, s, i: FlakyRegistry(kube.calls), clock=lambda: clock[0])
    a.policy_changed(POLICY)
    a.pod_changed(POD)
    a.tick()
    old = next(iter(kube.snapshots))
    kube.finish(old, K.PHASE_SUCCEEDED, "sha256:" + "1" * 64)
    clock[0] += 40
    a.tick()  # the first is finished; the second one starts
    new = next(n for n in kube.snapshots if n != old)
    # the policy is suspended while the second save runs: no further save will come to retry retention
    a.policy_changed({**POLICY, "spec": {**POLICY["spec"], "suspend": True}})
    kube.finish(new, K.PHASE_SUCCEEDED, "sha256:" + "2" * 64)
    clock[0] += 3
    a.tick()
    assert set(kube.snapshots) == {old, new}  # the registry refused: the save is kept
    failures = [e for e in kube.events if e.reason == "RetentionFailed"]
    assert len(failures) == 1
    clock[0] += 10
    a.tick()
    assert set(kube.snapshots) == {old, new}  # not before the retry time
    clock[0] += 21
    a.tick()  # 31 s after: tried again, refused again; the next try only 60 s later
    assert len([e for e in kube.events if e.reason == "RetentionFailed"]) == 2
    down[0] = False
    clock[0] += 50
    a.tick()
    assert set(kube.snapshots) == {old, new}
    clock[0] += 11
    a.tick()
    assert list(kube.snapshots) == [new] and f"delete podsnapshot {old}" in kube.calls
    assert len(kube.snapshots) == 1  # and, suspended, nothing new was saved


def test_a_failed_save_is_retried_with_backoff_and_reported_on_the_policy() -> None:
    clock = [2_000_000.0]
    kube = FakeKube(clock)
    a = agent(kube, clock)
    a.tick()
    first = next(iter(kube.snapshots))
    clock[0] += 1
    kube.finish(first, K.PHASE_FAILED)
    clock[0] += 2
    a.tick()
    assert any(e.kind == K.POLICY_KIND and "retry in" in e.message for e in kube.events)
    clock[0] += 1
    a.tick()
    assert len(kube.snapshots) == 1  # backoff: 5 s after the failure
    clock[0] += 5
    a.tick()
    assert len(kube.snapshots) == 2
    entry = kube.applied[-1][1][0]
    assert entry["consecutiveFailures"] == 1 and entry["lastResult"] == K.PHASE_FAILED


def test_the_schedule_survives_an_agent_restart() -> None:
    clock = [3_000_000.0]
    kube = FakeKube(clock)
    a = agent(kube, clock)
    a.tick()
    kube.finish(next(iter(kube.snapshots)), K.PHASE_SUCCEEDED, "sha256:" + "1" * 64)
    clock[0] += 10
    restarted = agent(kube, clock)  # a new process: reads the pod's saves back
    restarted.tick()
    assert len(kube.snapshots) == 1  # not due before 30 s after the last one
    clock[0] += 21
    restarted.tick()
    assert len(kube.snapshots) == 2


def test_saves_that_fell_due_while_the_agent_was_down_are_spread_not_started_at_once() -> None:
    clock = [3_500_000.0]
    kube = FakeKube(clock)
    pods: list[dict[str, Any]] = [copy.deepcopy(POD) for _ in range(20)]
    for i, p in enumerate(pods):
        p["metadata"].update(name=f"web-{i}", uid=f"u{i}")
    a = Autosave(kube, "n1", registry_for=lambda ns, s, i: FakeRegistry(kube.calls), clock=lambda: clock[0])
    a.policy_changed(POLICY)
    for p in pods:
        a.pod_changed(p)
    while len(kube.snapshots) < 20:  # every pod saved once (overdue ones at once: they have no save yet)
        a.tick()
        for name, obj in kube.snapshots.items():
            if "status" not in obj:
                kube.finish(name, K.PHASE_SUCCEEDED, "sha256:" + "1" * 64)
        clock[0] += 1
    clock[0] += 300  # the agent was down for five minutes: every pod's next save (30 s) is overdue
    restarted = Autosave(kube, "n1", registry_for=lambda ns, s, i: FakeRegistry(kube.calls), clock=lambda: clock[0])
    restarted.policy_changed(POLICY)
    for p in pods:
        restarted.pod_changed(p)
    started: list[int] = []
    for second in range(31):
        before = len(kube.snapshots)
        restarted.tick()
        started.append(len(kube.snapshots) - before)
        if second == 0:  # the policy's status says when each waiting pod's save comes
            waiting = [e for e in kube.applied[-1][1] if (T.seconds(e.get("nextSaveTime")) or 0.0) > clock[0]]
            assert len(waiting) >= 15, kube.applied[-1][1]  # (whole seconds: one due within this one reads as now)
        clock[0] += 1
    assert sum(started) == 20, started  # each overdue pod saved within one interval of the restart ...
    assert max(started) <= 5, started  # ... at its own offset: not all twenty in the first second


def test_suspend_and_leaving_the_node() -> None:
    clock = [4_000_000.0]
    kube = FakeKube(clock)
    a = agent(kube, clock)
    a.policy_changed({**POLICY, "spec": {**POLICY["spec"], "suspend": True}})
    a.tick()
    assert kube.snapshots == {}
    a.pod_gone(POD)
    a.tick()
    assert kube.applied[-1][1] == []  # the entry of a pod that left is removed by the next apply


def test_last_save_annotation() -> None:
    clock = [0.0]
    kube = FakeKube(clock)
    agent(kube, clock).on_saved({}, POD)
    assert kube.annotations["web-0"] == {K.ANN_LAST_SAVE: "1970-01-01T00:00:00Z"}


def test_delete_manifest_without_signature() -> None:
    calls: list[str] = []
    delete_manifest(FakeRegistry(calls), Reference.parse("r.io:5000/saves@sha256:" + "3" * 64))
    assert calls == ["delete manifest sha256:33"]


def test_a_pod_that_just_started_is_first_saved_at_its_offset_not_at_once() -> None:
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    clock = [start]
    kube = FakeKube(clock)
    pod: dict[str, Any] = copy.deepcopy(POD)
    pod["status"]["startTime"] = iso(start)
    a = Autosave(kube, "n1", registry_for=lambda ns, s, i: FakeRegistry(kube.calls), clock=lambda: clock[0])
    a.policy_changed(POLICY)
    a.pod_changed(pod)
    due = A.first_save_due("u1", 30, pod_started=start, policy_created=0)
    assert start < due < start + 30
    while clock[0] < due - 1:
        a.tick()
        assert not kube.snapshots, f"saved at {clock[0] - start:.0f}s, due at {due - start:.1f}s"
        clock[0] += 1
    clock[0] = due
    a.tick()
    assert len(kube.snapshots) == 1


def test_a_pod_already_running_when_the_agent_starts_is_saved_at_once() -> None:
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    clock = [start + 3600]  # the pod and the policy are an hour old: its first save is overdue
    kube = FakeKube(clock)
    pod: dict[str, Any] = copy.deepcopy(POD)
    pod["status"]["startTime"] = iso(start)
    a = Autosave(kube, "n1", registry_for=lambda ns, s, i: FakeRegistry(kube.calls), clock=lambda: clock[0])
    a.policy_changed({**POLICY, "metadata": {**POLICY["metadata"], "creationTimestamp": iso(start)}})
    a.pod_changed(pod)
    a.tick()
    assert len(kube.snapshots) == 1
