"""`kubectl snapshot migrate pod/NAME`: snapshot (without stopping), restore on another node, and only
once the copy runs, delete the original.

Why not --stop semantics: stopping the original right after the push would make a failed restore
lose the workload, and "never lose the workload" beats a shorter overlap. The price is that the
copy resumes from the snapshot point: what the original did after it (and any external side
effect during the overlap) is not carried over. Pods whose work must not overlap should be
snapshotted with `kubectl snapshot pod/NAME --stop` and restored by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kubectl_snapshot.app.ports import Kube, Obj, StoreFactory
from kubectl_snapshot.app.restore import RestoreRequest, StateFn, build_restore, create_restore_pod, wait_running
from kubectl_snapshot.app.snapshot import SnapshotRequest, StatusFn, start_snapshot, wait_snapshot
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from kubectl_snapshot.core.podspec import check_pod_running, restored_name


@dataclass(frozen=True)
class MigrateRequest:
    snapshot: SnapshotRequest
    node: str | None = None
    name: str | None = None
    agent_image: str | None = None
    timeout_s: float = 600
    claim_timeout_s: float = 60


@dataclass(frozen=True)
class MigrateResult:
    snapshot: Obj
    pod: Obj
    from_node: str
    to_node: str


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
    target = choose_node(kube.list_nodes(), current=current, wanted=req.node)
    name = req.name or restored_name(pod_name)
    step(f"snapshot {ns}/{pod_name} on {current}")
    created = start_snapshot(req.snapshot, kube=kube)
    snap_name = created["metadata"]["name"]
    done = wait_snapshot(
        ns, snap_name, kube=kube, timeout_s=req.timeout_s, claim_timeout_s=req.claim_timeout_s, on_status=on_status
    )
    step(f"restore as {ns}/{name} on {target}")
    body, _artifact = build_restore(
        RestoreRequest(
            source=snap_name,
            namespace=ns,
            name=name,
            node=target,
            registry_secret=req.snapshot.registry_secret,
            agent_image=req.agent_image,
            insecure=req.snapshot.insecure,
        ),
        kube=kube,
        stores=stores,
    )
    create_restore_pod(body, kube=kube)
    running = wait_running(ns, name, kube=kube, timeout_s=req.timeout_s, on_state=on_state)
    step(f"delete the original {ns}/{pod_name}")
    kube.delete_pod(ns, pod_name)
    return MigrateResult(snapshot=done, pod=running, from_node=current, to_node=target)
