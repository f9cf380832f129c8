"""Take PodSnapshot objects for pods on this node and run the node engine for them.

Claiming is optimistic: the first agent to write `status.phase` with the object's resourceVersion
owns it; every other agent gets a conflict and lets go. The pod is looked up only in the
PodSnapshot's own namespace, so permission to create a PodSnapshot in namespace A never reaches a
pod in namespace B.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient
from kubectl_snapshot.cli.errors import render
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, SnapshotError
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.reference import Reference
from shim import freezer
from shim.containerd.client import ContainerdClient
from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.controller.events import pod_event
from shim.controller.podinfo import empty_dirs, record_pod, running_containers
from shim.controller.settings import NodeSettings
from shim.engine.checkpoint import CheckpointRequest, CheckpointResult, checkpoint
from shim.engine.staging import StatePaths

log = logging.getLogger(__name__)
STATUS_INTERVAL_S = 1.0


def now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def registry_for(kube: Any, namespace: str, secret: str | None, *, insecure: bool) -> RegistryClient:
    store = CredentialStore()
    if secret:
        obj = kube.get_secret(namespace, secret)
        data = (obj.get("data") or {}).get(".dockerconfigjson")
        if not data:
            raise InvalidArgument(
                f"secret {namespace}/{secret} has no .dockerconfigjson",
                hint="create it with `kubectl create secret docker-registry`",
            )
        store = CredentialStore.from_dockerconfigjson(base64.b64decode(data))
    return RegistryClient(credentials=store, plain_http=insecure)


class SnapshotWorker:
    def __init__(
        self, *, kube: Any, settings: NodeSettings, facts: HostFacts, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.facts = facts
        self.clock = clock
        self._handled: set[str | None] = set()  # uids this agent process claimed (stale events follow)

    # --- claiming ---------------------------------------------------------------------------------

    def consider(self, obj: dict[str, Any]) -> None:
        """Handle one PodSnapshot event: claim it if its pod runs here, then run it to the end."""
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        if status.get("phase"):
            # Claimed by this node in an earlier life of the agent and never finished: say so.
            if (
                status.get("phase") == K.PHASE_RUNNING
                and status.get("node") == self.settings.node
                and meta.get("uid") not in self._handled
            ):
                self._handled.add(meta.get("uid"))
                self._finish_failed(
                    obj,
                    None,
                    SnapshotError(
                        "the agent restarted while this snapshot ran; the pod was thawed and keeps running",
                        hint="create a new PodSnapshot",
                    ),
                )
            return
        ns = meta["namespace"]
        pod_ns = spec.get("podNamespace") or ns
        if pod_ns != ns:
            self._claim_and_fail(
                obj,
                f"refused: the pod {pod_ns}/{spec.get('podName')} is not in this PodSnapshot's namespace {ns}",
                "create the PodSnapshot in the pod's own namespace",
            )
            return
        try:
            pod = self.kube.get_pod(ns, spec.get("podName", ""))
        except NotFound:
            self._claim_and_fail(obj, f"pod {ns}/{spec.get('podName')} not found", "check the pod name")
            return
        if (pod.get("spec") or {}).get("nodeName") != self.settings.node:
            return
        if not self._claim(obj):
            return
        self.run(obj, pod)

    def _claim(self, obj: dict[str, Any], phase: str = K.PHASE_RUNNING) -> bool:
        meta = obj["metadata"]
        try:
            self.kube.patch_snapshot_status(
                meta["namespace"],
                meta["name"],
                {"phase": phase, "node": self.settings.node, "startTime": now(), "stage": "claimed"},
                resource_version=meta.get("resourceVersion"),
            )
        except FailedPrecondition:  # another agent won the race
            return False
        self._handled.add(meta.get("uid"))  # later events still show our Running claim: not a restart
        return True

    def _claim_and_fail(self, obj: dict[str, Any], message: str, hint: str) -> None:
        # Every agent sees such an object; the claim makes exactly one of them report it.
        if self._claim(obj):
            self._finish_failed(obj, None, FailedPrecondition(message, hint=hint))

    # --- running ----------------------------------------------------------------------------------

    def run(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        pod_event(self.kube, pod, K.EVENT_SNAPSHOT_STARTED, f"snapshot {name} started on {self.settings.node}")
        reporter = _StatusReporter(self.kube, ns, name, self.clock)
        try:
            containers = running_containers(pod)
            volumes = empty_dirs(pod, self.settings.kubelet_root) if spec.get("includeVolumes", True) else {}
            registry = registry_for(self.kube, ns, spec.get("registrySecret"), insecure=bool(spec.get("insecure")))
            req = CheckpointRequest(
                containers=containers.ids,
                names=containers.names,
                target=Reference.parse(spec.get("destination", "")),
                volumes=list(volumes.values()),
                volume_names=list(volumes.keys()),
                stop=bool(spec.get("stop")),
                group=pod["metadata"]["name"],
                namespace=ns,
                pod=record_pod(pod, self.settings.node),
            )
            with ContainerdClient(
                self.settings.containerd_socket,
                K.CONTAINERD_K8S_NAMESPACE,
                checkpointer=RuncCheckpointer(self.settings.criu, self.settings.runc_path),  # the installed CRIU
            ) as containerd:
                result = checkpoint(
                    req,
                    containerd=containerd,
                    registry=registry,
                    paths=StatePaths(self.settings.state_dir),
                    on_phase=reporter.stage,
                    on_bytes=reporter.bytes,
                    before_stop=lambda: self._delete_pod(pod),
                    host=self.facts,
                    freezer_for=freezer.lookup,
                )
        except SnapshotError as e:
            self._finish_failed(obj, pod, e)
            return
        except Exception as e:  # a bug: still report it, never leave the object Running forever
            log.exception("snapshot %s/%s failed", ns, name)
            self._finish_failed(obj, pod, SnapshotError(f"internal error: {e}"))
            return
        self._finish_ok(obj, pod, result)

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        """With stop: the pod object goes first, so that the kubelet does not restart what we kill."""
        meta = pod["metadata"]
        self.kube.delete_pod(meta["namespace"], meta["name"], grace_period_seconds=0)

    def _finish_ok(self, obj: dict[str, Any], pod: dict[str, Any], r: CheckpointResult) -> None:
        meta = obj["metadata"]
        t = r.timings_ms
        status = {
            "phase": K.PHASE_SUCCEEDED,
            "node": self.settings.node,
            "stage": "done",
            "bytesDone": r.size,
            "bytesTotal": r.size,
            "timings": {
                "freezeMs": round(t.get("freeze_ms", 0), 1),
                "dumpMs": round(t.get("dump_ms", 0), 1),
                "packageMs": round(t.get("package_ms", 0), 1),
                "uploadMs": round(t.get("upload_ms", 0), 1),
                "totalMs": round(t.get("total_ms", 0), 1),
            },
            "frozenBy": r.frozen_by,
            "reference": str(r.reference),
            "tag": str(r.tagged),
            "size": r.size,
            "message": f"pushed {r.reference}",
            "completionTime": now(),
            "conditions": [_condition("Succeeded", "True", "Pushed", f"pushed {r.reference}")],
        }
        self.kube.patch_snapshot_status(meta["namespace"], meta["name"], status)
        pod_event(self.kube, pod, K.EVENT_SNAPSHOT_SUCCEEDED, f"snapshot {meta['name']} pushed as {r.reference}")

    def _finish_failed(self, obj: dict[str, Any], pod: dict[str, Any] | None, err: SnapshotError) -> None:
        meta = obj["metadata"]
        message = render(err)
        status = {
            "phase": K.PHASE_FAILED,
            "node": self.settings.node,
            "stage": "failed",
            "message": message,
            "completionTime": now(),
            "conditions": [_condition("Succeeded", "False", type(err).__name__, err.message)],
        }
        try:
            self.kube.patch_snapshot_status(meta["namespace"], meta["name"], status)
        except SnapshotError:
            log.exception("could not record the failure of %s/%s", meta["namespace"], meta["name"])
        if pod is not None:
            pod_event(self.kube, pod, K.EVENT_SNAPSHOT_FAILED, message, warning=True)


class _StatusReporter:
    """Writes progress into status at most once per interval (the API server is not a progress bar)."""

    def __init__(self, kube: Any, ns: str, name: str, clock: Callable[[], float]) -> None:
        self.kube, self.ns, self.name, self.clock = kube, ns, name, clock
        self.done = 0
        self.total = 0
        self.current = ""
        self._last = 0.0

    def stage(self, stage: str) -> None:
        self.current = stage
        self._flush(force=True)

    def bytes(self, n: int, total: int) -> None:
        self.done += n
        self.total = total
        self._flush()

    def _flush(self, force: bool = False) -> None:
        t = self.clock()
        if not force and t - self._last < STATUS_INTERVAL_S:
            return
        self._last = t
        try:
            self.kube.patch_snapshot_status(
                self.ns, self.name, {"stage": self.current, "bytesDone": self.done, "bytesTotal": self.total}
            )
        except SnapshotError:
            log.warning("could not update the progress of %s/%s", self.ns, self.name)


def _condition(type_: str, status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message[:1000], "lastTransitionTime": now()}
