"""`kubectl snapshot pod/NAME`: check the pod, create a PodSnapshot, follow its status to the end.

The plugin never talks to nodes: the agent on the pod's node claims the PodSnapshot (status.phase)
and reports progress in its status. If no agent claims it within `claim_timeout_s`, nobody is
listening for this node (agent not installed, not ready, or RBAC) and waiting longer would hang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kubectl_snapshot.app.ports import Kube, Obj
from kubectl_snapshot.app.watching import follow
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from kubectl_snapshot.core.podspec import (
    check_pod_running,
    destination,
    snapshot_name,
    snapshot_object,
    timestamp,
)
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.status import SnapshotStatus
from kubectl_snapshot.core.status import read as snapshot_status

StatusFn = Callable[[SnapshotStatus], None]
NAME_ATTEMPTS = 5  # names tried for one second (`<pod>-<stamp>`, then `-2` ... `-5`)


@dataclass(frozen=True)
class SnapshotRequest:
    namespace: str
    pod: str
    repository: str  # REGISTRY/REPO[:TAG]; without a tag the snapshot's timestamp is the tag
    registry_secret: str | None = None
    insecure: bool = False
    stop: bool = False
    include_volumes: bool = True
    ignore_liveness: bool = False
    now: datetime.datetime = field(default_factory=T.now)


def snapshot_body(req: SnapshotRequest, *, kube: Kube, attempt: int = 1) -> Obj:
    """Check the pod exists and runs; the PodSnapshot to create for it (`attempt` > 1: the name, and
    the default tag, carry `-N` because an earlier snapshot of the pod took that second's name)."""
    target: Reference = destination(req.repository, timestamp(req.now, attempt))
    try:
        pod = kube.get_pod(req.namespace, req.pod)
    except NotFound as e:
        raise NotFound(
            f"pod {req.pod!r} not found in namespace {req.namespace!r}",
            hint=f"list the pods with: kubectl get pods -n {req.namespace}",
        ) from e
    check_pod_running(pod)
    return snapshot_object(
        name=snapshot_name(req.pod, req.now, attempt),
        namespace=req.namespace,
        pod=req.pod,
        target=target,
        registry_secret=req.registry_secret,
        insecure=req.insecure,
        stop=req.stop,
        include_volumes=req.include_volumes,
        ignore_liveness=req.ignore_liveness,
        pod_uid=str((pod.get("metadata") or {}).get("uid") or ""),
    )


def start_snapshot(req: SnapshotRequest, *, kube: Kube, dry_run: bool = False) -> Obj:
    """Check the pod exists and runs, then create its PodSnapshot; returns the created object (with
    dry_run, the object as the API server would have created it: `--dry-run=server`)."""
    for attempt in range(1, NAME_ATTEMPTS + 1):
        body = snapshot_body(req, kube=kube, attempt=attempt)
        try:
            return kube.create_snapshot(req.namespace, body, dry_run=dry_run)
        except AlreadyExists as e:
            if attempt == NAME_ATTEMPTS:
                raise AlreadyExists(
                    e.message, hint="snapshots of this pod are being made faster than one a second; retry"
                ) from e
        except NotFound as e:
            raise FailedPrecondition(
                f"the PodSnapshot resource is not installed in this cluster ({e.message})",
                hint="install kubectl-snapshot first: kubectl snapshot install",
            ) from e
    raise AssertionError("unreachable")  # pragma: no cover


def wait_snapshot(
    namespace: str,
    name: str,
    *,
    kube: Kube,
    timeout_s: float = 600,
    claim_timeout_s: float = 60,
    on_status: StatusFn | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Obj:
    """Follow the PodSnapshot until Succeeded (returned) or Failed / timeout (raised)."""

    def settle(last: Obj | None, elapsed: float) -> Obj | None:
        status = snapshot_status(last or {})
        if last is not None and status.done:
            return _succeeded(namespace, name, last)
        if not status.claimed and elapsed > claim_timeout_s:
            raise Unavailable(
                f"no kubectl-snapshot agent picked up podsnapshot {namespace}/{name} within {claim_timeout_s:.0f}s",
                hint="check the agent on the pod's node: kubectl snapshot doctor",
                retryable=False,
            )
        if elapsed > timeout_s:
            raise Unavailable(
                f"podsnapshot {namespace}/{name} did not finish within {timeout_s:.0f}s "
                f"(phase {status.phase or 'unclaimed'}, stage {status.stage or '-'})",
                hint=f"it may still finish: kubectl snapshot list -n {namespace}; or raise --timeout",
                retryable=False,
            )
        return None

    def stop(obj: Obj, elapsed: float) -> bool:
        status = snapshot_status(obj)
        if on_status is not None:
            on_status(status)
        return status.done or (not status.claimed and elapsed > claim_timeout_s)

    return follow(
        lambda window: kube.watch_snapshot(namespace, name, timeout_s=window),
        settle=settle,
        stop=stop,
        deleted=lambda: NotFound(f"podsnapshot {namespace}/{name} was deleted while it was being taken"),
        timeout_s=timeout_s,
        clock=clock,
        read=lambda: kube.get_snapshot(namespace, name),
    )


def _succeeded(namespace: str, name: str, last: Obj) -> Obj:
    """The finished PodSnapshot if it succeeded; its failure, raised, if not."""
    final = snapshot_status(last)
    if final.phase == K.PHASE_FAILED:
        message = final.message or "the agent reported a failure without a message"
        raise FailedPrecondition(
            f"snapshot {namespace}/{name} failed{' on node ' + final.node if final.node else ''}: {message}",
            hint=final.hint
            or f"kubectl describe podsnapshot {name} -n {namespace}; kubectl describe pod -n {namespace}",
            details=final.details or None,
        )
    return last
