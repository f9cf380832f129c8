"""Which workload a pod belongs to, and the provenance labels a save of it carries (pure).

The agent writes these labels on every PodSnapshot it claims, from the real pod (docs/kubernetes.md,
"The SnapshotPolicy resource"), and reads them back when a new pod of the same workload resumes:

- a pod owned (controller ownerReference) by a StatefulSet or a Job: that workload;
- by a ReplicaSet: the ReplicaSet's own controller when it is a Deployment, else the ReplicaSet;
- no controller: kind ``Pod``, the pod's own name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K

LABEL_VALUE_MAX = 63
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
# A ReplicaSet by name, None when it is gone (the adapter's GET).
GetReplicaSet = Callable[[str], Mapping[str, Any] | None]


@dataclass(frozen=True)
class Workload:
    kind: str  # StatefulSet | Deployment | ReplicaSet | Job | Pod
    name: str


def controller_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The controller ownerReference of an object (at most one has controller: true)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def workload_of(pod: Mapping[str, Any], get_replicaset: GetReplicaSet) -> Workload:
    meta = pod.get("metadata") or {}
    ref = controller_of(pod)
    if ref is None:
        return Workload("Pod", str(meta.get("name") or ""))
    kind, name = str(ref.get("kind") or ""), str(ref.get("name") or "")
    if kind == "ReplicaSet" and str(ref.get("apiVersion") or "").startswith("apps/"):
        rs = get_replicaset(name)
        owner = controller_of(rs) if rs is not None else None
        if owner is not None and owner.get("kind") == "Deployment" and str(owner.get("apiVersion")).startswith("apps/"):
            return Workload("Deployment", str(owner.get("name") or ""))
        return Workload("ReplicaSet", name)
    if kind in ("StatefulSet", "Job"):
        return Workload(kind, name)
    return Workload(kind or "Pod", name)  # another controller: recorded as it is, never resumed by kind


def completion_index(pod: Mapping[str, Any]) -> str | None:
    """An indexed Job pod's completion index (annotation, or the label newer versions also set)."""
    meta = pod.get("metadata") or {}
    for source in (meta.get("annotations") or {}, meta.get("labels") or {}):
        value = source.get(COMPLETION_INDEX_KEY)
        if value is not None and str(value).isdigit():
            return str(value)
    return None


def label_value(text: str) -> str | None:
    """`text` if it is a valid label value, else None (never a shortened value: names must match exactly)."""
    ok = len(text) <= LABEL_VALUE_MAX and all(c.isalnum() or c in "-_." for c in text)
    return text if ok and (not text or (text[0].isalnum() and text[-1].isalnum())) else None


def provenance_labels(pod: Mapping[str, Any], workload: Workload) -> dict[str, str | None]:
    """The labels the agent writes on a PodSnapshot of `pod` (None removes a key: a tenant's own
    value must not survive where the real pod has none)."""
    meta = pod.get("metadata") or {}
    index = completion_index(pod) if workload.kind == "Job" else None
    return {
        K.LABEL_POD: label_value(str(meta.get("name") or "")),
        K.LABEL_POD_UID: label_value(str(meta.get("uid") or "")),
        K.LABEL_WORKLOAD_KIND: label_value(workload.kind),
        K.LABEL_WORKLOAD_NAME: label_value(workload.name),
        K.LABEL_COMPLETION_INDEX: index,
    }


def pod_images(pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """Each app container's image as the spec says and the digest the kubelet ran (imageID)."""
    ids = {
        cs.get("name"): str(cs.get("imageID") or "") for cs in (pod.get("status") or {}).get("containerStatuses") or []
    }
    out = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        image_id = ids.get(c.get("name"), "").split("://", 1)[-1]
        digest = image_id.split("@", 1)[1] if "@sha256:" in image_id else ""
        out.append({"name": str(c.get("name") or ""), "image": str(c.get("image") or ""), "imageID": digest})
    return out


def encode_images(images: list[dict[str, str]]) -> str:
    return json.dumps(images, sort_keys=True, separators=(",", ":"))


def decode_images(text: str | None) -> list[dict[str, str]] | None:
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        return None
    return [{k: str(v.get(k) or "") for k in ("name", "image", "imageID")} for v in value]


def image_mismatch(saved: list[dict[str, str]] | None, pod: Mapping[str, Any]) -> str:
    """Why the new pod's containers cannot resume from a save of `saved` images ('' when they can).

    Compared: the container names and each image as the pod spec writes it; where the new pod pins
    its image by digest, that digest against the one the saved pod ran. A tag that was moved to
    another digest meanwhile is caught later by the runtime wrapper's image check (the restore then
    fails with that reason instead of starting fresh)."""
    if saved is None:
        return "the save records no container images (taken before resume existed)"
    new = {str(c.get("name")): str(c.get("image") or "") for c in (pod.get("spec") or {}).get("containers") or []}
    old = {c["name"]: c for c in saved}
    if set(new) != set(old):
        return f"containers differ: saved {sorted(old)}, new pod {sorted(new)}"
    for name in sorted(new):
        image, was = new[name], old[name]
        if "@sha256:" in image:
            if image.split("@", 1)[1] != was["imageID"] and image != was["image"]:
                return (
                    f"container {name}: image {image} is not the saved {was['image']} ({was['imageID'] or 'no digest'})"
                )
        elif image != was["image"]:
            return f"container {name}: image {image}, the save ran {was['image']}"
    return ""
