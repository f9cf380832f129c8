"""What the agent reads from a Pod object (API JSON as a dict): containers, emptyDirs, the record.

Pure functions over dicts, so the rules are unit-tested without a cluster.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import PodRecord
from kubectl_snapshot.core.podspec import gate_container
from shim.engine.staging import check_key


@dataclass(frozen=True)
class PodContainers:
    ids: list[str]  # containerd ids, in pod spec order
    names: list[str]


def sidecars(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's native sidecars: init containers with ``restartPolicy: Always``, which run beside the app
    containers (the other init containers ran to completion before them and are not part of a snapshot)."""
    return [c for c in spec.get("initContainers") or [] if isinstance(c, dict) and c.get("restartPolicy") == "Always"]


def running_containers(pod: dict[str, Any]) -> PodContainers:
    """The pod's running containers with their containerd ids, its native sidecars first (in their
    order, as the kubelet starts them), then its app containers; every one must be running."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    if status.get("phase") != "Running":
        raise FailedPrecondition(
            f"{where} is {status.get('phase') or 'not running'}, not Running",
            hint="only running pods can be snapshotted",
        )
    _refuse_unfrozen_neighbours(pod, where)
    ids, names = [], []
    groups = ((sidecars(spec), "initContainerStatuses"), (spec.get("containers") or [], "containerStatuses"))
    for containers, statuses in groups:
        by_name = {cs.get("name"): cs for cs in status.get(statuses) or []}
        for c in containers:
            ids.append(_running_id(c["name"], by_name.get(c["name"]) or {}, where))
            names.append(c["name"])
    if not ids:
        raise FailedPrecondition(f"{where} has no containers")
    return PodContainers(ids, names)


def _running_id(name: str, cs: dict[str, Any], where: str) -> str:
    cid = cs.get("containerID") or ""
    if "running" not in (cs.get("state") or {}) or "://" not in cid:
        raise FailedPrecondition(
            f"container {name!r} of {where} is not running", hint="wait until every container runs"
        )
    runtime, _, bare = cid.partition("://")
    if runtime != "containerd":
        raise FailedPrecondition(
            f"{where} runs on {runtime}, not containerd", hint="kubectl-snapshot drives containerd nodes"
        )
    return bare


def _refuse_unfrozen_neighbours(pod: dict[str, Any], where: str) -> None:
    """Refuse a pod in which something that would not be frozen is running: an ephemeral (debug)
    container shares the pod's volumes (and, with a shared process namespace, the others' /proc/PID/root),
    so it could change the volumes while they are captured, or race links into them; it would also not
    come back on restore. (Native sidecars are frozen and dumped with the app containers.)"""
    running = [
        f"ephemeral container {cs.get('name')!r}"
        for cs in pod.get("status", {}).get("ephemeralContainerStatuses") or []
        if "running" in (cs.get("state") or {})
    ]
    if running:
        raise FailedPrecondition(
            f"{where} has {', '.join(running)} running, which the snapshot would not freeze",
            hint="snapshot pods without ephemeral debug containers; recreate the pod without them",
        )


def check_restore_pod(pod: dict[str, Any]) -> None:
    """Refuse a pod that carries the restore annotation but is not shaped as `kubectl snapshot restore`
    makes it (core/podspec.restore_pod): its only init container is the project's gate, which alone
    mounts the gate volume, a plain emptyDir. Anything else could run the tenant's code in the gate
    volume before the agent writes there, or put the gate where the agent does not expect it.
    """
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    hint = "create restore pods with `kubectl snapshot restore`; the agent touches no other pod's volumes"
    expected = gate_container("")
    inits = spec.get("initContainers") or []
    gate = inits[0] if inits and all(c.get("restartPolicy") == "Always" for c in inits[1:]) else {}
    # the API server adds the service account token mount to every container: other mounts are fine
    gate_mounts = [m for m in gate.get("volumeMounts") or [] if m.get("name") == K.GATE_VOLUME]
    why = ""
    if not inits or gate.get("name") != expected["name"]:
        why = f"its first init container must be the project's gate ({K.GATE_CONTAINER}), the others native sidecars"
    elif gate.get("command") != expected["command"] or gate.get("args"):
        why = "the gate container does not run the project's gate command"
    elif gate.get("restartPolicy"):
        why = "the gate container is a sidecar"
    elif [(m.get("mountPath"), m.get("subPath"), m.get("subPathExpr")) for m in gate_mounts] != [
        (K.GATE_MOUNT, None, None)
    ]:
        why = f"the gate container does not mount {K.GATE_VOLUME} (whole) at {K.GATE_MOUNT}"
    if why:
        raise FailedPrecondition(
            f"{where} is not a restore pod: {why} (init containers: {[c.get('name') for c in inits]})", hint=hint
        )
    gate_volumes = [v for v in spec.get("volumes") or [] if v.get("name") == K.GATE_VOLUME]
    if len(gate_volumes) != 1 or set(gate_volumes[0]) != {"name", "emptyDir"}:
        raise FailedPrecondition(f"{where} is not a restore pod: {K.GATE_VOLUME} is not an emptyDir", hint=hint)
    others = [
        c.get("name")
        for c in [*inits[1:], *(spec.get("containers") or []), *(spec.get("ephemeralContainers") or [])]
        if any(m.get("name") == K.GATE_VOLUME for m in c.get("volumeMounts") or [])
    ]
    if others:
        raise FailedPrecondition(
            f"{where} is not a restore pod: {', '.join(map(str, others))} mount(s) the gate volume", hint=hint
        )
    if spec.get("ephemeralContainers"):
        raise FailedPrecondition(f"{where} has ephemeral containers before its restore was staged", hint=hint)


def held_restore(pod: dict[str, Any]) -> bool:
    """A restore pod without the gate init container, as `kubectl snapshot restore` makes it where the
    nodes hold its containers (core/podspec.gate_needed): every container it has is held at its create
    by the runtime wrapper until this agent answers (the restore-from annotation reaches the wrapper:
    the runtime handler's pod_annotations), so no tenant code runs before the agent writes its
    volumes. Its init containers may only be native sidecars (held too) and nothing may name the gate
    volume; any other shape is checked as a gated restore pod (check_restore_pod), which refuses it."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if K.ANN_RESTORE_FROM not in (meta.get("annotations") or {}) or has_gate(pod):
        return False
    inits = spec.get("initContainers") or []
    return (
        all(c.get("restartPolicy") == "Always" for c in inits)
        and not any(v.get("name") == K.GATE_VOLUME for v in spec.get("volumes") or [])
        and not spec.get("ephemeralContainers")
    )


def has_gate(pod: dict[str, Any]) -> bool:
    """A pod made with the gate init container (`kubectl snapshot restore`, or a resume admitted before
    resumes went without one); a resuming pod without it is held by the runtime wrapper instead."""
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return bool(inits) and inits[0].get("name") == K.GATE_CONTAINER


def check_resume_pod(pod: dict[str, Any]) -> None:
    """A resuming pod without the gate init container: the runtime wrapper holds each of its containers
    at create until this agent answers, so none may have been created before (a node whose containerd
    does not pass the resume annotation to the wrapper yet), and no ephemeral container runs there."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    # a container waiting in (or refused by) the wrapper's create, as when an agent died while staging
    # this pod, never started: it has no running state and no terminated state with a start time
    started = [
        str(cs.get("name"))
        for key in ("initContainerStatuses", "containerStatuses")
        for cs in status.get(key) or []
        for state in (cs.get("state") or {}, cs.get("lastState") or {})
        if "running" in state or (state.get("terminated") or {}).get("startedAt")
    ]
    what = "restore" if K.ANN_RESTORE_FROM in (meta.get("annotations") or {}) else "resume"
    if started:
        raise FailedPrecondition(
            f"{where}: container(s) {', '.join(started)} started before this node's agent took up the {what}",
            hint=f"the node's containerd must pass the {what} annotation to the runtime "
            "(runtime handler pod_annotations, written by `ks-agent install-node`; containerd restarted since)",
        )
    if spec.get("ephemeralContainers"):
        raise FailedPrecondition(f"{where} has ephemeral containers before its resume was staged")


def restore_volume_names(pod: dict[str, Any], names: list[str]) -> None:
    """Each volume the snapshot restores must be an emptyDir of this pod (never the gate)."""
    volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
    for name in names:
        v = volumes.get(name)
        if name == K.GATE_VOLUME or v is None or "emptyDir" not in v:
            raise FailedPrecondition(
                f"the snapshot restores volume {name!r}, which is not an emptyDir of this pod",
                hint="create the pod with `kubectl snapshot restore`, which copies the recorded volumes",
            )


def empty_dir_rel(pod_uid: str, volume: str) -> str:
    """The emptyDir's directory relative to the kubelet's root (opened below it without links)."""
    check_key(pod_uid, "pod uid")
    check_key(volume, "volume name")
    return "/".join(("pods", pod_uid, "volumes", K.EMPTY_DIR_PLUGIN_DIR, volume))


def host_view(path: str) -> str:
    """`path` of the host as the agent reaches it with the mounts made after it started: through the
    host's mount namespace (facts.host_root: a host process's root, hostPID, held open). A memory-backed
    emptyDir is a tmpfs the kubelet mounts when the pod starts; the agent's own hostPath mount of the
    kubelet's root does not see it (no mount propagation, see kubectl_snapshot/deploy/agent.py).
    Outside a container: `path` itself."""
    from shim.host.facts import host_root

    root = host_root()
    return f"{root}{path}" if root else path


def empty_dir_path(kubelet_root: str, pod_uid: str, volume: str) -> str:
    return os.path.join(kubelet_root, "pods", pod_uid, "volumes", K.EMPTY_DIR_PLUGIN_DIR, volume)


def empty_dirs(pod: dict[str, Any], kubelet_root: str, *, skip: tuple[str, ...] = (K.GATE_VOLUME,)) -> dict[str, str]:
    """emptyDir volume name -> its directory on this node."""
    uid = pod["metadata"]["uid"]
    return {
        v["name"]: empty_dir_path(kubelet_root, uid, v["name"])
        for v in pod.get("spec", {}).get("volumes") or []
        if "emptyDir" in v and v["name"] not in skip
    }


def _strip_token_mounts(container: dict[str, Any], dropped: set[str]) -> dict[str, Any]:
    c = copy.deepcopy(container)
    mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") not in dropped]
    if mounts:
        c["volumeMounts"] = mounts
    else:
        c.pop("volumeMounts", None)
    return c


def record_pod(pod: dict[str, Any], node: str) -> PodRecord:
    """The sanitized pod spec the artifact keeps (docs/kubernetes.md): what `restore` recreates."""
    meta, spec, status = pod["metadata"], copy.deepcopy(pod.get("spec", {})), pod.get("status", {})
    image_ids = {
        cs.get("name"): cs.get("imageID") or ""
        for key in ("initContainerStatuses", "containerStatuses")
        for cs in status.get(key) or []
    }
    dropped = {v["name"] for v in spec.get("volumes") or [] if v["name"].startswith(K.SA_TOKEN_VOLUME_PREFIX)}
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in dropped]
    if not spec["volumes"]:
        del spec["volumes"]

    def pinned(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in containers:
            c = _strip_token_mounts(c, dropped)
            image = _pinned_image(c.get("image", ""), image_ids.get(c["name"], ""))
            if image:
                c["image"] = image
            out.append(c)
        return out

    spec["containers"] = pinned(spec.get("containers") or [])
    # native sidecars come back with the app containers; the other init containers already ran
    kept = pinned(sidecars(spec))
    for key in ("nodeName", "initContainers", "ephemeralContainers", "schedulingGates"):
        spec.pop(key, None)
    if kept:
        spec["initContainers"] = kept
    spec["metadata"] = {
        "labels": dict(meta.get("labels") or {}),
        "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(K.GROUP)},
    }
    return PodRecord(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""), node=node, spec=spec)


def _pinned_image(image: str, image_id: str) -> str:
    """`repo@sha256:...` for the image the kubelet actually ran (imageID may carry a scheme)."""
    ref = image_id.split("://", 1)[-1]
    if "@sha256:" not in ref:
        return ""
    digest = ref.split("@", 1)[1]
    repo = image.split("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
    return f"{repo}@{digest}"
