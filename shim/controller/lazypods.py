"""The lazy phase of restored pods on this node: one LazySession per container (shim/engine/lazyrestore.py),
reported on the pod.

Once every page of a container is in, a LazyRestoreComplete Event says how many and how long. A page
that could not be fetched ends the container (its task killed through containerd, before the daemon's
connection goes) with a LazyRestoreFailed Warning saying why: the kubelet then starts it afresh from its
image (the restore is used once), never with memory the kernel zero-filled.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import render
from kubectl_snapshot.core.model import HostFacts
from shim.controller.events import pod_event
from shim.controller.kube_api import KubeApi
from shim.criu.lazydaemon import listening
from shim.criu.pageserver import ServeStats
from shim.engine.lazyrestore import LazySession, LazyStage, give_slot, session_failure
from shim.engine.staging import LAZY_PREFIX

log = logging.getLogger(__name__)
StopFn = Callable[[str, list[str]], list[str]]  # (pod uid, container names) -> those stopped


def start_sessions(
    kube: KubeApi,
    pod: dict[str, Any],
    stages: Sequence[LazyStage],
    *,
    criu: str,
    facts: HostFacts,
    registry_host: str,
    stop: StopFn,
) -> list[LazySession]:
    """Serve each staged container's pages; returns once every daemon listens (raises: none left running,
    every slot given back)."""
    uid = str(pod["metadata"]["uid"])
    sessions: list[LazySession] = []

    def failed(container: str) -> Callable[[str], None]:
        def report(reason: str) -> None:
            stopped = stop(uid, [container])
            err = session_failure(container, registry_host, reason)
            log.error("%s/%s: %s (stopped %s)", pod["metadata"]["namespace"], pod["metadata"]["name"], err, stopped)
            pod_event(kube, pod, K.EVENT_LAZY_RESTORE_FAILED, render(err), warning=True)

        return report

    def done(container: str) -> Callable[[ServeStats, float], None]:
        def report(stats: ServeStats, seconds: float) -> None:
            message = (
                f"every page of container {container} is in: {stats.pages} pages "
                f"({stats.pages * 4096 / (1 << 20):.0f} MiB) served from {registry_host} in {seconds:.1f} s"
            )
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
            sessions.append(session)
            session.start()
    except BaseException:
        for s in sessions:
            s.close()
        give_slot(len(stages) - len(sessions))
        raise
    return sessions


def end_orphaned(staged_root: str, stop: StopFn, report: Callable[[str, str, str], None]) -> list[str]:
    """At the agent's start: the lazily restored containers whose lazy phase an earlier agent did not see
    through (its sessions died with it, and the kernel zero-fills what had not come) are stopped, each
    reported with `report(pod uid, container, reason)`, and their dirs removed; staged dirs whose daemon
    is gone before their restore ran are removed (the wrapper then finds nothing to restore lazily).
    `staged_root`: the agent's staged/by-pod. Returns the dirs removed."""
    removed = []
    for uid in _listdir(staged_root):
        pod_dir = os.path.join(staged_root, uid)
        for name in _listdir(pod_dir):
            path = os.path.join(pod_dir, name)
            if name.startswith(LAZY_PREFIX) and os.path.isdir(path):
                container = name[len(LAZY_PREFIX) :]
                stopped = stop(uid, [container])
                reason = (
                    f"the node's agent restarted while container {container}'s memory was still being "
                    "fetched: it was stopped" + ("" if stopped else " (it was not running)")
                    + "; the kubelet starts it afresh"
                )  # fmt: skip
                report(uid, container, reason)
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
