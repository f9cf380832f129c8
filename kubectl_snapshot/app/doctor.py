"""`kubectl snapshot doctor`: is everything in place, per node and for the cluster.

Per node: the agent pod and its readiness, and the facts the agent publishes in the node annotation
`kubectl-snapshot.io/node-facts` (CRIU, containerd, runc, kernel, runtime handler); "unknown" when the
agent has not published them. The agent also publishes (shim/service/nodecheck.py) which CRIU and runtime
hook are in use and where they came from, every other tool the node side uses (the bundle's tar; the
in-process network work in pods' namespaces, with the kernel features it needs), `criu check` with
that CRIU, the cgroup version, whether containerd's config imports the drop-in directory and whether
a containerd restart is pending; what blocks a node is listed per node and makes the report not ok.
Cluster: the CRD, the agent DaemonSet, the RuntimeClass, and who reads the namespace keys: the key
broker (its replicas available) or, where it is not installed, every node's agent.
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.app.ports import Kube, Obj
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import PermissionDenied
from kubectl_snapshot.core.podspec import holds_restore_pods, published_facts

NODE_FACTS_ANNOTATION = K.ANN_NODE_FACTS
UNKNOWN = "unknown"
FACT_KEYS = ("criuVersion", "containerdVersion", "runcVersion", "kernel", "runtimeHandler")


def node_facts(node: Obj) -> dict[str, Any]:
    facts = published_facts(node)
    out: dict[str, Any] = {k: facts[k] if k in facts and facts[k] not in (None, "") else UNKNOWN for k in FACT_KEYS}
    status = facts.get("node")
    status = status if isinstance(status, dict) else {}
    criu, hook = _dict(status.get("criu")), _dict(status.get("hook"))
    containerd = _dict(status.get("containerd"))
    out["criu"] = {
        "path": str(criu.get("path") or UNKNOWN),
        "version": str(criu.get("version") or out["criuVersion"]),
        "from": str(criu.get("from") or UNKNOWN),
    }
    out["hook"] = {
        "path": str(hook.get("path") or UNKNOWN),
        "python": str(hook.get("python") or UNKNOWN),
        "from": str(hook.get("from") or UNKNOWN),
    }
    out["tools"] = {
        str(name): {
            "path": str(_dict(t).get("path") or UNKNOWN),
            "version": str(_dict(t).get("version") or ""),
            "from": str(_dict(t).get("from") or UNKNOWN),
            **({"replaces": str(_dict(t)["replaces"])} if "replaces" in _dict(t) else {}),
            **({"ok": bool(_dict(t)["ok"]), "detail": str(_dict(t).get("detail") or "")} if "ok" in _dict(t) else {}),
        }
        for name, t in sorted(_dict(status.get("tools")).items())
    }
    check = _dict(status.get("criuCheck"))
    out["criuCheck"] = (
        UNKNOWN if not check else "ok" if check.get("ok") else str(check.get("detail") or "failed")[-300:]
    )
    out["cgroup"] = str(status.get("cgroup") or facts.get("cgroupVersion") or UNKNOWN)
    out["containerdConfig"] = str(containerd.get("config") or UNKNOWN)
    out["importsDropin"] = containerd.get("importsDropin", UNKNOWN) if containerd else UNKNOWN
    out["restartPending"] = containerd.get("restartPending", UNKNOWN) if containerd else UNKNOWN
    # restore pods go without the gate init container on this node (core/podspec.gate_needed)
    out["holdsRestorePods"] = holds_restore_pods(facts)
    blockers = status.get("blockers")
    out["blockers"] = [str(b) for b in blockers] if isinstance(blockers, list) else []
    if not status:
        out["blockers"].append("the agent has not published node status (an older agent, or not running)")
    return out


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _pod_ready(pod: Obj) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _check(kube: Kube, what: str, obj: Obj) -> dict[str, Any]:
    try:
        found = kube.get_object(obj)
    except PermissionDenied as e:
        return {"check": what, "ok": False, "detail": f"cannot read: {e.message}"}
    return {"check": what, "ok": found is not None, "detail": "present" if found else "missing"}


def _key_broker(kube: Kube) -> dict[str, Any]:
    what = f"key broker {K.AGENT_NAMESPACE}/{K.KEY_BROKER_NAME}"
    ref = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": K.KEY_BROKER_NAME, "namespace": K.AGENT_NAMESPACE}}  # fmt: skip
    try:
        found = kube.get_object(ref)
    except PermissionDenied as e:
        return {"check": what, "ok": False, "detail": f"cannot read: {e.message}"}
    if found is None:  # a --host-network or --no-key-broker install: a choice, not a fault
        return {"check": what, "ok": True, "detail": "not installed: every node's agent reads every namespace's key"}
    want = int((found.get("spec") or {}).get("replicas", 1))
    available = int((found.get("status") or {}).get("availableReplicas") or 0)
    # none available: every sealed save and restore fails ("keys unavailable")
    return {"check": what, "ok": available > 0 or want == 0, "detail": f"{available}/{want} replicas available"}


def doctor(*, kube: Kube) -> dict[str, Any]:
    crd = f"{K.PLURAL}.{K.GROUP}"
    checks = [
        _check(
            kube,
            f"CRD {crd}",
            {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": crd}},
        ),
        _check(
            kube,
            f"DaemonSet {K.AGENT_NAMESPACE}/{K.AGENT_NAME}",
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE},
            },
        ),
        _check(
            kube,
            f"RuntimeClass {K.RUNTIME_CLASS}",
            {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": K.RUNTIME_CLASS}},
        ),
        _key_broker(kube),
    ]
    selector = ",".join(f"{k}={v}" for k, v in K.AGENT_LABEL.items())
    try:
        agents = kube.list_pods(K.AGENT_NAMESPACE, label_selector=selector)
        agents_error = ""
    except PermissionDenied as e:
        agents, agents_error = [], f"cannot list agent pods: {e.message}"
    by_node: dict[str, Obj] = {}
    for pod in agents:
        node_name = str((pod.get("spec") or {}).get("nodeName") or "")
        if node_name and (node_name not in by_node or _pod_ready(pod)):
            by_node[node_name] = pod
    errors = [agents_error] if agents_error else []
    try:
        listed = kube.list_nodes()
    except PermissionDenied as e:  # the cluster checks above still stand; say what could not be read
        listed = []
        errors.append(f"cannot list nodes: {e.message}")
    nodes = []
    for node in sorted(listed, key=lambda n: str(n["metadata"]["name"])):
        name = str(node["metadata"]["name"])
        agent = by_node.get(name)
        nodes.append(
            {
                "node": name,
                "agentPod": str(agent["metadata"]["name"]) if agent else "",
                "agentReady": UNKNOWN if agents_error else bool(agent and _pod_ready(agent)),
                **node_facts(node),
            }
        )
    ok = (
        all(c["ok"] for c in checks)
        and not errors
        and all(n["agentReady"] is True and not n["blockers"] for n in nodes)
    )
    result: dict[str, Any] = {"ok": ok, "checks": checks, "nodes": nodes}
    if errors:
        result["error"] = "; ".join(errors)
    return result
