"""Which save a new pod of a protected workload resumes from (pure; docs/kubernetes.md, "Resume protocol").

The agent lists the Succeeded PodSnapshots of the pod's namespace that carry the workload's
provenance labels (written by an agent at claim time, from the real pod) and picks:

- StatefulSet: the newest save of a pod of the same name (the ordinal is the identity);
- indexed Job: the newest save with the same completion index;
- ReplicaSet / Deployment: the newest save of ONE predecessor pod (pod uid) that no longer runs (gone
  or terminating) and none of whose saves is claimed yet; the agent then claims it
  (``kubectl-snapshot.io/claimed-by``, resourceVersion-checked), so two new pods never share a save.

While a save of a candidate predecessor is still running (a ``stop`` save of a migrated pod, or the
final save of a terminating pod: core/finalsave.py), the choice waits for it; and while a protected
predecessor is still terminating (a ReplicaSet or a Job replaces a pod as soon as it is being
deleted, before its agent may even have created its final save), it waits for that pod to be gone.
Neither wait applies where the node is down (NotReady, or tainted out of service: docs/node-loss.md):
a save cut off by a dead node never finishes, a pod there never terminates by itself, and the newest
good save stands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.workload import Workload, completion_index

BY_NAME = ("StatefulSet",)
BY_INDEX = ("Job",)
BY_CLAIM = ("ReplicaSet", "Deployment")
RESUMABLE = (*BY_NAME, *BY_INDEX, *BY_CLAIM)


@dataclass(frozen=True)
class Choice:
    save: dict[str, Any] | None = None  # the PodSnapshot to resume from
    claim: bool = False  # it must be claimed first (ReplicaSet/Deployment)
    wait: bool = False  # a candidate's save is still running: look again shortly
    reason: str = ""  # why there is none (the pod starts fresh)


def label_selector(workload: Workload, pod: Mapping[str, Any]) -> str | None:
    """The PodSnapshot label selector for the pod's predecessors (None: this pod never resumes)."""
    if workload.kind not in RESUMABLE:
        return None
    parts = [f"{K.LABEL_WORKLOAD_KIND}={workload.kind}", f"{K.LABEL_WORKLOAD_NAME}={workload.name}"]
    meta = pod.get("metadata") or {}
    if workload.kind in BY_NAME:
        parts.append(f"{K.LABEL_POD}={meta.get('name')}")
    elif workload.kind in BY_INDEX:
        index = completion_index(pod)
        if index is None:
            return None  # a Job that is not indexed: its pods have no identity to resume by
        parts.append(f"{K.LABEL_COMPLETION_INDEX}={index}")
    return ",".join(parts)


def _phase(s: Mapping[str, Any]) -> str:
    return str((s.get("status") or {}).get("phase") or "")


def _labels(s: Mapping[str, Any]) -> Mapping[str, str]:
    return (s.get("metadata") or {}).get("labels") or {}


def _claimed(s: Mapping[str, Any]) -> bool:
    return bool(((s.get("metadata") or {}).get("annotations") or {}).get(K.ANN_CLAIMED_BY))


def _when(s: Mapping[str, Any]) -> tuple[str, str, str]:
    """Newest first by completion time, then creation time, then name (RFC 3339 strings sort in time order)."""
    meta, status = s.get("metadata") or {}, s.get("status") or {}
    return (str(status.get("completionTime") or ""), str(meta.get("creationTimestamp") or ""), str(meta.get("name")))


OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


def node_down(node: Mapping[str, Any] | None) -> bool:
    """The node (None: it is gone) cannot finish anything: its Ready condition is not True, or it
    carries the out-of-service taint (an operator or automation declared it shut down)."""
    if node is None:
        return True
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if any(t.get("key") == OUT_OF_SERVICE_TAINT for t in spec.get("taints") or []):
        return True
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") != "True"


def save_node(s: Mapping[str, Any]) -> str:
    """The node taking (or that took) the save: its status.node ('' before an agent claimed it)."""
    return str((s.get("status") or {}).get("node") or "")


def in_progress(saves: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [s for s in saves if _phase(s) not in K.TERMINAL_PHASES]


def choose(
    workload: Workload,
    pod: Mapping[str, Any],
    saves: Iterable[Mapping[str, Any]],
    *,
    running_pod_uids: set[str],
    terminating: Iterable[Mapping[str, Any]] = (),
    wait_for_running: bool = True,
    down_nodes: frozenset[str] | set[str] = frozenset(),
) -> Choice:
    """The save `pod` resumes from. `saves`: the PodSnapshots label_selector() matched; `running_pod_uids`:
    uids of the namespace's pods that exist and are not terminating; `terminating`: the namespace's
    pods being deleted that the same SnapshotPolicy protects (their final save may still come);
    `wait_for_running`: False once the caller waited long enough for saves still in progress;
    `down_nodes`: nodes that are down (node_down): a save in progress there, or a pod terminating
    there, is not waited for."""
    uid = str((pod.get("metadata") or {}).get("uid") or "")
    if wait_for_running and any(
        predecessor(workload, pod, p) and (p.get("spec") or {}).get("nodeName") not in down_nodes for p in terminating
    ):
        return Choice(wait=True, reason="a predecessor is terminating (its final save may be under way)")
    own = [s for s in saves if _labels(s).get(K.LABEL_POD_UID) and _labels(s).get(K.LABEL_POD_UID) != uid]
    if workload.kind in BY_CLAIM:
        own = [s for s in own if _labels(s).get(K.LABEL_POD_UID) not in running_pod_uids]
    if wait_for_running and any(save_node(s) not in down_nodes for s in in_progress(own)):
        return Choice(wait=True, reason="a save of a predecessor is still running")
    good = sorted((s for s in own if _phase(s) == K.PHASE_SUCCEEDED), key=_when, reverse=True)
    if workload.kind not in BY_CLAIM:
        if not good:
            return Choice(reason=f"no good save of {_identity(workload, pod)} yet")
        return Choice(save=dict(good[0]))
    claimed = {_labels(s).get(K.LABEL_POD_UID) for s in good if _claimed(s)}
    free = [s for s in good if _labels(s).get(K.LABEL_POD_UID) not in claimed]
    if not free:
        why = "every predecessor's save is claimed by another pod" if good else "no save of a predecessor that is gone"
        return Choice(reason=f"{why} ({workload.kind} {workload.name})")
    return Choice(save=dict(free[0]), claim=True)  # the newest save of the predecessor saved last


def predecessor(workload: Workload, pod: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether `other` (a terminating pod of the same policy) is one whose save `pod` may resume: same
    name (StatefulSet), same completion index (Job), any other pod (ReplicaSet/Deployment)."""
    meta, ometa = pod.get("metadata") or {}, other.get("metadata") or {}
    if ometa.get("uid") == meta.get("uid"):
        return False
    if workload.kind in BY_NAME:
        return bool(ometa.get("name") == meta.get("name"))
    if workload.kind in BY_INDEX:
        return completion_index(other) is not None and completion_index(other) == completion_index(pod)
    return workload.kind in BY_CLAIM


def _identity(workload: Workload, pod: Mapping[str, Any]) -> str:
    if workload.kind in BY_NAME:
        return f"pod {(pod.get('metadata') or {}).get('name')} of {workload.kind} {workload.name}"
    if workload.kind in BY_INDEX:
        return f"completion index {completion_index(pod)} of Job {workload.name}"
    return f"{workload.kind} {workload.name}"
