"""Events on the pod an agent works for and on the PodSnapshot itself: what users see in
`kubectl describe pod` and `kubectl describe podsnapshot`."""

from __future__ import annotations

import logging
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import SnapshotError
from shim.controller.kube_api import KubeApi

log = logging.getLogger(__name__)


def pod_event(kube: KubeApi, pod: dict[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """Record an Event on a pod; failing to record one never fails the work it reports on."""
    _event(kube, pod, reason, message, warning=warning)


def snapshot_event(kube: KubeApi, obj: dict[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """Record an Event on a PodSnapshot (its apiVersion/kind are set: the list API omits them)."""
    _event(kube, {"apiVersion": K.API_VERSION, "kind": K.KIND, **obj}, reason, message, warning=warning)


def policy_event(kube: KubeApi, obj: dict[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """Record an Event on a SnapshotPolicy (`kubectl describe snapshotpolicy`, `kubectl snapshot policy describe`)."""
    _event(kube, {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND, **obj}, reason, message, warning=warning)


def _event(kube: KubeApi, involved: dict[str, Any], reason: str, message: str, *, warning: bool) -> None:
    try:
        kube.create_event(
            involved["metadata"]["namespace"],
            involved=involved,
            reason=reason,
            message=message[:1000],
            type="Warning" if warning else "Normal",
        )
    except SnapshotError:
        log.warning("could not record event %s on %s", reason, involved["metadata"]["name"])
