"""The lazy phase of restored pods on this node: one LazySession per container (shim/engine/lazyrestore.py),
reported on the pod.

Once every page of a container is in, a LazyRestoreComplete Event says how many and how long. A page
that could not be fetched ends the container (its task killed through containerd, before the daemon's
connection goes: never a process on memory the kernel zero-filled) with a LazyRestoreFailed Warning saying
why, and the same save is restored eagerly (`Fallback`): the container's staging gate is taken again before
the kill, so the kubelet's restart waits at its create while the container's images and every page are
staged, then restores them as any eager restore. Where that staging fails too, a resume starts fresh (a
workload is never held down) and a `kubectl snapshot restore` is given up (the pod comes back whole or not
at all: shim/net/podrestore.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.errors import SnapshotError, render
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.sealing import Opener
from shim.controller.events import pod_event
from shim.controller.kube_api import KubeApi
from shim.criu.lazydaemon import listening
from shim.criu.pageserver import ServeStats
from shim.engine.hottraces import TRACES
from shim.engine.lazyrestore import LazySession, LazyStage, give_slot, session_failure
from shim.engine.node_ports import Registry
from shim.engine.precheck import check_staged
from shim.engine.restore import RestoreLimits, stage_artifact
from shim.engine.staging import FAILED, LAZY_PREFIX, READY, StagingGate, StatePaths
from shim.net.podrestore import PodRestore

log = logging.getLogger(__name__)
StopFn = Callable[[str, list[str]], list[str]]  # (pod uid, container names) -> those stopped
FALLBACK_RETRY_S = (5.0, 15.0)


@dataclass(frozen=True)
class Fallback:
    """An eager restore of the save a lazy restore came from, for a container whose lazy phase failed: the
    artifact as staging verified it (signature, provenance, digests), its registry client and opener."""

    artifact: Artifact
    registry: Registry
    opener: Opener | None
    paths: StatePaths
    limits: RestoreLimits
    resume: bool  # a policy's resume (a failure starts it fresh) or a `kubectl snapshot restore` (given up)
    retry_s: tuple[float, ...] = FALLBACK_RETRY_S  # the waits between tries of the eager staging

    def hold(self, uid: str, container: str) -> StagingGate | None:
        """Take the container's staging gate again, before it is stopped: the kubelet's restart waits."""
        try:
            return StagingGate(self.paths.pod_gate(uid, container))
        except (OSError, SnapshotError) as e:
            log.warning("pod %s: container %s's staging gate could not be taken again: %s", uid, container, e)
            return None

    def stage(self, kube: KubeApi, pod: dict[str, Any], container: str, gate: StagingGate) -> bool:
        """Stage `container` of the save eagerly and answer its gate; False where it could not be."""
        meta = pod["metadata"]
        uid, ns = str(meta["uid"]), str(meta["namespace"])
        staged = ""
        try:
            staged = self.paths.staged_by_pod(uid, container)
            config = self.artifact.config
            (record,) = [c for c in config.containers if c.name == container]
            one = replace(config, containers=(record,), volumes=(), volumes_layer=None)  # the volumes run on
            for delay in (*self.retry_s, None):  # a registry that went away for a moment: tried again
                shutil.rmtree(staged, ignore_errors=True)
                try:
                    stage_artifact(replace(self.artifact, config=one), [staged], registry=self.registry,
                                   paths=self.paths, limits=self.limits, opener=self.opener, namespace=ns)  # fmt: skip
                    break
                except SnapshotError as e:
                    if delay is None:
                        raise
                    log.warning("%s/%s: container %s staged eagerly: %s (again in %g s)",
                                ns, meta["name"], container, e.message, delay)  # fmt: skip
                    time.sleep(delay)
            check_staged(pod.get("spec") or {}, [(container, staged)], cache_dir=self.paths.image_cache())
            gate.answer(READY)
        except Exception as e:  # every way out answers the gate
            if staged:
                shutil.rmtree(staged, ignore_errors=True)
            give_up(kube, self.paths, pod, container, gate, e, resume=self.resume)
            return False
        finally:
            gate.release()
        message = (
            f"container {container} staged again, eagerly, from {self.artifact.reference} after its lazy restore failed"
        )
        log.info("%s/%s: %s", ns, meta["name"], message)
        pod_event(kube, pod, K.EVENT_RESTORE_STAGED, message)
        return True


def give_up(
    kube: KubeApi,
    paths: StatePaths,
    pod: dict[str, Any],
    container: str,
    gate: StagingGate,
    e: Exception,
    *,
    resume: bool,
) -> None:
    """The eager restore after a lazy one could not be staged: a resume starts the pod fresh, a restore is
    failed (its container not started from its image); the gate answered, a LazyRestoreFailed Warning."""
    meta = pod["metadata"]
    err = e if isinstance(e, SnapshotError) else SnapshotError(f"internal error: {e}")
    restored = PodRestore(paths.pod_dir(str(meta["uid"])))
    why = f"container {container}'s eager restore after its failed lazy restore: {err.message}"
    if resume:
        restored.start_fresh(why)
        gate.answer(READY, f"no restore: {why}")
        said = f"{why}; the pod starts fresh"
    else:
        restored.fail(why)
        gate.answer(FAILED, why)
        said = f"{why}; the container is not started from its image (a restored pod comes back whole)"
    log.error("%s/%s: %s", meta["namespace"], meta["name"], said)
    pod_event(kube, pod, K.EVENT_LAZY_RESTORE_FAILED, said, warning=True)


def start_sessions(
    kube: KubeApi,
    pod: dict[str, Any],
    stages: Sequence[LazyStage],
    *,
    criu: str,
    facts: HostFacts,
    registry_host: str,
    stop: StopFn,
    fallback: Fallback | None = None,
) -> list[LazySession]:
    """Serve each staged container's pages; returns once every daemon listens (raises: none left running,
    every slot given back). A container whose lazy phase fails is stopped, then restored eagerly from the
    same save by `fallback` (None: the kubelet starts it as the pod's restore record says)."""
    uid = str(pod["metadata"]["uid"])
    sessions: dict[str, LazySession] = {}  # by container

    def failed(container: str) -> Callable[[str], None]:
        def report(reason: str) -> None:
            gate = fallback.hold(uid, container) if fallback is not None else None  # before the stop
            if gate is not None:  # the session's end must not remove what the eager staging writes
                sessions[container].hand_over()
            stopped = stop(uid, [container])
            err = session_failure(container, registry_host, reason, again=gate is not None)
            log.error("%s/%s: %s (stopped %s)", pod["metadata"]["namespace"], pod["metadata"]["name"], err, stopped)
            pod_event(kube, pod, K.EVENT_LAZY_RESTORE_FAILED, render(err), warning=True)
            if fallback is not None and gate is not None:
                threading.Thread(target=fallback.stage, args=(kube, pod, container, gate),
                                 name=f"lazy-fallback-{container}", daemon=True).start()  # fmt: skip

        return report

    def done(container: str) -> Callable[[ServeStats, float], None]:
        def report(stats: ServeStats, seconds: float) -> None:
            message = (
                f"every page of container {container} is in: {stats.pages} pages "
                f"({stats.pages * 4096 / (1 << 20):.0f} MiB) served from {registry_host} in {seconds:.1f} s"
            )
            warmed = sessions[container].warmed
            if warmed:
                message += f"; the {warmed} chunks holding the pages its last lazy restore used first were fetched "
                message += "first"
            TRACES.remember(uid, container, sessions[container].trace())  # for the pod's next save
            pod_event(kube, pod, K.EVENT_LAZY_RESTORE_COMPLETE, message)

        return report

    try:
        for st in stages:
            session = LazySession(
                st,
                criu=[criu],
                criu_version=facts.criu_version,
                on_failure=failed(st.container),
                on_done=done(st.container),
            )
            sessions[st.container] = session
            session.start()
    except BaseException:
        for s in sessions.values():
            s.close()
        give_slot(len(stages) - len(sessions))
        raise
    return list(sessions.values())


AgainFn = Callable[[str, str], Callable[[], object] | None]


def end_orphaned(
    staged_root: str, stop: StopFn, report: Callable[[str, str, str], None], again: AgainFn | None = None
) -> list[str]:
    """At the agent's start: the lazily restored containers whose lazy phase an earlier agent did not see
    through (its sessions died with it, and the kernel zero-fills what had not come) are stopped, each
    reported with `report(pod uid, container, reason)`, and their dirs removed; staged dirs whose daemon
    is gone before their restore ran are removed (the wrapper then finds nothing to restore lazily).
    `again(pod uid, container)`, asked before the stop, takes the container's staging gate (the kubelet's
    restart then waits at its create) and returns what restores the same save eagerly, run in a thread of
    its own after the stop; None: nothing to restore it from, the kubelet starts it afresh.
    `staged_root`: the agent's staged/by-pod. Returns the dirs removed."""
    removed = []
    for uid in _listdir(staged_root):
        pod_dir = os.path.join(staged_root, uid)
        for name in _listdir(pod_dir):
            path = os.path.join(pod_dir, name)
            if name.startswith(LAZY_PREFIX) and os.path.isdir(path):
                container = name[len(LAZY_PREFIX) :]
                restage = again(uid, container) if again is not None else None
                stopped = stop(uid, [container])
                then = (
                    "; it is restored again, eagerly, from the same save" if restage is not None
                    else "; the kubelet starts it afresh"
                )  # fmt: skip
                reason = (
                    f"the node's agent restarted while container {container}'s memory was still being "
                    "fetched: it was stopped" + ("" if stopped else " (it was not running)") + then
                )
                report(uid, container, reason)
                if restage is not None:
                    threading.Thread(target=restage, name=f"lazy-again-{container}", daemon=True).start()
            elif not (os.path.isdir(path) and not os.path.islink(path) and listening(path)):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
