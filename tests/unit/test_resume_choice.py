"""Which save a resuming pod takes (core/resume.py) and how the agent claims it (shim/controller/resume_source.py).

The pure choice over dicts; the claim over a fake of the Kubernetes port that enforces resourceVersion
like the API server. The real flow is tests/e2e/test_autosave_resume.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import resume as R
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound
from shim.controller.resume_source import RestoreSource, Resumer, StartFresh
from tests.support.fakekube import StrictKube

IMAGES = W.encode_images([{"name": "c", "image": "reg/app:v1", "imageID": "sha256:" + "a" * 64}])


def save(name: str, pod_uid: str, done: str, *, phase: str = K.PHASE_SUCCEEDED, **ann: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "resourceVersion": "1",
            "labels": {K.LABEL_POD_UID: pod_uid},
            "annotations": {K.ANN_POD_IMAGES: IMAGES, **ann},
        },
        "status": {"phase": phase, "completionTime": done, "reference": f"reg/s@sha256:{'b' * 64}"},
    }


def new_pod(uid: str = "new", name: str = "web-0", image: str = "reg/app:v1", **ann: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid,
            "labels": {"app": "web"},
            "annotations": {K.ANN_RESUME_POLICY: "p", **ann},
        },
        "spec": {"containers": [{"name": "c", "image": image}]},
    }


def policy(**spec: Any) -> dict[str, Any]:
    """SnapshotPolicy p of namespace ns as the API server returns it: it selects app=web."""
    return {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "resume": True, **spec},
    }


STS = W.Workload("StatefulSet", "web")
DEP = W.Workload("Deployment", "web")


def test_selectors_name_the_identity() -> None:
    assert R.label_selector(STS, new_pod()) == (
        f"{K.LABEL_WORKLOAD_KIND}=StatefulSet,{K.LABEL_WORKLOAD_NAME}=web,{K.LABEL_POD}=web-0"
    )
    job = new_pod()
    job["metadata"]["annotations"][W.COMPLETION_INDEX_KEY] = "2"
    assert R.label_selector(W.Workload("Job", "j"), job).endswith(f"{K.LABEL_COMPLETION_INDEX}=2")  # type: ignore[union-attr]
    assert R.label_selector(W.Workload("Job", "j"), new_pod()) is None  # not indexed
    assert R.label_selector(W.Workload("Pod", "solo"), new_pod()) is None


def test_statefulset_takes_the_newest_good_save_and_waits_for_a_running_one() -> None:
    saves = [save("old", "u1", "2026-01-01T00:00:01Z"), save("new", "u2", "2026-01-01T00:00:09Z")]
    saves.append(save("bad", "u2", "2026-01-01T00:00:10Z", phase=K.PHASE_FAILED))
    assert R.choose(STS, new_pod(), saves, running_pod_uids=set()).save["metadata"]["name"] == "new"  # type: ignore[index]
    running = [*saves, save("now", "u2", "", phase=K.PHASE_RUNNING)]
    assert R.choose(STS, new_pod(), running, running_pod_uids=set()).wait
    assert not R.choose(STS, new_pod(), running, running_pod_uids=set(), wait_for_running=False).wait
    assert R.choose(STS, new_pod(), [], running_pod_uids=set()).reason.startswith("no good save of pod web-0")


def test_deployment_takes_one_unclaimed_gone_predecessor() -> None:
    saves = [
        save("a1", "ua", "2026-01-01T00:00:01Z"),
        save("a2", "ua", "2026-01-01T00:00:05Z"),
        save("b1", "ub", "2026-01-01T00:00:03Z"),
    ]
    first = R.choose(DEP, new_pod(), saves, running_pod_uids=set())
    assert first.claim and first.save["metadata"]["name"] == "a2"  # type: ignore[index]
    # a's saves are claimed (an older one carries the claim): b's newest is next
    saves[0]["metadata"]["annotations"][K.ANN_CLAIMED_BY] = "other"
    assert R.choose(DEP, new_pod(), saves, running_pod_uids=set()).save["metadata"]["name"] == "b1"  # type: ignore[index]
    # a predecessor that still runs is nobody's predecessor
    assert R.choose(DEP, new_pod(), saves, running_pod_uids={"ub"}).reason.startswith("every predecessor")
    # a running save of a predecessor that still runs is not waited for
    busy = [*saves[1:], save("c", "uc", "", phase=K.PHASE_RUNNING)]
    assert not R.choose(DEP, new_pod(), busy, running_pod_uids={"uc"}).wait


@dataclass
class FakeKube(StrictKube):
    saves: list[dict[str, Any]]
    policy: dict[str, Any] = field(default_factory=lambda: policy(registrySecret="s"))
    claims: list[tuple[str, str | None]] = field(default_factory=list)
    steal_first: bool = False

    def get_policy(self, ns: str, name: str) -> dict[str, Any]:
        if name != "p":
            raise NotFound("no policy")
        return self.policy

    def get_replicaset(self, ns: str, name: str) -> dict[str, Any] | None:
        return {
            "metadata": {
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "controller": True}]
            }
        }

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return [
            dict(s, metadata=dict(s["metadata"], annotations=dict(s["metadata"]["annotations"]))) for s in self.saves
        ]

    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        return []

    def patch_snapshot_metadata(
        self,
        ns: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        stored = next(s for s in self.saves if s["metadata"]["name"] == name)
        if self.steal_first:  # another new pod claimed it between our read and our write
            self.steal_first = False
            stored["metadata"]["annotations"][K.ANN_CLAIMED_BY] = "thief"
            stored["metadata"]["resourceVersion"] = "2"
        if resource_version != stored["metadata"]["resourceVersion"]:
            raise FailedPrecondition("conflict", retryable=True)
        assert annotations is not None
        stored["metadata"]["annotations"].update(annotations)
        self.claims.append((name, annotations[K.ANN_CLAIMED_BY]))
        return stored


def rs_pod(uid: str, image: str = "reg/app:v1") -> dict[str, Any]:
    pod = new_pod(uid, name=f"web-x-{uid}", image=image)
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-x", "controller": True}
    ]
    return pod


def test_two_new_pods_claim_distinct_saves_even_when_they_race() -> None:
    kube = FakeKube(
        [save("a1", "ua", "2026-01-01T00:00:05Z"), save("b1", "ub", "2026-01-01T00:00:03Z")], steal_first=True
    )
    r = Resumer(kube, sleep=lambda _s: None)
    got = r.source(rs_pod("p1"))
    assert isinstance(got, RestoreSource) and got.resume and got.registry_secret == "s"
    assert kube.claims == [("b1", "p1")]  # a1 was taken by the thief: the 409 made it pick again
    assert isinstance(r.source(rs_pod("p2")), StartFresh)  # nothing left


@pytest.mark.parametrize(
    ("spec", "lazy"),
    [({}, False), ({"restoreMode": "eager"}, False), ({"restoreMode": "lazy"}, True)],
)
def test_the_policys_restore_mode_decides_whether_the_resume_is_lazy(spec: dict[str, str], lazy: bool) -> None:
    """docs/lazy-restore.md: spec.restoreMode lazy resumes lazily; eager (the CRD's default) and a policy
    written before the field existed resume as always, every page staged first."""
    kube = FakeKube([save("a1", "ua", "2026-01-01T00:00:05Z")], policy=policy(**spec))
    got = Resumer(kube, sleep=lambda _s: None).source(rs_pod("p1"))
    assert isinstance(got, RestoreSource) and got.resume and got.lazy is lazy


def test_other_images_or_no_policy_start_fresh() -> None:
    kube = FakeKube([save("a1", "ua", "2026-01-01T00:00:05Z")])
    r = Resumer(kube, sleep=lambda _s: None)
    fresh = r.source(rs_pod("p1", image="reg/app:v2"))
    assert isinstance(fresh, StartFresh) and "reg/app:v2" in fresh.reason and kube.claims == []
    gone = new_pod("p3", policy="x")
    gone["metadata"]["annotations"][K.ANN_RESUME_POLICY] = "gone"
    assert "is gone" in r.source(gone).reason  # type: ignore[union-attr]
    kube.policy = policy(workload={"kind": "StatefulSet", "name": "db"})
    assert "protects StatefulSet db, the pod belongs to Deployment web" in r.source(rs_pod("p4")).reason  # type: ignore[union-attr]


def node(name: str, ready: str = "True", *taints: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"taints": [{"key": t, "effect": "NoExecute"} for t in taints]},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


def test_a_save_cut_off_by_a_dead_node_is_not_waited_for() -> None:
    """docs/node-loss.md: the node taking a save died mid-save; its PodSnapshot stays Running forever."""
    assert not R.node_down(node("n1"))
    assert R.node_down(node("n1", "Unknown")) and R.node_down(node("n1", "False")) and R.node_down(None)
    assert R.node_down(node("n1", "True", R.OUT_OF_SERVICE_TAINT))
    assert R.node_down({"metadata": {"name": "n1"}})  # no Ready condition yet
    cut = save("cut", "u2", "", phase=K.PHASE_RUNNING)
    cut["status"]["node"] = "n1"
    saves = [save("good", "u2", "2026-01-01T00:00:09Z"), cut]
    assert R.choose(STS, new_pod(), saves, running_pod_uids=set()).wait  # n1 not known down: wait
    got = R.choose(STS, new_pod(), saves, running_pod_uids=set(), down_nodes={"n1"})
    assert not got.wait and got.save["metadata"]["name"] == "good"  # type: ignore[index]
    assert R.choose(STS, new_pod(), saves, running_pod_uids=set(), down_nodes={"n2"}).wait


def test_the_agent_reads_the_node_of_a_save_in_progress() -> None:
    cut = save("cut", "u2", "", phase=K.PHASE_RUNNING)
    cut["status"]["node"] = "n1"
    kube = FakeKube([save("good", "u2", "2026-01-01T00:00:09Z"), cut])
    kube.policy = policy()
    nodes: dict[str, dict[str, Any]] = {"n1": node("n1", "Unknown")}

    def get_node(name: str) -> dict[str, Any]:
        if name not in nodes:
            raise NotFound(f"node {name}")
        return nodes[name]

    kube.get_node = get_node  # type: ignore[method-assign]
    clock = iter(range(0, 10_000, 1))
    r = Resumer(kube, sleep=lambda _s: None, clock=lambda: float(next(clock)), wait_s=100)
    sts_pod = new_pod("p1")
    sts_pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "controller": True}
    ]
    got = r.source(sts_pod)
    assert isinstance(got, RestoreSource) and got.resume, got  # no wait: n1 is down
    nodes["n1"] = node("n1")  # back and Ready: its save will finish, so the pod waits (until wait_s)
    waited_from = next(clock)
    assert isinstance(r.source(sts_pod), RestoreSource) and next(clock) - waited_from > 100
    del nodes["n1"]  # deleted from the cluster: down
    assert isinstance(r.source(sts_pod), RestoreSource)
