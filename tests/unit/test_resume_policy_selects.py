"""A resume annotation names a policy; the agent resumes or final-saves a pod only when that policy
really selects it (issue 42, item 3).

Anyone who may create Deployments can put ``kubectl-snapshot.io/resume-policy: <a policy of the
namespace>`` into a template: the pods come from a kube-system controller, so the annotation passed
admission as if the resume mutation had set it. Each case here comes as a pair: the pod the policy
selects (its labels, its workload read from its real owners) resumes or gets its final save, and the
template-forged pod whose labels the policy does not select is refused, for that reason, without
being held down. The real API server's side is tests/e2e/test_autosave_resume.py::
test_a_forged_resume_annotation_in_a_template_is_refused_and_the_pod_runs_fresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import HostFacts
from shim.controller.finalsave import FinalSaver
from shim.controller.restores import RestoreWorker
from shim.controller.resume_source import RestoreSource, Resumer, StartFresh
from shim.controller.settings import NodeSettings
from shim.engine.staging import wait_pod_staged
from tests.support.fakekube import EventRecorder, RecordedEvent

NODE = "n1"
NOW = 1_800_000_000.0
IMAGES = W.encode_images([{"name": "c", "image": "reg/app:v1", "imageID": "sha256:" + "a" * 64}])
POLICY = {
    "metadata": {"name": "web-saves", "namespace": "ns"},
    "spec": {
        "selector": {"matchLabels": {"app": "web"}},
        "workload": {"kind": "Deployment", "name": "web"},
        "destination": "reg.example/saves/web",
        "registrySecret": "web-push",
        "interval": "10m",
        "resume": True,
    },
}
NOT_SELECTED = "SnapshotPolicy web-saves does not select the pod: its labels lack app=web"


def deployment_pod(deployment: str, uid: str, labels: dict[str, str], **meta: Any) -> dict[str, Any]:
    """A pod as a Deployment's ReplicaSet creates it, carrying the resume annotation (set by the
    mutation for the legitimate pod, written into the template for the forged one)."""
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"{deployment}-7d9f-{uid}",
            "namespace": "ns",
            "uid": uid,
            "labels": {**labels, "pod-template-hash": "7d9f"},
            "annotations": {K.ANN_RESUME_POLICY: "web-saves"},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{deployment}-7d9f", "controller": True}
            ],
            **meta,
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "reg/app:v1"}]},
        "status": {},
    }


LEGIT = deployment_pod("web", "new-web", {"app": "web"})
FORGED = deployment_pod("evil", "new-evil", {"app": "evil"})


@dataclass
class Cluster(EventRecorder):
    """The API objects the agent reads: the policy, the ReplicaSets' real owners, one save of a gone
    web pod; what it writes: claims, saves, Events, pod annotations."""

    saves: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {
                "metadata": {
                    "name": "web-old-1",
                    "resourceVersion": "1",
                    "labels": {
                        K.LABEL_POD_UID: "old-web",
                        K.LABEL_WORKLOAD_KIND: "Deployment",
                        K.LABEL_WORKLOAD_NAME: "web",
                    },
                    "annotations": {K.ANN_POD_IMAGES: IMAGES},
                },
                "status": {
                    "phase": K.PHASE_SUCCEEDED,
                    "completionTime": "2026-01-01T00:00:05Z",
                    "reference": f"reg.example/saves/web@sha256:{'b' * 64}",
                },
            }
        ]
    )
    events: list[RecordedEvent] = field(default_factory=list)
    claims: list[tuple[str, str | None]] = field(default_factory=list)
    created: list[dict[str, Any]] = field(default_factory=list)
    pod_annotations: list[dict[str, str | None]] = field(default_factory=list)

    def get_policy(self, ns: str, name: str) -> dict[str, Any]:
        if (ns, name) != ("ns", "web-saves"):
            raise NotFound(f"snapshotpolicy {ns}/{name}")
        return POLICY

    def get_replicaset(self, ns: str, name: str) -> dict[str, Any] | None:
        deployment = name.rsplit("-", 1)[0]
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment, "controller": True}
        return {"metadata": {"name": name, "namespace": ns, "ownerReferences": [owner]}}

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        want = dict(kv.split("=", 1) for kv in (label_selector or "").split(",") if kv)
        return [s for s in self.saves if all(s["metadata"]["labels"].get(k) == v for k, v in want.items())]

    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        return []

    def patch_snapshot_metadata(self, ns: str, name: str, **kw: Any) -> dict[str, Any]:
        self.claims.append((name, (kw.get("annotations") or {}).get(K.ANN_CLAIMED_BY)))
        return {}

    def create_snapshot(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        self.created.append(body)
        return body

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> dict[str, Any]:
        self.pod_annotations.append(annotations)
        return {}


def real_workload(kube: Cluster, pod: dict[str, Any]) -> W.Workload:
    return W.workload_of(pod, lambda rs: kube.get_replicaset(str(pod["metadata"]["namespace"]), rs))


# --- the decision (core/autosave.py) -----------------------------------------------------------------


def test_the_named_policy_must_select_the_pod_by_its_labels_and_real_workload() -> None:
    kube = Cluster()
    assert A.why_not_selected(POLICY, LEGIT, real_workload(kube, LEGIT)) == ""
    assert A.why_not_selected(POLICY, FORGED, real_workload(kube, FORGED)) == NOT_SELECTED
    # the labels copied too: the policy's workload still says whose pod it is
    copied = deployment_pod("evil", "new-evil", {"app": "web"})
    assert A.why_not_selected(POLICY, copied, real_workload(kube, copied)) == (
        "SnapshotPolicy web-saves protects Deployment web, the pod belongs to Deployment evil"
    )
    other_ns = dict(LEGIT, metadata=dict(LEGIT["metadata"], namespace="other"))
    elsewhere = A.why_not_selected(POLICY, other_ns, W.Workload("Deployment", "web"))
    assert elsewhere == "SnapshotPolicy web-saves is of namespace ns, the pod of other"


# --- resume (shim/controller/resume_source.py, shim/controller/restores.py) --------------------------------


def test_the_selected_pod_resumes_from_its_workloads_save() -> None:
    kube = Cluster()
    got = Resumer(kube, sleep=lambda _s: None).source(LEGIT)
    assert isinstance(got, RestoreSource) and got.resume and got.registry_secret == "web-push"
    assert kube.claims == [("web-old-1", "new-web")]


def test_a_template_forged_pod_the_policy_does_not_select_starts_fresh_for_that_reason() -> None:
    kube = Cluster()
    got = Resumer(kube, sleep=lambda _s: None).source(FORGED)
    assert got == StartFresh(NOT_SELECTED)
    assert kube.claims == []  # no save claimed, the policy's Secret never named for it


def test_the_forged_pods_containers_are_let_go_fresh_with_a_resume_skipped_event(tmp_path: Path) -> None:
    """The refusal does not hold the workload down: the containers waiting at their create are answered
    at once (no restore), and the Event says why."""
    kube = Cluster()
    settings = NodeSettings(node=NODE, state_root=str(tmp_path / "state"), kubelet_root=str(tmp_path / "k"))
    worker = RestoreWorker(kube=kube, settings=settings, facts=HostFacts())
    assert worker.run(FORGED)
    assert wait_pod_staged(worker.paths, "new-evil", "c", expected=True, timeout_s=1) is None  # created as runc would
    skipped = RecordedEvent("Pod", K.EVENT_RESUME_SKIPPED, f"the pod starts fresh: {NOT_SELECTED}", "Normal")
    assert kube.events == [skipped]
    assert kube.pod_annotations[-1][K.ANN_RESTORE_STATUS] == K.RESTORE_SKIPPED_PREFIX + NOT_SELECTED
    assert kube.claims == []


# --- final save (shim/controller/finalsave.py) ------------------------------------------------------


def terminating(pod: dict[str, Any]) -> dict[str, Any]:
    meta = dict(pod["metadata"], deletionTimestamp="2027-01-15T08:00:29Z", deletionGracePeriodSeconds=30)
    container = {"name": "c", "image": "reg/app:v1", "lifecycle": {"preStop": {"sleep": {"seconds": 24}}}}
    status = {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}]}
    return dict(pod, metadata=meta, spec=dict(pod["spec"], containers=[container]), status=status)


def saver(kube: Cluster) -> FinalSaver:
    return FinalSaver(
        kube,
        NODE,
        policy_of=lambda ns, name: POLICY if (ns, name) == ("ns", "web-saves") else None,
        workload_of=lambda pod: real_workload(kube, pod),
        clock=lambda: 1_800_000_000.0,
    )


def test_the_selected_pod_gets_its_final_save_into_the_policys_repository() -> None:
    kube = Cluster(saves=[])
    saver(kube).pod_changed(terminating(LEGIT))
    [save] = kube.created
    assert save["spec"]["destination"].startswith("reg.example/saves/web:") and save["spec"]["stop"] is True
    assert save["metadata"]["labels"][K.LABEL_WORKLOAD_NAME] == "web"
    assert [e.reason for e in kube.events] == [K.EVENT_FINAL_SAVE]


def test_a_template_forged_pod_gets_no_final_save_and_the_event_says_why() -> None:
    kube = Cluster(saves=[])
    saver(kube).pod_changed(terminating(FORGED))
    assert kube.created == []
    assert kube.events == [RecordedEvent("Pod", K.EVENT_FINAL_SAVE_FAILED, f"no final save: {NOT_SELECTED}", "Warning")]
