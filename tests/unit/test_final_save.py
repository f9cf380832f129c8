"""Final save before termination (issue 13): who gets one, the hook admission adds, the Event when it
is too late, and the agent's side over a fake of the Kubernetes port. The real flow (kubectl drain
on the two-node cluster) is tests/e2e/test_final_save.py."""

from __future__ import annotations

import datetime
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import finalsave as F
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import resume as R
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.deploy import render
from kubectl_snapshot.deploy import resume_admission as resume
from shim.controller.finalsave import FinalSaver

NOW = 1_800_000_000.0
NODE = "n1"


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    *, grace: int = 30, deleted_ago: float | None = 1.0, protected: bool = True, hook: Any = "ours", **meta: Any
) -> dict[str, Any]:
    sleep = F.hook_sleep_s(grace)
    lifecycle = {"preStop": {"sleep": {"seconds": sleep}}} if hook == "ours" else hook
    container = {"name": "c", "image": "reg/app:v1", **({"lifecycle": lifecycle} if lifecycle else {})}
    m: dict[str, Any] = {
        "name": "web-0",
        "namespace": "ns",
        "uid": "u1",
        "labels": {"app": "web"},
        "annotations": {K.ANN_RESUME_POLICY: "p"} if protected else {},
        "ownerReferences": [{"kind": "StatefulSet", "name": "web", "controller": True, "apiVersion": "apps/v1"}],
        **meta,
    }
    if deleted_ago is not None:
        m["deletionTimestamp"] = iso(NOW - deleted_ago + grace)
        m["deletionGracePeriodSeconds"] = grace
    return {
        "metadata": m,
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": grace, "containers": [container]},
        "status": {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]},
    }


def decide(p: dict[str, Any], already: bool = False) -> F.Decision:
    return F.decide(p, node=NODE, now=NOW, already=already)


def test_the_hook_leaves_a_margin_for_sigterm_and_short_grace_periods_get_none() -> None:
    assert F.hook_sleep_s(None) == 24  # the default 30 s: 6 s left for SIGTERM
    assert F.hook_sleep_s(30) == 24 and F.hook_sleep_s(5) == 4 and F.hook_sleep_s(120) == 110
    assert F.hook_sleep_s(600) == 590  # the margin is at most 10 s
    assert F.hook_sleep_s(4) is None and F.hook_sleep_s(1) is None and F.hook_sleep_s(0) is None


def test_a_terminating_protected_pod_gets_a_final_save_with_the_hook_window() -> None:
    d = decide(pod())
    assert d.save and not d.reason and 22 <= d.window_s <= 24


def test_who_gets_no_final_save_and_silently() -> None:
    assert decide(pod(deleted_ago=None)) == F.Decision(False)  # not terminating
    assert decide(pod(protected=False)) == F.Decision(False)  # unprotected: never touched
    assert decide(pod(), already=True) == F.Decision(False)  # one final save per pod
    other = pod()
    other["spec"]["nodeName"] = "n2"
    assert decide(other) == F.Decision(False)  # another node's agent decides
    forced = pod()
    forced["metadata"]["deletionGracePeriodSeconds"] = 0  # a stop save deleting it, or a forced delete
    assert decide(forced) == F.Decision(False)
    exited = pod()
    exited["status"]["containerStatuses"][0]["state"] = {"terminated": {}}
    assert decide(exited) == F.Decision(False)


def test_an_own_prestop_hook_is_kept_and_means_no_final_save_with_an_event() -> None:
    d = decide(pod(hook={"preStop": {"exec": {"command": ["drain-me"]}}}))
    assert not d.save and d.event and "own preStop hook" in d.reason and "last periodic save" in d.reason
    d = decide(pod(hook=None))  # grace under 5 s when admitted, or admitted before the hook existed
    assert not d.save and d.event and "no preStop sleep hook" in d.reason


def test_too_late_when_the_hook_is_about_to_end() -> None:
    d = decide(pod(deleted_ago=23.0))  # the 24 s hook ends in 1 s
    assert not d.save and d.event and "only 1s were left before SIGTERM" in d.reason


def test_a_shorter_grace_period_at_deletion_cuts_the_window() -> None:
    p = pod(deleted_ago=1.0)
    p["metadata"]["deletionGracePeriodSeconds"] = 10  # drain --grace-period=10 on a pod of 30 s
    p["metadata"]["deletionTimestamp"] = iso(NOW - 1.0 + 10)
    d = decide(p)
    assert d.save and 8 <= d.window_s <= 9  # the kubelet ends the 24 s hook at the 10 s deadline


def test_a_final_saves_thaw_by_is_a_second_before_the_hook_ends() -> None:
    """Issue 43: the deadline a final save is scheduled by and thawed at (core/saveorder.py)."""
    assert F.thaw_by(pod(deleted_ago=1.0)) == NOW - 1.0 + 24 - F.THAW_MARGIN_S
    p = pod(deleted_ago=1.0)
    p["metadata"]["deletionGracePeriodSeconds"] = 10  # drain --grace-period=10 cuts the 24 s hook short
    p["metadata"]["deletionTimestamp"] = iso(NOW - 1.0 + 10)
    assert F.thaw_by(p) == NOW - 1.0 + 10 - F.THAW_MARGIN_S
    assert F.thaw_by(pod(deleted_ago=None)) is None  # not terminating
    assert F.thaw_by(pod(hook=None)) is None  # no hook: no final save


def test_the_event_when_the_final_save_did_not_finish() -> None:
    text = F.late_message("web-0-x", 30, "CRIU: process gone", "web-0-periodic")
    assert "final save web-0-x did not finish within the pod's terminationGracePeriodSeconds (30s)" in text
    assert "CRIU: process gone" in text and "the last periodic save web-0-periodic stands" in text
    assert "Hint: raise terminationGracePeriodSeconds" in text
    assert "it starts fresh" in F.late_message("x", 30, "why", None)


def test_admission_adds_the_hook_only_where_no_container_has_its_own() -> None:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("reg.example/a@sha256:" + "c" * 64)}
    spec = objs[("MutatingAdmissionPolicy", resume.MUTATING_POLICY)]["spec"]
    *_, hook = spec["mutations"]
    expr = hook["applyConfiguration"]["expression"]
    assert hook["patchType"] == "ApplyConfiguration"
    assert expr.startswith(resume.HOOK_CONDITION_CEL + " ? ") and expr.endswith(": Object{}")
    assert "!has(c.lifecycle.preStop)" in resume.HOOK_CONDITION_CEL and f">= {F.MIN_GRACE_S}" in expr
    assert "preStop.sleep{seconds: variables.hookSleep}" in expr and "{{" not in expr and "}}" not in expr
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert f": {F.DEFAULT_GRACE_S}" in variables["grace"]
    assert "variables.grace / 5" in variables["hookSleep"] and f"{F.MAX_MARGIN_S}" in variables["hookSleep"]


def test_the_agent_may_create_a_stop_save_only_as_a_final_save() -> None:
    from kubectl_snapshot.deploy import admission

    p = {(o["kind"], o["metadata"]["name"]): o for o in render("reg.example/a@sha256:" + "c" * 64)}
    spec = p[("ValidatingAdmissionPolicy", admission.SNAPSHOT_POLICY)]["spec"]
    [var] = [v for v in spec["variables"] if v["name"] == "policySave"]
    assert "!object.spec.stop" in var["expression"] and K.LABEL_FINAL_SAVE in var["expression"]


# --- the replacement waits for a terminating predecessor (core/resume.py) ---------------------------


def test_a_deployment_replacement_waits_while_a_protected_predecessor_terminates() -> None:
    dep = W.Workload("Deployment", "web")
    new = {"metadata": {"name": "web-b", "uid": "new"}, "spec": {}}
    old = {"metadata": {"name": "web-a", "uid": "old", "deletionTimestamp": iso(NOW)}}
    periodic = {
        "metadata": {"name": "web-a-1", "labels": {K.LABEL_POD_UID: "old"}},
        "status": {"phase": K.PHASE_SUCCEEDED, "completionTime": iso(NOW - 60)},
    }
    c = R.choose(dep, new, [periodic], running_pod_uids=set(), terminating=[old])
    assert c.wait and "terminating" in c.reason  # not the periodic save: the final one may come
    assert R.choose(dep, new, [periodic], running_pod_uids=set(), terminating=[old], wait_for_running=False).save
    # a predecessor on a dead node never finishes terminating by itself (docs/node-loss.md): not waited for
    on_dead = {**old, "spec": {"nodeName": "n1"}}
    c = R.choose(dep, new, [periodic], running_pod_uids=set(), terminating=[on_dead], down_nodes={"n1"})
    assert not c.wait and c.save is not None
    assert R.choose(dep, new, [periodic], running_pod_uids=set(), terminating=[on_dead], down_nodes={"n2"}).wait
    # a StatefulSet's replacement has the same name only once its predecessor is gone; a Job's by index
    assert not R.predecessor(W.Workload("StatefulSet", "web"), new, old)
    job_new = {"metadata": {"uid": "n", "annotations": {W.COMPLETION_INDEX_KEY: "1"}}}
    job_old = {"metadata": {"uid": "o", "annotations": {W.COMPLETION_INDEX_KEY: "1"}}}
    job_other = {"metadata": {"uid": "x", "annotations": {W.COMPLETION_INDEX_KEY: "2"}}}
    assert R.predecessor(W.Workload("Job", "j"), job_new, job_old)
    assert not R.predecessor(W.Workload("Job", "j"), job_new, job_other)


# --- the agent (shim/controller/finalsave.py) over a fake Kubernetes port ---------------------------


class FakeKube:
    def __init__(self) -> None:
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str, str]] = []

    def list_snapshots(self, ns: str, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in (label_selector or "").split(",") if kv)
        return [s for s in self.snapshots.values() if all(s["metadata"]["labels"].get(k) == v for k, v in want.items())]

    def create_snapshot(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        body["metadata"]["creationTimestamp"] = iso(NOW)
        self.snapshots[body["metadata"]["name"]] = body
        return body

    def get_snapshot(self, ns: str, name: str) -> dict[str, Any]:
        return self.snapshots[name]

    def create_event(self, ns: str, *, involved: dict[str, Any], reason: str, message: str, type: str) -> None:
        self.events.append((involved.get("kind", "Pod"), reason, message, type))


POLICY = {
    "metadata": {"name": "p", "namespace": "ns"},
    "spec": {"destination": "reg.example/saves/web", "selector": {"matchLabels": {"app": "web"}}, "interval": "10m"},
}


def saver(kube: FakeKube) -> FinalSaver:
    return FinalSaver(
        kube,
        NODE,
        policy_of=lambda ns, name: POLICY if (ns, name) == ("ns", "p") else None,
        workload_of=lambda p: W.Workload("StatefulSet", "web"),
        clock=lambda: NOW,
    )


def test_the_agent_creates_one_stop_save_labelled_final_and_reports_its_end() -> None:
    kube = FakeKube()
    s = saver(kube)
    p = pod()
    s.pod_changed(p)
    s.pod_changed(p)  # the informer's next update of the same pod: still one save
    [final] = kube.snapshots.values()
    assert final["spec"]["stop"] is True and final["spec"]["destination"].startswith("reg.example/saves/web:web-0-")
    labels = final["metadata"]["labels"]
    assert labels[K.LABEL_FINAL_SAVE] == "true" and labels[K.LABEL_POD_UID] == "u1" and labels[K.LABEL_POLICY] == "p"
    assert labels[K.LABEL_WORKLOAD_KIND] == "StatefulSet"
    assert [e[1] for e in kube.events] == [K.EVENT_FINAL_SAVE]
    s.poll()  # still running: nothing said
    assert len(kube.events) == 1
    final["status"] = {"phase": K.PHASE_SUCCEEDED, "reference": "reg.example/saves/web@sha256:" + "d" * 64}
    s.poll()
    assert kube.events[-1][1] == K.EVENT_FINAL_SAVE and "replacement resumes from this save" in kube.events[-1][2]
    s.poll()
    assert len(kube.events) == 2  # reported once


def test_a_failed_final_save_says_the_last_periodic_save_stands_on_the_pod_and_the_policy() -> None:
    kube = FakeKube()
    kube.snapshots["web-0-periodic"] = {
        "metadata": {"name": "web-0-periodic", "labels": {K.LABEL_POD_UID: "u1", K.LABEL_POLICY: "p"}},
        "status": {"phase": K.PHASE_SUCCEEDED, "completionTime": iso(NOW - 300)},
    }
    s = saver(kube)
    s.pod_changed(pod())
    [final] = [v for k, v in kube.snapshots.items() if k != "web-0-periodic"]
    final["status"] = {"phase": K.PHASE_FAILED, "message": "container 'c' exited during the dump"}
    s.poll()
    failed = [e for e in kube.events if e[1] == K.EVENT_FINAL_SAVE_FAILED]
    assert {e[0] for e in failed} == {"Pod", K.POLICY_KIND} and all(e[3] == "Warning" for e in failed)
    assert all("the last periodic save web-0-periodic stands" in e[2] for e in failed)


def test_the_agent_leaves_unprotected_pods_alone_and_explains_an_own_hook() -> None:
    kube = FakeKube()
    s = saver(kube)
    s.pod_changed(pod(protected=False))
    assert not kube.snapshots and not kube.events
    s.pod_changed(pod(uid="u2", hook={"preStop": {"httpGet": {"path": "/quit", "port": 80}}}))
    assert not kube.snapshots and [e[1] for e in kube.events] == [K.EVENT_FINAL_SAVE_FAILED]


def test_a_restarted_agent_does_not_take_a_second_final_save() -> None:
    kube = FakeKube()
    saver(kube).pod_changed(pod())
    saver(kube).pod_changed(pod())  # a new agent process: it finds the first by its labels
    assert len(kube.snapshots) == 1
