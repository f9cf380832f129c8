"""Stage restores for pods created on this node with the restore annotation.

The pod was created by the user (RBAC applies); its injected gate init container waits until this
agent has pulled and verified the snapshot, extracted each container's data where the runtime
wrapper looks for it (by pod uid + container name) and put the emptyDir contents into the pod's
volume dirs. Only then does the kubelet create the app containers, which the wrapper restores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from typing import Any

from kubectl_snapshot.cli.errors import render
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition, SnapshotError
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.reference import Reference
from shim import hostfacts
from shim.controller.events import pod_event
from shim.controller.podinfo import empty_dir_path
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import registry_for
from shim.engine.artifact import load_artifact
from shim.engine.restore import stage_artifact
from shim.engine.staging import StatePaths
from shim.metrics import AgentMetrics
from shim.podrestore import PodRestore

log = logging.getLogger(__name__)
VOLUME_WAIT_S = 120.0
# Labels containerd's CRI plugin puts on a pod's containers.
LABEL_POD_UID = "io.kubernetes.pod.uid"
LABEL_CONTAINER_NAME = "io.kubernetes.container.name"
LABEL_CRI_KIND = "io.cri-containerd.kind"


def wants_restore(pod: dict[str, Any], node: str) -> bool:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    return (
        K.ANN_RESTORE_FROM in annotations
        and K.ANN_RESTORE_STATUS not in annotations
        and spec.get("nodeName") == node
        and not meta.get("deletionTimestamp")
    )


class RestoreWorker:
    def __init__(
        self, *, kube: Any, settings: NodeSettings, facts: HostFacts, metrics: AgentMetrics | None = None
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.facts = facts
        self.metrics = metrics or AgentMetrics()
        self.paths = StatePaths(settings.state_dir)
        self._seen: set[str] = set()
        self._failed: set[str] = set()

    def consider(self, pod: dict[str, Any]) -> None:
        if not wants_restore(pod, self.settings.node):
            self.follow(pod)
            return
        uid = pod["metadata"]["uid"]
        if uid in self._seen:
            return
        self._seen.add(uid)
        started = time.monotonic()
        with self.metrics.in_progress.labels("restore").track_inprogress():
            ok = self.run(pod)
        if ok:
            self.metrics.restored(time.monotonic() - started)
        else:
            self.metrics.restore_failed()

    def run(self, pod: dict[str, Any]) -> bool:
        """Stage the pod's restore and open its gate; False when it failed (the gate says why)."""
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        gate = empty_dir_path(self.settings.kubelet_root, uid, K.GATE_VOLUME)
        staged: list[str] = []
        try:
            ref = Reference.parse(meta["annotations"][K.ANN_RESTORE_FROM])
            secret = meta["annotations"].get(K.ANN_REGISTRY_SECRET)
            registry = registry_for(self.kube, ns, secret, insecure=False)
            artifact = load_artifact(registry, ref)
            config = artifact.config
            problems = hostfacts.preflight_problems(config.host, self.facts)
            if problems:
                raise FailedPrecondition(
                    f"node {self.settings.node} cannot restore {ref}: {'; '.join(problems)}",
                    hint="restore on a node that has CRIU and matches the snapshot's (choose it with --node)",
                )
            app = {c["name"] for c in (pod.get("spec") or {}).get("containers") or []}
            missing = [c.name for c in config.containers if c.name not in app]
            if missing:
                raise FailedPrecondition(
                    f"the pod has no container named {', '.join(missing)} that the snapshot holds",
                    hint="create the pod with `kubectl snapshot restore`, which copies the recorded spec",
                )
            targets = []
            for vol in config.volumes:
                target = empty_dir_path(self.settings.kubelet_root, uid, vol.name)
                targets.append(target)
            self._wait_for_dirs([gate, *targets])
            staged = [self.paths.staged_by_pod(uid, c.name) for c in config.containers]
            # Before anything is staged: the runtime wrapper restores the pod whole or not at all.
            PodRestore(self.paths.pod_dir(uid)).record([c.name for c in config.containers])
            stage_artifact(artifact, staged, registry=registry, paths=self.paths, volume_targets=targets)
        except SnapshotError as e:
            for d in staged:
                shutil.rmtree(d, ignore_errors=True)
            self._fail(pod, gate, e)
            return False
        except Exception as e:  # never leave the gate closed forever
            log.exception("restore of %s/%s failed", ns, name)
            for d in staged:
                shutil.rmtree(d, ignore_errors=True)
            self._fail(pod, gate, SnapshotError(f"internal error: {e}"))
            return False
        self._open_gate(gate, K.GATE_STAGED_FILE, f"staged {artifact.reference}\n")
        self._annotate(pod, K.RESTORE_STAGED)
        pod_event(
            self.kube, pod, K.EVENT_RESTORE_STAGED, f"snapshot {artifact.reference} staged on {self.settings.node}"
        )
        return True

    def _wait_for_dirs(self, dirs: list[str]) -> None:
        deadline = time.monotonic() + VOLUME_WAIT_S
        while not all(os.path.isdir(d) for d in dirs):
            if time.monotonic() > deadline:
                missing = [d for d in dirs if not os.path.isdir(d)]
                raise FailedPrecondition(
                    f"the kubelet did not set up the pod's volumes in {VOLUME_WAIT_S:.0f}s: {', '.join(missing)}",
                    hint="the pod needs the emptyDir volumes of the snapshot and the gate volume",
                )
            time.sleep(0.2)

    def follow(self, pod: dict[str, Any]) -> None:
        """A staged pod of this node: report it failed (once) when the wrapper could not restore it whole."""
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        uid = str(meta.get("uid") or "")
        if meta.get("deletionTimestamp") and K.ANN_RESTORE_FROM in annotations:
            with contextlib.suppress(SnapshotError):  # the pod goes: so does its restore state
                shutil.rmtree(self.paths.pod_dir(uid), ignore_errors=True)
            return
        if (
            annotations.get(K.ANN_RESTORE_STATUS) != K.RESTORE_STAGED
            or (pod.get("spec") or {}).get("nodeName") != self.settings.node
            or uid in self._failed
        ):
            return
        try:
            state = PodRestore(self.paths.pod_dir(uid))
        except SnapshotError:
            return
        why = state.failed()
        if why is None:
            return
        self._failed.add(uid)
        stopped = self._stop_containers(uid)
        err = FailedPrecondition(
            f"the pod could not be restored whole: {why.strip()}",
            hint="no container of the pod was started from scratch"
            + (f" (stopped the restored ones: {', '.join(stopped)})" if stopped else "")
            + "; delete the pod, fix the cause and restore again",
        )
        self._annotate(pod, K.RESTORE_FAILED_PREFIX + err.message)
        pod_event(self.kube, pod, K.EVENT_RESTORE_FAILED, render(err), warning=True)

    def _stop_containers(self, uid: str) -> list[str]:
        """Kill the pod's running app containers: the wrapper refuses to create them again."""
        from shim.containerd.client import ContainerdClient  # the agent's adapter; not needed by pure tests

        stopped = []
        try:
            with ContainerdClient(self.settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as c:
                for info in c.list_containers():
                    labels = info.labels
                    if labels.get(LABEL_POD_UID) != uid or labels.get(LABEL_CRI_KIND) != "container":
                        continue
                    task = c.get_task(info.id)
                    if task is None or task.status not in ("running", "paused", "created"):
                        continue
                    with contextlib.suppress(SnapshotError):
                        c.kill_task(info.id, signal.SIGKILL, all=True)
                        stopped.append(labels.get(LABEL_CONTAINER_NAME, info.id))
        except SnapshotError as e:
            log.warning("could not stop the containers of pod %s: %s", uid, e)
        return sorted(stopped)

    def _fail(self, pod: dict[str, Any], gate: str, err: SnapshotError) -> None:
        message = render(err)
        with contextlib.suppress(SnapshotError, OSError):
            PodRestore(self.paths.pod_dir(pod["metadata"]["uid"])).fail(err.message)
        with contextlib.suppress(OSError):
            if os.path.isdir(gate):
                self._open_gate(gate, K.GATE_FAILED_FILE, message + "\n")
        self._annotate(pod, K.RESTORE_FAILED_PREFIX + err.message)
        pod_event(self.kube, pod, K.EVENT_RESTORE_FAILED, message, warning=True)

    @staticmethod
    def _open_gate(gate: str, name: str, content: str) -> None:
        tmp = os.path.join(gate, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        os.rename(tmp, os.path.join(gate, name))

    def _annotate(self, pod: dict[str, Any], value: str) -> None:
        meta = pod["metadata"]
        try:
            self.kube.patch_pod_annotations(meta["namespace"], meta["name"], {K.ANN_RESTORE_STATUS: value[:1000]})
        except SnapshotError:
            log.warning("could not annotate %s/%s", meta["namespace"], meta["name"])
