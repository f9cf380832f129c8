"""Where a snapshot's blobs may be mounted from instead of uploaded: the repositories (on the same
registry) that earlier snapshots of the same pod went to. A registry mounts only what the pushing
credentials may pull, so a tenant gains no access through this; a repository without the blob answers
202 and the blob is uploaded as usual."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import SnapshotError
from kubectl_snapshot.core.reference import Reference
from shim.controller.kube_api import KubeApi

log = logging.getLogger(__name__)
MAX_SOURCES = 3


def mount_candidates(objs: Iterable[dict[str, Any]], target: Reference) -> list[Reference]:
    """Other repositories of target's registry holding Succeeded snapshots of the pod, newest first."""
    found: list[tuple[str, Reference]] = []
    for obj in objs:
        status = obj.get("status") or {}
        if status.get("phase") != K.PHASE_SUCCEEDED or not status.get("reference"):
            continue
        try:
            ref = Reference.parse(str(status["reference"]))
        except SnapshotError:
            continue
        if ref.registry == target.registry and ref.repository != target.repository:
            found.append((str((obj.get("metadata") or {}).get("creationTimestamp") or ""), ref))
    out: list[Reference] = []
    for _created, ref in sorted(found, key=lambda p: p[0], reverse=True):
        if all(r.repository != ref.repository for r in out):
            out.append(ref)
    return out[:MAX_SOURCES]


def previous_repositories(kube: KubeApi, namespace: str, pod: str, target: Reference) -> list[Reference]:
    """mount_candidates over the namespace's PodSnapshots of `pod`; nothing when they cannot be read."""
    try:
        objs = kube.list_snapshots(namespace, label_selector=f"{K.LABEL_POD}={pod}")
    except SnapshotError as e:
        log.info("cannot list earlier snapshots of %s/%s for blob mounts: %s", namespace, pod, e)
        return []
    return mount_candidates(objs, target)
