"""The agent's main loop: publish node facts, then watch PodSnapshots and restore pods forever."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import SnapshotError
from kubectl_snapshot.core.model import HostFacts
from shim import freezer, hostfacts, nodecheck
from shim.containerd.client import ContainerdClient
from shim.controller.node_install import DROPIN_NAME
from shim.controller.restores import RestoreWorker
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker
from shim.engine.checkpoint import recover_interrupted
from shim.engine.staging import StatePaths

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 240
RETRY_S = 2.0


def node_facts(settings: NodeSettings) -> HostFacts:
    with ContainerdClient(settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as c:
        version, _ = c.version()
    probe = hostfacts.HostProbe.host_from_container(criu=settings.criu)  # the installed CRIU, never the host's
    return hostfacts.gather(containerd_version=version, probe=probe)


def publish_facts(kube: Any, settings: NodeSettings, facts: HostFacts) -> None:
    data = {
        **facts.to_dict(),
        "runtimeHandler": os.path.exists(settings.wrapper_launcher),
        "node": node_status(settings, facts),
        "agentVersion": _version(),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        kube.patch_node_annotations(settings.node, {K.ANN_NODE_FACTS: json.dumps(data, sort_keys=True)})
    except SnapshotError as e:
        log.warning("could not publish node facts: %s", e)


def node_status(settings: NodeSettings, facts: HostFacts) -> dict[str, Any]:
    try:
        return nodecheck.node_status(
            wrapper_dir=settings.wrapper_dir,
            criu=settings.criu,
            socket=settings.containerd_socket,
            dropin_file=os.path.join(settings.containerd_dropin_dir, DROPIN_NAME),
            containerd_version=facts.containerd_version,
            cgroup=facts.cgroup_version,
        )
    except Exception as e:  # facts are best effort: never keep the agent from running
        log.exception("node status failed")
        return {"error": str(e)}


def _version() -> str:
    from kubectl_snapshot import __version__

    return __version__


def _loop(
    name: str,
    list_fn: Callable[[], Iterable[dict[str, Any]]],
    watch_fn: Callable[[], Iterator[tuple[str, dict[str, Any]]]],
    handle: Callable[[dict[str, Any]], None],
    ready: threading.Event,
    stop: threading.Event,
) -> None:
    """List, then watch, forever; every object is handed to `handle` (which must be idempotent)."""
    while not stop.is_set():
        try:
            for obj in list_fn():
                _safe(handle, obj, name)
            ready.set()
            for kind, obj in watch_fn():
                if stop.is_set():
                    return
                if kind in ("ADDED", "MODIFIED"):
                    _safe(handle, obj, name)
        except SnapshotError as e:
            log.warning("%s watch: %s; retrying", name, e)
            stop.wait(RETRY_S)
        except Exception:
            log.exception("%s watch failed; retrying", name)
            stop.wait(RETRY_S)


def _safe(handle: Callable[[dict[str, Any]], None], obj: dict[str, Any], name: str) -> None:
    try:
        handle(obj)
    except Exception:
        log.exception("%s: handling %s failed", name, (obj.get("metadata") or {}).get("name"))


def run(
    kube: Any,
    settings: NodeSettings,
    *,
    ready_file: str = K.READY_FILE,
    stop: threading.Event | None = None,
) -> None:
    stop = stop or threading.Event()
    facts = node_facts(settings)
    log.info("agent on node %s: %s", settings.node, facts)
    with ContainerdClient(settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as containerd:
        thawed = recover_interrupted(containerd, StatePaths(settings.state_dir), freezer.lookup)
    if thawed:
        log.warning("thawed containers an interrupted snapshot had left frozen: %s", ", ".join(thawed))
    publish_facts(kube, settings, facts)
    snapshots = SnapshotWorker(kube=kube, settings=settings, facts=facts)
    restores = RestoreWorker(kube=kube, settings=settings, facts=facts)
    field = f"spec.nodeName={settings.node}"
    ready_snap, ready_restore = threading.Event(), threading.Event()
    threads = [
        threading.Thread(
            target=_loop,
            name="snapshots",
            args=(
                "podsnapshots",
                lambda: kube.list_snapshots(None),
                lambda: kube.watch_snapshots(None, timeout_s=WATCH_TIMEOUT_S),
                snapshots.consider,
                ready_snap,
                stop,
            ),
            daemon=True,
        ),
        threading.Thread(
            target=_loop,
            name="restores",
            args=(
                "restore pods",
                lambda: kube.list_pods(None, field_selector=field),
                lambda: kube.watch_pods(field_selector=field, namespace=None, timeout_s=WATCH_TIMEOUT_S),
                restores.consider,
                ready_restore,
                stop,
            ),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    while not (ready_snap.is_set() and ready_restore.is_set()):
        if stop.wait(0.2):
            return
    with open(ready_file, "w") as f:
        f.write("ready\n")
    log.info("agent ready")
    while not stop.wait(60):
        publish_facts(kube, settings, facts)
