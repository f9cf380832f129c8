"""Events on the pod an agent works for: what users see in `kubectl describe pod`."""

from __future__ import annotations

import logging
from typing import Any

from kubectl_snapshot.core.errors import SnapshotError

log = logging.getLogger(__name__)


def pod_event(kube: Any, pod: dict[str, Any], reason: str, message: str, *, warning: bool = False) -> None:
    """Record an Event; failing to record one never fails the work it reports on."""
    try:
        kube.create_event(
            pod["metadata"]["namespace"],
            involved=pod,
            reason=reason,
            message=message[:1000],
            type="Warning" if warning else "Normal",
        )
    except SnapshotError:
        log.warning("could not record event %s on %s", reason, pod["metadata"]["name"])
