"""What the agent reads from a Pod object (API JSON as a dict): containers, emptyDirs, the record.

Pure functions over dicts, so the rules are unit-tested without a cluster.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import PodRecord


@dataclass(frozen=True)
class PodContainers:
    ids: list[str]  # containerd ids, in pod spec order
    names: list[str]


def running_containers(pod: dict[str, Any]) -> PodContainers:
    """The pod's app containers with their containerd ids; every one must be running."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    if status.get("phase") != "Running":
        raise FailedPrecondition(
            f"{where} is {status.get('phase') or 'not running'}, not Running",
            hint="only running pods can be snapshotted",
        )
    by_name = {cs.get("name"): cs for cs in status.get("containerStatuses") or []}
    ids, names = [], []
    for c in spec.get("containers") or []:
        cs = by_name.get(c["name"]) or {}
        cid = cs.get("containerID") or ""
        if "running" not in (cs.get("state") or {}) or "://" not in cid:
            raise FailedPrecondition(
                f"container {c['name']!r} of {where} is not running", hint="wait until every container runs"
            )
        runtime, _, bare = cid.partition("://")
        if runtime != "containerd":
            raise FailedPrecondition(
                f"{where} runs on {runtime}, not containerd", hint="kubectl-snapshot drives containerd nodes"
            )
        ids.append(bare)
        names.append(c["name"])
    if not ids:
        raise FailedPrecondition(f"{where} has no containers")
    return PodContainers(ids, names)


def empty_dir_path(kubelet_root: str, pod_uid: str, volume: str) -> str:
    return os.path.join(kubelet_root, "pods", pod_uid, "volumes", K.EMPTY_DIR_PLUGIN_DIR, volume)


def empty_dirs(pod: dict[str, Any], kubelet_root: str, *, skip: tuple[str, ...] = (K.GATE_VOLUME,)) -> dict[str, str]:
    """emptyDir volume name -> its directory on this node."""
    uid = pod["metadata"]["uid"]
    return {
        v["name"]: empty_dir_path(kubelet_root, uid, v["name"])
        for v in pod.get("spec", {}).get("volumes") or []
        if "emptyDir" in v and v["name"] not in skip
    }


def _strip_token_mounts(container: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    c = copy.deepcopy(container)
    mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") not in dropped]
    if mounts:
        c["volumeMounts"] = mounts
    else:
        c.pop("volumeMounts", None)
    return c


def record_pod(pod: dict[str, Any], node: str) -> PodRecord:
    """The sanitized pod spec the artifact keeps (docs/kubernetes.md): what `restore` recreates."""
    meta, spec, status = pod["metadata"], copy.deepcopy(pod.get("spec", {})), pod.get("status", {})
    image_ids = {cs.get("name"): cs.get("imageID") or "" for cs in status.get("containerStatuses") or []}
    dropped = {v["name"] for v in spec.get("volumes") or [] if v["name"].startswith(K.SA_TOKEN_VOLUME_PREFIX)}
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in dropped]
    if not spec["volumes"]:
        del spec["volumes"]
    containers = []
    for c in spec.get("containers") or []:
        c = _strip_token_mounts(c, dropped)
        pinned = _pinned_image(c.get("image", ""), image_ids.get(c["name"], ""))
        if pinned:
            c["image"] = pinned
        containers.append(c)
    spec["containers"] = containers
    for key in ("nodeName", "initContainers", "ephemeralContainers", "schedulingGates"):
        spec.pop(key, None)
    spec["metadata"] = {
        "labels": dict(meta.get("labels") or {}),
        "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(K.GROUP)},
    }
    return PodRecord(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""), node=node, spec=spec)


def _pinned_image(image: str, image_id: str) -> str:
    """`repo@sha256:...` for the image the kubelet actually ran (imageID may carry a scheme)."""
    ref = image_id.split("://", 1)[-1]
    if "@sha256:" not in ref:
        return ""
    digest = ref.split("@", 1)[1]
    repo = image.split("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
    return f"{repo}@{digest}"
