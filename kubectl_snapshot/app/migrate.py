"""`kubectl snapshot migrate pod/NAME`: snapshot (without stopping), restore on another node, and only
once the copy runs, delete the original.

Why not --stop semantics: stopping the original right after the push would make a failed restore
lose the workload, and "never lose the workload" beats a shorter overlap. The price is that the
copy resumes from the snapshot point: what the original did after it (and any external side
effect during the overlap) is not carried over. Pods whose work must not overlap should be
snapshotted with `kubectl snapshot pod/NAME --stop` and restored by hand.

A pod a controller owns (StatefulSet, ReplicaSet/Deployment, indexed Job) is not copied beside itself (the
controller would make a duplicate): when its workload is protected by a SnapshotPolicy with
``resume: true`` (the pod carries the resume-policy annotation from admission), it is saved with stop
(the agent deletes it once the push is verified) and the controller's replacement resumes from that
save wherever the scheduler places it (docs/kubernetes.md, "Resume protocol"). Without such a policy,
or for a Job that is not indexed (its pods have no identity to resume by), it is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kubectl_snapshot.app.ports import Kube, Obj, StoreFactory
from kubectl_snapshot.app.restore import (
    RestoreRequest,
    StateFn,
    build_restore,
    check_agent_on,
    create_restore_pod,
    wait_running,
)
from kubectl_snapshot.app.snapshot import SnapshotRequest, StatusFn, start_snapshot, wait_snapshot
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kubectl_snapshot.core.podspec import check_pod_running, restored_name
from kubectl_snapshot.core.tokenclone import cloned_token_warning
from kubectl_snapshot.core.workload import completion_index, controller_of


@dataclass(frozen=True)
class MigrateRequest:
    snapshot: SnapshotRequest
    node: str | None = None
    name: str | None = None
    agent_image: str | None = None
    lazy: bool = False  # the copy runs before its memory is back (docs/lazy-restore.md)
    timeout_s: float = 600
    claim_timeout_s: float = 60


@dataclass(frozen=True)
class MigrateResult:
    snapshot: Obj
    pod: Obj
    from_node: str
    to_node: str
    warnings: tuple[str, ...] = ()  # for the user, e.g. a cloned ServiceAccount token (core/tokenclone.py)


def is_ready(node: Obj) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def choose_node(nodes: list[Obj], *, current: str, wanted: str | None) -> str:
    """--node, else the first Ready, schedulable node that is not the pod's (sorted by name)."""
    if wanted:
        if wanted == current:
            raise InvalidArgument(f"the pod already runs on node {wanted}", hint="pick another node with --node")
        if not any((n.get("metadata") or {}).get("name") == wanted for n in nodes):
            raise InvalidArgument(f"node {wanted!r} does not exist", hint="list the nodes with: kubectl get nodes")
        return wanted
    names = sorted(str((n.get("metadata") or {}).get("name")) for n in nodes if is_ready(n))
    others = [n for n in names if n != current]
    if not others:
        raise FailedPrecondition(
            f"no other Ready node to migrate to (the pod runs on {current})",
            hint="add a node, uncordon one, or pass --node",
        )
    return others[0]


def migrate(
    req: MigrateRequest,
    *,
    kube: Kube,
    stores: StoreFactory,
    on_status: StatusFn | None = None,
    on_state: StateFn | None = None,
    on_step: Callable[[str], None] | None = None,
) -> MigrateResult:
    ns, pod_name = req.snapshot.namespace, req.snapshot.pod
    step = on_step or (lambda _s: None)
    pod = kube.get_pod(ns, pod_name)
    check_pod_running(pod)
    current = str((pod.get("spec") or {}).get("nodeName") or "")
    owner = controller_of(pod)
    if owner is not None:  # the controller's replacement resumes from a stop save: no duplicate
        return migrate_owned(req, pod, owner, kube=kube, on_status=on_status, on_state=on_state, on_step=step)
    target = choose_node(kube.list_nodes(), current=current, wanted=req.node)
    check_agent_on(target, kube=kube)  # before the snapshot: nobody there could restore it
    name = req.name or restored_name(pod_name)
    step(f"snapshot {ns}/{pod_name} on {current}")
    created = start_snapshot(req.snapshot, kube=kube)
    snap_name = created["metadata"]["name"]
    done = wait_snapshot(
        ns, snap_name, kube=kube, timeout_s=req.timeout_s, claim_timeout_s=req.claim_timeout_s, on_status=on_status
    )
    step(f"restore as {ns}/{name} on {target}")
    body, artifact = build_restore(
        RestoreRequest(
            source=snap_name,
            namespace=ns,
            name=name,
            node=target,
            registry_secret=req.snapshot.registry_secret,
            agent_image=req.agent_image,
            insecure=req.snapshot.insecure,
            lazy=req.lazy,
        ),
        kube=kube,
        stores=stores,
    )
    create_restore_pod(body, kube=kube)
    running = wait_running(ns, name, kube=kube, timeout_s=req.timeout_s, on_state=on_state)
    step(f"delete the original {ns}/{pod_name}")
    kube.delete_pod(ns, pod_name)
    cloned = cloned_token_warning(artifact.config)
    warnings = (cloned,) if cloned else ()
    return MigrateResult(snapshot=done, pod=running, from_node=current, to_node=target, warnings=warnings)


RESUMABLE_OWNERS = ("StatefulSet", "ReplicaSet", "Job")
POLL_S = 1.0


def migrate_owned(
    req: MigrateRequest,
    pod: Obj,
    owner: Obj,
    *,
    kube: Kube,
    on_status: StatusFn | None = None,
    on_state: StateFn | None = None,
    on_step: Callable[[str], None] = lambda _s: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> MigrateResult:
    meta = pod["metadata"]
    ns, name = meta["namespace"], meta["name"]
    kind, owner_name = str(owner.get("kind")), str(owner.get("name"))
    policy = (meta.get("annotations") or {}).get(K.ANN_RESUME_POLICY)
    if kind not in RESUMABLE_OWNERS or not policy:
        raise FailedPrecondition(
            f"pod {ns}/{name} is owned by {kind} {owner_name}, which does not resume from saves: migrating it"
            " would leave the controller to start a duplicate beside the copy",
            hint=f"protect the workload with a SnapshotPolicy (resume: true) selecting its pods, let {kind}"
            f" {owner_name} create its pods again (they then get the resume gate), and migrate once more"
            if kind in RESUMABLE_OWNERS
            else f"only StatefulSet, ReplicaSet/Deployment and Job pods resume; {kind} pods cannot be migrated",
        )
    if kind == "Job" and completion_index(pod) is None:  # core/resume: such pods have nothing to resume by
        raise FailedPrecondition(
            f"pod {ns}/{name} is owned by Job {owner_name}, which is not an indexed Job: its replacement would"
            " start fresh (a stop save would lose the pod's progress)",
            hint="only the pods of an Indexed Job (completionMode: Indexed) resume from saves",
        )
    if req.node or req.name:
        raise InvalidArgument(
            f"pod {ns}/{name} is owned by {kind} {owner_name}: its replacement is created by the controller and"
            " placed by the scheduler, so --node and --name do not apply",
            hint="drop --node/--name (cordon the old node first to keep the replacement off it)",
        )
    if req.lazy:
        raise InvalidArgument(
            f"pod {ns}/{name} is owned by {kind} {owner_name}: its replacement resumes as SnapshotPolicy {policy}"
            " says, so --lazy does not apply",
            hint=f"drop --lazy; to resume lazily, set spec.restoreMode: lazy on SnapshotPolicy {policy}",
        )
    current = str((pod.get("spec") or {}).get("nodeName") or "")
    on_step(f"save {ns}/{name} on {current} and stop it ({kind} {owner_name} resumes it, policy {policy})")
    created = start_snapshot(replace(req.snapshot, stop=True), kube=kube)
    snap_name = created["metadata"]["name"]
    done = wait_snapshot(
        ns, snap_name, kube=kube, timeout_s=req.timeout_s, claim_timeout_s=req.claim_timeout_s, on_status=on_status
    )
    on_step(f"wait for the replacement {kind} {owner_name} creates")
    new_name = _replacement(req, pod, owner, snap_name, kube=kube, clock=clock, sleep=sleep)
    running = wait_running(ns, new_name, kube=kube, timeout_s=req.timeout_s, on_state=on_state)
    status = str(((running.get("metadata") or {}).get("annotations") or {}).get(K.ANN_RESTORE_STATUS) or "")
    if status.startswith(K.RESTORE_SKIPPED_PREFIX):
        raise FailedPrecondition(
            f"the replacement {ns}/{new_name} started fresh: {status[len(K.RESTORE_SKIPPED_PREFIX) :]}",
            hint=f"the save is kept (PodSnapshot {snap_name}); see kubectl describe pod {new_name} -n {ns}",
        )
    to = str((running.get("spec") or {}).get("nodeName") or "")
    return MigrateResult(snapshot=done, pod=running, from_node=current, to_node=to)


def _replacement(
    req: MigrateRequest,
    old: Obj,
    owner: Obj,
    snap_name: str,
    *,
    kube: Kube,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> str:
    """The name of the pod the controller made in place of `old` that resumes from the save: a
    StatefulSet's by name, a Job's by completion index, a ReplicaSet's by the save's claim."""
    meta = old["metadata"]
    ns, kind = meta["namespace"], str(owner.get("kind"))
    deadline = clock() + req.timeout_s
    while clock() < deadline:
        claimed = ""
        if kind == "ReplicaSet":
            snap_meta = kube.get_snapshot(ns, snap_name).get("metadata") or {}
            claimed = str((snap_meta.get("annotations") or {}).get(K.ANN_CLAIMED_BY) or "")
        for p in kube.list_pods(ns):
            pm = p.get("metadata") or {}
            ref = controller_of(p) or {}
            if pm.get("uid") == meta["uid"] or ref.get("uid") != owner.get("uid") or pm.get("deletionTimestamp"):
                continue
            if (
                (kind == "StatefulSet" and pm.get("name") == meta["name"])
                or (kind == "Job" and completion_index(p) == completion_index(old))
                or (kind == "ReplicaSet" and claimed and pm.get("uid") == claimed)
            ):
                return str(pm["name"])
        sleep(POLL_S)
    raise Unavailable(
        f"no replacement of {ns}/{meta['name']} resumed from {snap_name} within {req.timeout_s:.0f}s",
        hint=f"the save is kept: kubectl get pods -n {ns}; kubectl describe podsnapshot {snap_name} -n {ns}",
        retryable=False,
    )
