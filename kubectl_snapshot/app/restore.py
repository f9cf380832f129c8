"""`kubectl snapshot restore REF|SNAPSHOT`: read the artifact, create the restore Pod, wait until it runs.

The Pod comes from the spec recorded in the artifact's config, rebuilt by the pure
`core.podspec.restore_pod` (images by digest, gate init container, runtime class). The node agent
stages the data and opens the gate; the runtime wrapper restores each container when the kubelet
creates it. The plugin only watches the Pod: the agent's verdict arrives as the restore-status
annotation or as the gate container's exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kubectl_snapshot.app.ports import Kube, Obj, StoreFactory
from kubectl_snapshot.app.watching import follow
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.artifact import Artifact, load_artifact
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.podspec import (
    RestoreState,
    gate_needed,
    holds_restore_pods,
    published_facts,
    restore_pod,
    restore_state,
    validate_name,
)
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.runtimegrant import dry_run_problems

StateFn = Callable[[RestoreState], None]


@dataclass(frozen=True)
class Source:
    reference: Reference
    insecure: bool = False
    snapshot: str | None = None  # the PodSnapshot it came from, if named that way


def resolve_source(text: str, *, namespace: str, kube: Kube, insecure: bool = False) -> Source:
    """REF (it has a '/') or the name of a Succeeded PodSnapshot in `namespace` (its status.reference)."""
    if "/" in text:
        return Source(Reference.parse(text), insecure=insecure)
    validate_name(text, "snapshot")
    try:
        obj = kube.get_snapshot(namespace, text)
    except NotFound as e:
        raise NotFound(
            f"no podsnapshot {text!r} in namespace {namespace!r}",
            hint=f"list them with: kubectl snapshot list -n {namespace}; or give REGISTRY/REPO[:TAG|@DIGEST]",
        ) from e
    status = obj.get("status") or {}
    ref = str(status.get("reference") or "")
    if status.get("phase") != K.PHASE_SUCCEEDED or not ref:
        raise FailedPrecondition(
            f"podsnapshot {namespace}/{text} has no image to restore (phase {status.get('phase') or 'Pending'})",
            hint=str(status.get("message") or "") or "wait until it has Succeeded: kubectl snapshot list",
        )
    spec = obj.get("spec") or {}
    return Source(Reference.parse(ref), insecure=insecure or bool(spec.get("insecure")), snapshot=text)


def read_artifact(source: Source, *, stores: StoreFactory) -> Artifact:
    return load_artifact(stores(source.reference, source.insecure), source.reference)


def gate_image(*, kube: Kube, explicit: str | None) -> str:
    """The agent image for the gate init container: --agent-image, else the agent DaemonSet's image."""
    if explicit:
        return explicit
    try:
        ds = kube.get_daemonset(K.AGENT_NAMESPACE, K.AGENT_NAME)
    except PermissionDenied:
        ds = None
    containers = ((((ds or {}).get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    for c in containers:
        if c.get("name") == K.AGENT_NAME and c.get("image"):
            return str(c["image"])
    if containers and containers[0].get("image"):
        return str(containers[0]["image"])
    raise FailedPrecondition(
        f"cannot find the agent image (daemonset {K.AGENT_NAMESPACE}/{K.AGENT_NAME} is absent or not readable)",
        hint="pass --agent-image IMAGE (the image the kubectl-snapshot agent runs), or install the agent",
    )


@dataclass(frozen=True)
class RestoreRequest:
    source: str
    namespace: str
    name: str | None = None
    node: str | None = None
    registry_secret: str | None = None
    agent_image: str | None = None
    insecure: bool = False
    lazy: bool = False  # the processes run before their memory is back (docs/lazy-restore.md)


def build_restore(req: RestoreRequest, *, kube: Kube, stores: StoreFactory) -> tuple[Obj, Artifact]:
    """The Pod to create (not created yet) and the artifact it restores."""
    source = resolve_source(req.source, namespace=req.namespace, kube=kube, insecure=req.insecure)
    artifact = read_artifact(source, stores=stores)
    if artifact.config.pod is None:
        raise FailedPrecondition(
            f"{artifact.reference} is a snapshot of containers, not of a Kubernetes pod",
            hint="restore it on a node with: ks-agent restore",
        )
    node = kube.get_node(req.node) if req.node else None  # NotFound names the node
    agents = ready_agent_nodes(kube=kube, node=req.node)
    if req.node:
        _require_agent(req.node, agents)
    why_gate = gate_needed(artifact.config.pod.spec, nodes_hold=nodes_hold(node, agents, kube=kube))
    body = restore_pod(
        artifact.config.pod,
        reference=artifact.reference,
        namespace=req.namespace,
        gate_image=gate_image(kube=kube, explicit=req.agent_image) if why_gate else "",
        name=req.name,
        node=req.node,
        registry_secret=req.registry_secret,
        lazy=req.lazy,
        gate=why_gate is not None,
    )
    return body, artifact


def nodes_hold(node: Obj | None, agents: set[str] | None, *, kube: Kube) -> bool:
    """Whether every node the restore pod may land on (`node`, else every node whose agent published
    facts) holds a restore pod's containers at their create (its agent's published facts), with a
    Ready agent there (`agents`: ready_agent_nodes; facts outlive an uninstalled agent). False when
    that cannot be read: the pod then keeps its gate init container, which works everywhere."""
    if not agents:
        return False
    if node is not None:
        return node["metadata"]["name"] in agents and holds_restore_pods(published_facts(node))
    try:
        facts = [f for f in map(published_facts, kube.list_nodes()) if f]  # nodes without an agent publish none
    except PermissionDenied:
        return False
    return bool(facts) and all(map(holds_restore_pods, facts))


def server_dry_run(body: Obj, artifact: Artifact, *, kube: Kube) -> Obj:
    """`--dry-run=server`: the restore pod as the API server would admit it (admission's changes
    included), refused as the agent would refuse it at staging when the snapshot's processes ran with
    more than that pod can grant them (core/runtimegrant.py)."""
    admitted = create_restore_pod(body, kube=kube, dry_run=True)
    records = [(c.name, c.spec) for c in artifact.config.containers]
    problems = dry_run_problems(admitted.get("spec") or {}, records)
    if problems:
        raise PermissionDenied(
            f"the restore would be refused: {'; '.join(problems)}",
            hint="restore into a pod spec that grants what the snapshotted pod had (its recorded spec: "
            "kubectl snapshot inspect), or take a new snapshot under the new spec",
        )
    return admitted


def ready_agent_nodes(*, kube: Kube, node: str | None = None) -> set[str] | None:
    """The nodes (only `node`, when given) where a kubectl-snapshot agent pod is Ready; None when the
    user may not read the agent's namespace."""
    try:
        pods = kube.list_pods(
            K.AGENT_NAMESPACE,
            label_selector=",".join(f"{k}={v}" for k, v in K.AGENT_LABEL.items()),
            field_selector=f"spec.nodeName={node}" if node else None,
        )
    except PermissionDenied:
        return None
    return {
        str((p.get("spec") or {}).get("nodeName") or "")
        for p in pods
        if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    }


def check_agent_on(node: str, *, kube: Kube) -> None:
    """Refuse early when no agent is ready on the target node (nobody would stage the restore).

    Users who may not read the agent's namespace get no early answer; the gate then times out with
    a hint instead.
    """
    _require_agent(node, ready_agent_nodes(kube=kube, node=node))


def _require_agent(node: str, ready: set[str] | None) -> None:
    if ready is not None and node not in ready:
        raise FailedPrecondition(
            f"no kubectl-snapshot agent is ready on node {node}",
            hint="kubectl snapshot doctor shows the agents; choose another --node, or install the agent there",
        )


def create_restore_pod(body: Obj, *, kube: Kube, dry_run: bool = False) -> Obj:
    """Create the restore pod; with dry_run the API server only admits it (`--dry-run=server`)."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        return kube.create_pod(ns, body, dry_run=dry_run)
    except FailedPrecondition as e:  # 409: the name is taken
        raise FailedPrecondition(
            f"pod {ns}/{name} already exists", hint="choose another name with --name, or delete that pod"
        ) from e
    except InvalidArgument as e:
        if "runtimeClass" in e.message or "RuntimeClass" in e.message:
            raise FailedPrecondition(e.message, hint="install kubectl-snapshot first: kubectl snapshot install") from e
        raise
    except PermissionDenied as e:
        # the RuntimeClass admission plugin refuses a pod naming an absent RuntimeClass with 403 Forbidden
        # ("pod rejected: RuntimeClass ... not found"): kubectl-snapshot is not installed, not an RBAC gap
        if "RuntimeClass" in e.message and "not found" in e.message:
            raise FailedPrecondition(e.message, hint="install kubectl-snapshot first: kubectl snapshot install") from e
        raise


def wait_running(
    namespace: str,
    name: str,
    *,
    kube: Kube,
    timeout_s: float = 600,
    on_state: StateFn | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Obj:
    """Until every container of the restored Pod runs (returned) or the restore fails (raised)."""

    def settle(last: Obj | None, elapsed: float) -> Obj | None:
        state = restore_state(last) if last is not None else RestoreState("waiting", "Pending")
        if state.state == "running" and last is not None:
            return last
        if state.state == "failed":
            raise FailedPrecondition(
                f"restore of pod {namespace}/{name} failed: {state.reason}",
                hint=f"kubectl describe pod {name} -n {namespace} (events from the agent); "
                f"delete it with kubectl delete pod {name} -n {namespace}",
            )
        if elapsed > timeout_s:
            raise Unavailable(
                f"restored pod {namespace}/{name} is not running after {timeout_s:.0f}s ({state.reason})",
                hint=f"kubectl describe pod {name} -n {namespace}; kubectl snapshot doctor; or raise --timeout",
                retryable=False,
            )
        return None

    def stop(obj: Obj, _elapsed: float) -> bool:
        state = restore_state(obj)
        if on_state is not None:
            on_state(state)
        return state.state != "waiting"

    return follow(
        lambda window: kube.watch_pods(field_selector=f"metadata.name={name}", namespace=namespace, timeout_s=window),
        settle=settle,
        stop=stop,
        deleted=lambda: NotFound(f"restored pod {namespace}/{name} was deleted while it was starting"),
        timeout_s=timeout_s,
        clock=clock,
    )
