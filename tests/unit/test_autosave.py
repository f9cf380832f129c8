"""The pure autosave rules (kubectl_snapshot/core/autosave.py): selection, schedule, names, retention."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import InvalidArgument


def pod(name: str = "web-0", *, labels: dict[str, str] | None = None, owner: tuple[str, str] | None = None) -> Any:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels or {"app": "web"}}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "controller": True}]
    return {
        "metadata": meta,
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]},
    }


def policy(**spec: Any) -> Any:
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "selector": {"matchLabels": {"app": "web"}},
            "interval": "30s",
            "destination": "r.io:5000/saves",
            **spec,
        },
    }


def test_durations() -> None:
    assert A.parse_duration("30s") == 30
    assert A.parse_duration("1h30m") == 5400
    assert A.parse_duration("2m5s") == 125
    for bad in ("", "5", "1d", "1.5h", "-1s"):
        with pytest.raises(InvalidArgument):
            A.parse_duration(bad)
    assert A.format_duration(5400) == "1h30m"
    assert A.format_duration(0) == "0s"


def test_selection() -> None:
    p = pod(owner=("StatefulSet", "web"))
    wl = W.Workload("StatefulSet", "web")
    assert A.selects(policy(), p, wl)
    assert not A.selects(policy(selector={"matchLabels": {"app": "db"}}), p, wl)
    assert not A.selects(policy(selector={"matchLabels": {}}), p, wl)  # never "every pod"
    assert A.selects(policy(workload={"kind": "StatefulSet", "name": "web"}), p, wl)
    assert not A.selects(policy(workload={"kind": "StatefulSet", "name": "db"}), p, wl)
    assert not A.selects(policy(workload={"kind": "Deployment", "name": "web"}), p, wl)
    other_ns = policy()
    other_ns["metadata"]["namespace"] = "other"
    assert not A.selects(other_ns, p, wl)


def test_only_running_pods_on_the_node_being_kept() -> None:
    p = pod()
    assert A.eligible(p, "n1")
    assert not A.eligible(p, "n2")
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not A.eligible(p, "n1")
    p = pod()
    p["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    assert not A.eligible(p, "n1")
    p = pod()
    p["status"]["phase"] = "Pending"
    assert not A.eligible(p, "n1")


def test_save_object_names_labels_and_tag() -> None:
    p = pod(owner=("Job", "count"))
    p["metadata"]["labels"][W.COMPLETION_INDEX_KEY] = "3"
    now = datetime.datetime(2026, 11, 30, 21, 0, 5, tzinfo=datetime.UTC)
    obj = A.save_object(
        policy(registrySecret="creds", insecure=True, includeVolumes=False), p, W.Workload("Job", "count"), now
    )
    assert obj["metadata"]["name"] == "web-0-20261130-210005"
    assert obj["spec"]["destination"] == "r.io:5000/saves:web-0-20261130-210005"
    assert obj["spec"]["registrySecret"] == "creds"
    assert obj["spec"]["insecure"] is True and obj["spec"]["includeVolumes"] is False
    assert obj["spec"]["stop"] is False
    assert obj["spec"]["podUID"] == "uid-web-0"  # the pod the policy saves, not a later one of its name (A8)
    assert obj["metadata"]["labels"] == {
        K.LABEL_POD: "web-0",
        K.LABEL_POD_UID: "uid-web-0",
        K.LABEL_POLICY: "p",
        K.LABEL_WORKLOAD_KIND: "Job",
        K.LABEL_WORKLOAD_NAME: "count",
        K.LABEL_COMPLETION_INDEX: "3",
    }
    second = A.save_object(policy(), p, W.Workload("Job", "count"), now, attempt=2)
    assert second["metadata"]["name"].endswith("-2") and second["spec"]["destination"].endswith("-2")
    # a destination given with a tag still gets a tag per save
    tagged = A.save_object(policy(destination="r.io:5000/saves:latest"), p, W.Workload("Job", "count"), now)
    assert tagged["spec"]["destination"] == "r.io:5000/saves:web-0-20261130-210005"


def s(name: str, created: float, phase: str = K.PHASE_SUCCEEDED, completed: float | None = None) -> A.Save:
    done = completed if completed is not None else (created + 2 if phase in K.TERMINAL_PHASES else None)
    return A.Save(name=name, created=created, phase=phase, completed=done)


def test_schedule_from_the_saves_alone() -> None:
    assert A.schedule([], 30, now=100).due == 100  # first save at once
    sched = A.schedule([s("a", 10), s("b", 40)], 30, now=50)
    assert sched.due == 70 and sched.in_flight is None and sched.failures == 0 and sched.last_good == s("b", 40)
    # one in flight: nothing else starts
    assert A.schedule([s("a", 10), s("b", 40, "Running")], 30, now=500).in_flight == "b"
    assert A.schedule([s("a", 10), s("b", 40, "")], 30, now=500).in_flight == "b"


def test_failed_saves_back_off_exponentially_capped_at_the_interval() -> None:
    assert [A.backoff_s(n, 60) for n in (1, 2, 3, 4, 5)] == [5, 10, 20, 40, 60]
    saves = [s("a", 10), s("b", 40, "Failed", completed=45), s("c", 50, "Failed", completed=52)]
    sched = A.schedule(saves, 60, now=53)
    assert sched.failures == 2 and sched.due == 52 + 10
    assert sched.last_good == s("a", 10) and sched.last is not None and sched.last.name == "c"


def test_retention_keeps_the_last_n_good_and_a_few_failed() -> None:
    saves = [s(f"g{i}", 10 * i) for i in range(5)] + [s(f"f{i}", 10 * i + 5, "Failed") for i in range(4)]
    saves.append(s("running", 100, "Running"))
    doomed = {x.name for x in A.retention(saves, keep_last=2, max_age_s=None, now=200)}
    assert doomed == {"g0", "g1", "g2", "f0", "f1"}


def test_retention_max_age_spares_the_newest_good_save() -> None:
    saves = [s("g0", 0), s("g1", 10), s("g2", 20)]
    assert {x.name for x in A.retention(saves, keep_last=5, max_age_s=50, now=100)} == {"g0", "g1"}
    assert A.retention(saves, keep_last=5, max_age_s=500, now=100) == []


def test_orphans_only_by_age() -> None:
    saves = [s("g0", 0), s("g1", 90)]
    assert A.orphan_retention(saves, max_age_s=None, now=100) == []
    assert [x.name for x in A.orphan_retention(saves, max_age_s=50, now=100)] == ["g0"]


def test_status_entry() -> None:
    saves = [
        A.Save("a", 10, K.PHASE_SUCCEEDED, completed=12, reference="r.io:5000/saves@sha256:" + "a" * 64, size=42),
        A.Save("b", 40, K.PHASE_FAILED, completed=41, message="boom"),
    ]
    entry = A.pod_status_entry(pod(), "n1", A.schedule(saves, 30, now=50))
    assert entry["name"] == "web-0" and entry["uid"] == "uid-web-0" and entry["node"] == "n1"
    assert entry["lastSnapshot"] == "a" and entry["lastSize"] == 42 and entry["lastSaveTime"] == "1970-01-01T00:00:12Z"
    assert entry["lastResult"] == K.PHASE_FAILED and entry["lastMessage"] == "boom"
    assert entry["consecutiveFailures"] == 1 and entry["nextSaveTime"] == "1970-01-01T00:00:46Z"
    assert "nextSaveTime" not in A.pod_status_entry(pod(), "n1", A.schedule(saves, 30, now=50), suspended=True)


def test_a_pods_first_save_comes_at_its_own_offset_within_a_minute_of_its_start() -> None:
    due = A.first_save_due("uid-1", 600, pod_started=1000, policy_created=10)
    assert due == A.first_save_due("uid-1", 600, pod_started=1000, policy_created=10)  # same after a restart
    assert 1000 <= due < 1000 + A.FIRST_SAVE_SPREAD_S  # a 10-minute policy still protects within a minute
    # a pod older than the policy: counted from the policy's creation
    assert 5000 <= A.first_save_due("uid-1", 600, pod_started=1000, policy_created=5000) < 5060
    # an interval shorter than the spread: within one interval
    assert 1000 <= A.first_save_due("uid-1", 10, pod_started=1000, policy_created=0) < 1010


def test_fifty_pods_started_together_are_spread_over_the_interval() -> None:
    dues = sorted(A.first_save_due(f"pod-uid-{i}", 60, pod_started=0, policy_created=0) for i in range(50))
    assert dues[0] >= 0 and dues[-1] < 60
    # no second holds more than a few of them, where due-at-start put all 50 in one
    per_second: dict[int, int] = {}
    for d in dues:
        per_second[int(d)] = per_second.get(int(d), 0) + 1
    assert max(per_second.values()) <= 5 and len(per_second) >= 25


def test_the_first_save_waits_for_its_due_time_then_the_interval_keeps_the_spread() -> None:
    assert A.schedule([], 30, now=100, first_due=120).due == 120
    assert A.schedule([], 30, now=100).due == 100  # without one: at once
    # once a save exists the first due time no longer matters: one interval after the save
    assert A.schedule([s("a", 121)], 30, now=130, first_due=120).due == 151


def test_a_save_that_fell_due_while_no_agent_ran_waits_for_its_pods_offset_from_now() -> None:
    # overdue (due 100, now 500): at the pod's own offset within a minute of now, the same for the same uid
    later = A.overdue_not_before("uid-1", 600, due=100, now=500)
    assert 500 <= later < 500 + A.FIRST_SAVE_SPREAD_S
    assert later == A.overdue_not_before("uid-1", 600, due=100, now=500)
    # the legitimate case: a save not yet due is not held back at all
    assert A.overdue_not_before("uid-1", 600, due=900, now=500) == 0.0
    # fifty pods overdue together are spread over the minute, not started in one second
    dues = [A.overdue_not_before(f"pod-uid-{i}", 60, due=0, now=1000) for i in range(50)]
    per_second: dict[int, int] = {}
    for d in dues:
        per_second[int(d)] = per_second.get(int(d), 0) + 1
    assert max(per_second.values()) <= 5 and len(per_second) >= 25
