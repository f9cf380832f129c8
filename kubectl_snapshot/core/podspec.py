"""Pure builders for the Kubernetes objects the plugin writes and the states it reads back.

Kept apart from the adapter so that the restore Pod (docs/kubernetes.md, "Restore protocol") can be
checked field by field without a cluster: what the restored pod may do (mounts, devices, images,
security context) comes only from this spec, never from data inside the snapshot's layers.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, SourcePodReplaced
from kubectl_snapshot.core.model import PodRecord
from kubectl_snapshot.core.reference import Reference

MAX_NAME = 253
POD_NAME_MAX = 63  # pod names end up as hostnames: keep them DNS labels
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")

# The gate init container: waits until the agent staged the data, fails with the agent's reason.
# Python, because the agent image is a Python image (a shell is not guaranteed to be in it).
GATE_SCRIPT = (
    "import os,sys,time\n"
    f"d={K.GATE_MOUNT!r}\n"
    "while True:\n"
    f"    f=os.path.join(d,{K.GATE_FAILED_FILE!r})\n"
    "    if os.path.exists(f):\n"
    "        print(open(f,errors='replace').read().strip() or 'restore failed',flush=True); sys.exit(1)\n"
    f"    if os.path.exists(os.path.join(d,{K.GATE_STAGED_FILE!r})): sys.exit(0)\n"
    "    time.sleep(0.2)\n"
)


# --- names -----------------------------------------------------------------------------------------


def parse_pod_arg(text: str) -> str:
    """`NAME`, `pod/NAME`, `pods/NAME`, `po/NAME` -> NAME (anything else is a usage error)."""
    kind, sep, name = text.partition("/")
    if not sep:
        kind, name = "pod", text
    if kind.lower() not in ("pod", "pods", "po"):
        raise InvalidArgument(f"cannot snapshot {text!r}: only pods can be snapshotted", hint="use pod/NAME")
    validate_name(name, "pod")
    return name


def validate_name(name: str, what: str) -> str:
    if not name or len(name) > MAX_NAME or not _DNS_SUBDOMAIN.match(name):
        raise InvalidArgument(
            f"invalid {what} name {name!r}",
            hint="Kubernetes names are lowercase letters, digits, '-' and '.', starting and ending alphanumeric",
        )
    return name


def timestamp(now: datetime.datetime, attempt: int = 1) -> str:
    """`yyyymmdd-hhmmss` in UTC: the suffix of snapshot names and the default tag; `-N` is added for
    the Nth attempt (N >= 2) when a snapshot of the same pod was already made in that second."""
    stamp = now.astimezone(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return stamp if attempt <= 1 else f"{stamp}-{attempt}"


def snapshot_name(pod: str, now: datetime.datetime, attempt: int = 1) -> str:
    """`<pod>-<yyyymmdd-hhmmss>[-N]`, the pod part shortened so the whole stays a valid name."""
    suffix = "-" + timestamp(now, attempt)
    return pod[: MAX_NAME - len(suffix)].rstrip("-.") + suffix


def restored_name(original: str) -> str:
    suffix = "-restored"
    return original[: POD_NAME_MAX - len(suffix)].rstrip("-.") + suffix


def destination(repository: str, tag: str) -> Reference:
    """`--to REPO[:TAG]` (or $KUBECTL_SNAPSHOT_REPOSITORY) with the default tag when it has none."""
    ref = Reference.parse(repository, default_tag=None)
    if ref.digest:
        raise InvalidArgument(
            f"--to {repository!r} names a digest",
            hint="a snapshot's digest is known only after it is pushed: give REGISTRY/REPO[:TAG]",
        )
    return ref if ref.tag else ref.with_tag(tag)


# --- PodSnapshot -----------------------------------------------------------------------------------


def snapshot_object(
    *,
    name: str,
    namespace: str,
    pod: str,
    target: Reference,
    registry_secret: str | None = None,
    insecure: bool = False,
    stop: bool = False,
    include_volumes: bool = True,
    ignore_liveness: bool = False,
    pod_uid: str = "",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "podName": pod,
        "podNamespace": namespace,
        **({"podUID": pod_uid} if pod_uid else {}),  # the pod as it was checked: a replacement is refused
        "destination": str(target),
        "insecure": insecure,
        "stop": stop,
        "includeVolumes": include_volumes,
    }
    if ignore_liveness:
        spec["ignoreLiveness"] = True
    if registry_secret:
        spec["registrySecret"] = validate_name(registry_secret, "secret")
    return {
        "apiVersion": K.API_VERSION,
        "kind": K.KIND,
        "metadata": {
            "name": validate_name(name, "snapshot"),
            "namespace": namespace,
            **({"labels": {K.LABEL_POD: pod}} if len(pod) <= 63 else {}),  # a label value has 63 chars at most
        },
        "spec": spec,
    }


# --- pod checks ------------------------------------------------------------------------------------


def check_pod_running(pod: Mapping[str, Any]) -> None:
    """Raise FailedPrecondition saying why a pod cannot be snapshotted (not Running, not ready yet)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    phase = str(status.get("phase") or "Unknown")
    if meta.get("deletionTimestamp"):
        raise FailedPrecondition(f"pod {name} is being deleted", hint="snapshot a pod that is running")
    if phase == "Running" and pod.get("spec", {}).get("nodeName"):
        waiting = [
            f"{c.get('name')}: {(c.get('state') or {}).get('waiting', {}).get('reason', 'waiting')}"
            for c in status.get("containerStatuses") or []
            if "running" not in (c.get("state") or {})
        ]
        if waiting:
            raise FailedPrecondition(
                f"pod {name} is Running but not all containers run ({'; '.join(waiting)})",
                hint="wait until every container runs (kubectl get pod -w), then retry",
                retryable=True,
            )
        return
    why = [f"phase {phase}"]
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            why.append(f"{cond.get('type')}: {cond.get('message')}")
    if status.get("reason"):
        why.append(str(status["reason"]))
    hint = "only Running pods can be snapshotted; see kubectl describe pod " + str(meta.get("name", ""))
    raise FailedPrecondition(f"pod {name} is not Running ({'; '.join(why)})", hint=hint, retryable=phase == "Pending")


def check_snapshot_source(snapshot_spec: Mapping[str, Any], pod: Mapping[str, Any]) -> None:
    """Raise SourcePodReplaced when the PodSnapshot was made for another pod of the same name.

    The plugin (and a policy) records the uid of the pod it checked in `spec.podUID`; a pod deleted
    and recreated under its name (a StatefulSet's, a Deployment's rollout with a fixed name, a user's
    delete and apply) is another pod: another workload's memory, another owner. A PodSnapshot without
    podUID (made by an older plugin) is taken for the pod of its name, as before."""
    want = str(snapshot_spec.get("podUID") or "")
    meta = pod.get("metadata") or {}
    have = str(meta.get("uid") or "")
    if not want or want == have:
        return
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    raise SourcePodReplaced(
        f"pod {name} is not the pod this snapshot was requested for: it was replaced"
        f" (uid {want} requested, {have or 'none'} runs now)",
        hint=f"snapshot the pod that runs now: kubectl snapshot pod/{meta.get('name', '')}",
    )


# --- restore Pod -----------------------------------------------------------------------------------


def restore_pod(
    record: PodRecord,
    *,
    reference: Reference,
    namespace: str,
    gate_image: str,
    name: str | None = None,
    node: str | None = None,
    registry_secret: str | None = None,
    lazy: bool = False,
    gate: bool = True,
) -> dict[str, Any]:
    """The Pod that `kubectl snapshot restore` creates from a recorded pod (docs/kubernetes.md). `lazy`:
    it carries the restore-mode annotation, and its processes run before their memory is back
    (docs/lazy-restore.md); without it, no annotation: every page is staged first, as always. `gate`:
    the gate init container waits until the agent has checked the snapshot and the pod's volumes are
    there; without it (`gate_needed` says when) the runtime wrapper holds each container at its create
    from the start, which saves the gate's own start and the kubelet's noticing its exit (its next
    relist, up to a second later)."""
    if not reference.digest:
        raise InvalidArgument(f"restore needs a reference pinned by digest, got {reference}")
    if not record.spec.get("containers"):
        raise FailedPrecondition(
            f"the snapshot {reference} records no pod spec",
            hint="it was not taken from a Kubernetes pod; restore it on a node with ks-agent restore",
        )
    pod_name = validate_name(name or restored_name(record.name or "pod"), "pod")
    spec = copy.deepcopy(dict(record.spec))
    recorded_meta = spec.pop("metadata", None) or {}
    # native sidecars (restartPolicy Always) come back after the gate; other init containers already ran
    sidecars = [c for c in spec.pop("initContainers", None) or [] if c.get("restartPolicy") == "Always"]
    for key in ("nodeName", "ephemeralContainers"):
        spec.pop(key, None)
    for c in [*sidecars, *spec["containers"]]:
        image = str(c.get("image", ""))
        if "@sha256:" not in image:
            raise FailedPrecondition(
                f"container {c.get('name')!r} of the snapshot has image {image!r}, not pinned by digest",
                hint="the restored container must run the exact image it was snapshotted with",
            )
    labels = {
        k: str(v)
        for k, v in (recorded_meta.get("labels") or {}).items()
        if k not in K.DROPPED_LABELS and k != K.LABEL_RESTORED_FROM
    }
    labels[K.LABEL_RESTORED_FROM] = _label_value(record.name)
    annotations = {K.ANN_RESTORE_FROM: f"{reference.registry}/{reference.repository}@{reference.digest}"}
    if registry_secret:
        annotations[K.ANN_REGISTRY_SECRET] = validate_name(registry_secret, "secret")
    if lazy:
        annotations[K.ANN_RESTORE_MODE] = K.RESTORE_MODE_LAZY
    spec["runtimeClassName"] = K.RUNTIME_CLASS
    if node:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), "kubernetes.io/hostname": node}
        if _requires_node_affinity(spec):
            spec.pop("affinity", None)  # recorded for the old node; --node decides now
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != K.GATE_VOLUME]
    if gate:
        spec["volumes"] = [*volumes, {"name": K.GATE_VOLUME, "emptyDir": {}}]
        spec["initContainers"] = [gate_container(gate_image), *sidecars]
    else:  # the runtime wrapper holds each container at its create until the agent answers
        if volumes:
            spec["volumes"] = volumes
        else:
            spec.pop("volumes", None)
        if sidecars:
            spec["initContainers"] = sidecars
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


def published_facts(node: Mapping[str, Any]) -> dict[str, Any]:
    """What a node's agent published about its node (the node-facts annotation's JSON); {} when none."""
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(K.ANN_NODE_FACTS)
    try:
        facts = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


def holds_restore_pods(facts: Mapping[str, Any]) -> bool:
    """Whether a node's published facts (its agent's node-facts annotation) say that its containerd
    passes the restore-from annotation to the runtime wrapper, which then holds a restore pod's
    containers at their create (`ks-agent install-node`'s drop-in, read by containerd since)."""
    node = facts.get("node")
    containerd = node.get("containerd") if isinstance(node, Mapping) else None
    passed = containerd.get("podAnnotations") if isinstance(containerd, Mapping) else None
    return isinstance(passed, list) and K.ANN_RESTORE_FROM in passed


def gate_needed(spec: Mapping[str, Any], *, nodes_hold: bool) -> str | None:
    """Why a restore pod keeps the gate init container; None when it goes without: its containers'
    creates are then held by the nodes' runtime wrappers from the start instead of from the gate's
    opening (which comes before the download: the creates wait through the staging either way)."""
    if spec.get("restartPolicy") == "Never":
        return "a pod never restarted fails for good at a refused create (restartPolicy Never)"
    if not nodes_hold:
        return "the node's containerd does not pass the restore annotation to the runtime wrapper (node facts)"
    return None


def gate_container(image: str) -> dict[str, Any]:
    return {
        "name": K.GATE_CONTAINER,
        "image": image,
        "command": ["python3", "-c", GATE_SCRIPT],
        "volumeMounts": [{"name": K.GATE_VOLUME, "mountPath": K.GATE_MOUNT}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
    }


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return value or "unknown"


def _requires_node_affinity(spec: Mapping[str, Any]) -> bool:
    """True when a recorded required node affinity could contradict --node (it is then dropped)."""
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    return bool(affinity.get("requiredDuringSchedulingIgnoredDuringExecution"))


@dataclass(frozen=True)
class RestoreState:
    """Where a restore Pod is: `waiting`, `running` or `failed` (with the reason)."""

    state: str
    reason: str = ""


def restore_state(pod: Mapping[str, Any]) -> RestoreState:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ann = str((meta.get("annotations") or {}).get(K.ANN_RESTORE_STATUS) or "")
    if ann.startswith(K.RESTORE_FAILED_PREFIX):
        return RestoreState("failed", ann[len(K.RESTORE_FAILED_PREFIX) :] or "the agent reported a failure")
    for c in status.get("initContainerStatuses") or []:
        if c.get("name") != K.GATE_CONTAINER:
            continue
        term = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            return RestoreState("failed", str(term.get("message") or term.get("reason") or "the gate failed").strip())
    phase = status.get("phase")
    if phase == "Failed":
        return RestoreState("failed", str(status.get("message") or status.get("reason") or "the pod failed"))
    if phase == "Succeeded":
        return RestoreState("failed", "the restored pod exited instead of running")
    for c in status.get("containerStatuses") or []:
        term = (c.get("state") or {}).get("terminated")
        waiting = (c.get("state") or {}).get("waiting") or {}
        if term or waiting.get("reason") in ("CrashLoopBackOff", "CreateContainerError", "RunContainerError"):
            detail = (term or {}).get("message") or waiting.get("message") or waiting.get("reason") or "terminated"
            return RestoreState("failed", f"container {c.get('name')}: {str(detail).strip()}")
    statuses = status.get("containerStatuses") or []
    if phase == "Running" and statuses and all("running" in (c.get("state") or {}) for c in statuses):
        spec = pod.get("spec") or {}
        gateless = K.ANN_RESTORE_FROM in (meta.get("annotations") or {}) and not any(
            c.get("name") == K.GATE_CONTAINER for c in spec.get("initContainers") or []
        )
        if gateless and ann != K.RESTORE_STAGED:  # no gate said the agent staged it: its own word must
            return RestoreState("waiting", "running; waiting for the agent to say it restored the pod")
        return RestoreState("running")
    for c in statuses:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
            return RestoreState("waiting", f"{c.get('name')}: {waiting.get('reason')}: {waiting.get('message', '')}")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return RestoreState("waiting", f"unschedulable: {cond.get('message', '')}")
    return RestoreState("waiting", ann or str(phase or "Pending"))


def pod_status_summary(status: Mapping[str, Any]) -> str:
    """One line of what a pod's status says: its phase, why (the kubelet's reason and message, e.g. a
    rejection at admission), and the conditions that are not True."""
    parts = [f"phase {status.get('phase') or 'Pending'}"]
    why = ": ".join(str(status[k]).strip() for k in ("reason", "message") if status.get(k))
    if why:
        parts.append(why)
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            detail = ": ".join(str(cond[k]).strip() for k in ("reason", "message") if cond.get(k))
            parts.append(f"{cond.get('type')} {cond.get('status')}" + (f" ({detail})" if detail else ""))
    return "; ".join(parts)
