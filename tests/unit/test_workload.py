"""Which workload a pod belongs to and the provenance a save of it records (core/workload.py)."""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import workload as W


def owned(kind: str, name: str, *, api: str = "apps/v1", **meta: Any) -> dict[str, Any]:
    ref = {"apiVersion": api, "kind": kind, "name": name, "controller": True, "uid": "x"}
    return {"metadata": {"name": "p-1", "uid": "u1", "ownerReferences": [ref], **meta}, "spec": {}}


def no_rs(_name: str) -> None:
    return None


def test_a_deployment_is_found_through_its_replicaset() -> None:
    rs = owned("Deployment", "web")
    assert W.workload_of(owned("ReplicaSet", "web-abc"), lambda n: rs if n == "web-abc" else None) == W.Workload(
        "Deployment", "web"
    )
    assert W.workload_of(owned("ReplicaSet", "web-abc"), no_rs) == W.Workload("ReplicaSet", "web-abc")


def test_statefulsets_jobs_and_bare_pods() -> None:
    assert W.workload_of(owned("StatefulSet", "db"), no_rs) == W.Workload("StatefulSet", "db")
    assert W.workload_of(owned("Job", "batch", api="batch/v1"), no_rs) == W.Workload("Job", "batch")
    assert W.workload_of({"metadata": {"name": "solo"}}, no_rs) == W.Workload("Pod", "solo")
    # a non-controller owner is not the workload
    pod = owned("StatefulSet", "db")
    pod["metadata"]["ownerReferences"][0]["controller"] = False
    assert W.workload_of(pod, no_rs) == W.Workload("Pod", "p-1")


def test_labels_come_from_the_pod_and_remove_what_does_not_apply() -> None:
    job = owned("Job", "batch", api="batch/v1", annotations={W.COMPLETION_INDEX_KEY: "3"})
    labels = W.provenance_labels(job, W.Workload("Job", "batch"))
    assert labels == {
        K.LABEL_POD: "p-1",
        K.LABEL_POD_UID: "u1",
        K.LABEL_WORKLOAD_KIND: "Job",
        K.LABEL_WORKLOAD_NAME: "batch",
        K.LABEL_COMPLETION_INDEX: "3",
    }
    # no index outside Jobs (a forged one is removed), no invalid label values (never shortened)
    sts = owned("StatefulSet", "db", annotations={W.COMPLETION_INDEX_KEY: "3"})
    labels = W.provenance_labels(sts, W.Workload("StatefulSet", "x" * 64))
    assert labels[K.LABEL_COMPLETION_INDEX] is None and labels[K.LABEL_WORKLOAD_NAME] is None


def test_images_are_recorded_and_compared() -> None:
    pod = {
        "spec": {"containers": [{"name": "app", "image": "reg/app:v1"}]},
        "status": {"containerStatuses": [{"name": "app", "imageID": "reg/app@sha256:" + "a" * 64}]},
    }
    saved = W.decode_images(W.encode_images(W.pod_images(pod)))
    assert saved == [{"name": "app", "image": "reg/app:v1", "imageID": "sha256:" + "a" * 64}]
    assert W.image_mismatch(saved, pod) == ""
    v2 = {"spec": {"containers": [{"name": "app", "image": "reg/app:v2"}]}}
    assert "reg/app:v2" in W.image_mismatch(saved, v2)
    pinned_same = {"spec": {"containers": [{"name": "app", "image": "reg/app@sha256:" + "a" * 64}]}}
    assert W.image_mismatch(saved, pinned_same) == ""
    pinned_other = {"spec": {"containers": [{"name": "app", "image": "reg/app@sha256:" + "b" * 64}]}}
    assert W.image_mismatch(saved, pinned_other)
    two = {"spec": {"containers": [{"name": "app", "image": "reg/app:v1"}, {"name": "side", "image": "s"}]}}
    assert "containers differ" in W.image_mismatch(saved, two)
    assert W.image_mismatch(None, pod) and W.decode_images("not json") is None
