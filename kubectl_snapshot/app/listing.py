"""`kubectl snapshot list`: PodSnapshots as rows (the same columns as the CRD's printer columns)."""

from __future__ import annotations

import datetime
from typing import Any

from kubectl_snapshot.app.ports import Kube, Obj
from kubectl_snapshot.core import timestamps as T


def list_rows(
    *,
    kube: Kube,
    namespace: str | None,
    label_selector: str | None = None,
    now: datetime.datetime | None = None,
) -> list[dict[str, Any]]:
    return [row for _obj, row in list_objects(kube=kube, namespace=namespace, label_selector=label_selector, now=now)]


def list_objects(
    *,
    kube: Kube,
    namespace: str | None,
    label_selector: str | None = None,
    now: datetime.datetime | None = None,
) -> list[tuple[Obj, dict[str, Any]]]:
    """(object, row) for each PodSnapshot, sorted by namespace, creation time and name."""
    items = kube.list_snapshots(namespace, label_selector=label_selector)
    now = now or T.now()
    pairs = [(obj, snapshot_row(obj, now)) for obj in items]
    return sorted(pairs, key=lambda p: (p[1]["namespace"], p[1]["created"], p[1]["name"]))


def snapshot_row(obj: Obj, now: datetime.datetime) -> dict[str, Any]:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    created = str(meta.get("creationTimestamp") or "")
    return {
        "namespace": str(meta.get("namespace") or ""),
        "name": str(meta.get("name") or ""),
        "pod": str(spec.get("podName") or ""),
        "phase": str(status.get("phase") or "Pending"),
        "node": str(status.get("node") or ""),
        "size": int(status.get("size") or 0),
        "reference": str(status.get("reference") or ""),
        "created": created,
        "age": age(created, now),
        "message": str(status.get("message") or ""),
        "stage": str(status.get("stage") or ""),
        "destination": str(spec.get("destination") or ""),
    }


def age(created: str, now: datetime.datetime) -> str:
    """kubectl-style age: 45s, 12m, 3h, 5d."""
    then = T.parse(created)
    if then is None:
        return "-"
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"
