"""The agent's main loop: publish node facts, then watch PodSnapshots and restore pods forever."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kubectl_snapshot.adapters.keybroker import BrokerKeyProvider
from kubectl_snapshot.adapters.keystore import SecretKeyProvider
from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import saveorder as O
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import SnapshotError
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.sealing import KeyProvider
from shim.containerd.client import ContainerdClient
from shim.controller.dumpgate import DumpGate
from shim.controller.fairness import FairScheduler
from shim.controller.finalsave import FinalSaver
from shim.controller.informer import Informer
from shim.controller.kube_api import KubeApi
from shim.controller.node_install import DROPIN_NAME
from shim.controller.policies import Autosave
from shim.controller.restores import RestoreWorker
from shim.controller.settings import NodeSettings
from shim.controller.signing import NodeSigner
from shim.controller.snapshots import SnapshotWorker, registry_for
from shim.controller.workqueue import WorkQueue
from shim.engine.checkpoint import recover_interrupted
from shim.engine.hottraces import TRACES
from shim.engine.lazyrestore import wait_until_idle
from shim.engine.staging import StatePaths
from shim.host import diskspace, freezer
from shim.host import facts as hostfacts
from shim.net import dumplock
from shim.service import metrics_server, nodecheck
from shim.service.metrics import AgentMetrics

log = logging.getLogger(__name__)
STOP_LAZY_WAIT_S = 20.0  # of the DaemonSet's 30 s grace period (deploy/agent.py)
WATCH_TIMEOUT_S = 60  # each watch is re-opened from its last resourceVersion: cheap, so kept short
RESTORE_WORKERS = 4


def node_facts(settings: NodeSettings) -> HostFacts:
    with ContainerdClient(settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as c:
        version, _ = c.version()
    probe = hostfacts.HostProbe.host_from_container(criu=settings.criu)  # the installed CRIU, never the host's
    return hostfacts.gather(containerd_version=version, probe=probe)


def publish_facts(kube: KubeApi, settings: NodeSettings, facts: HostFacts) -> None:
    data = {
        **facts.to_dict(),
        "runtimeHandler": os.path.exists(settings.wrapper_launcher),
        "node": node_status(settings, facts),
        "agentVersion": _version(),
        "updated": T.rfc3339(time.time()),
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


def serve_metrics(
    kube: metrics_server.ReviewApi, metrics: AgentMetrics, address: str, node: str, *, audiences: str
) -> None:
    """HTTPS on HOST:PORT (":9443" = every address) for scrapers the API server authorises, with tokens
    for `audiences` (comma-separated); the agent works on without metrics if the port cannot be had (logged)."""
    host, _, port = address.rpartition(":")
    names = [n for n in (os.environ.get("POD_IP"), node, "localhost", "127.0.0.1") if n]
    authorizer = metrics_server.Authorizer(kube, audiences=metrics_server.audiences_of(audiences))
    try:
        metrics_server.serve(metrics.registry, authorizer, host=host or "0.0.0.0", port=int(port), names=names)
    except (OSError, ValueError) as e:
        log.error("metrics: cannot serve on %r: %s; the agent runs without metrics", address, e)
        return
    log.info("metrics: https://%s%s for authorised scrapers", address, metrics_server.METRICS_PATH)


def node_informers(
    kube: KubeApi, node: str, on_snapshot: Callable[[dict[str, Any]], None], on_pod: Callable[[dict[str, Any]], None]
) -> list[Informer]:
    """What this node's agent watches, and nothing more (its cost does not grow with the cluster):

    - PodSnapshots claimed by this node (``status.node=NODE``: to report those a restart interrupted)
      and those nobody claimed yet (``status.node=``, a CRD selectable field: absent reads as empty);
      once another node's agent claims one, it leaves this agent's watch;
    - pods scheduled to this node (restores are staged for them).
    """

    def snapshots(selector: str) -> Informer:
        return Informer(
            name=f"podsnapshots {selector}",
            list_fn=lambda: kube.list_snapshots_versioned(None, field_selector=selector),
            watch_fn=lambda rv: kube.watch_snapshots(
                None, timeout_s=WATCH_TIMEOUT_S, field_selector=selector, resource_version=rv
            ),
            handle=on_snapshot,
        )

    pods = f"spec.nodeName={node}"
    return [
        snapshots(f"{K.SNAPSHOT_NODE_FIELD}={node}"),
        snapshots(f"{K.SNAPSHOT_NODE_FIELD}="),
        Informer(
            name="restore pods",
            list_fn=lambda: kube.list_pods_versioned(None, field_selector=pods),
            watch_fn=lambda rv: kube.watch_pods(
                field_selector=pods, namespace=None, timeout_s=WATCH_TIMEOUT_S, resource_version=rv
            ),
            handle=on_pod,
        ),
    ]


def autosave_informers(kube: KubeApi, autosave: Autosave) -> list[Informer]:
    """SnapshotPolicies of every namespace (few, small): each agent runs the schedule for its own pods."""
    return [
        Informer(
            name="snapshotpolicies",
            list_fn=lambda: kube.list_policies_versioned(None),
            watch_fn=lambda rv: kube.watch_policies(None, timeout_s=WATCH_TIMEOUT_S, resource_version=rv),
            handle=autosave.policy_changed,
            on_delete=autosave.policy_gone,
        )
    ]


def run(
    kube: KubeClient,
    settings: NodeSettings,
    *,
    ready_file: str = K.READY_FILE,
    stop: threading.Event | None = None,
    metrics_address: str = "",
) -> None:
    stop = stop or threading.Event()
    metrics = AgentMetrics()
    # one disk ledger for the node's dumps and restores (this process's), and what it holds in the metrics
    diskspace.NODE.configure(settings.disk)
    metrics.track_disk(diskspace.NODE.held)
    if metrics_address:
        serve_metrics(kube, metrics, metrics_address, settings.node, audiences=settings.metrics_token_audiences)
    facts = node_facts(settings)
    log.info("agent on node %s: %s", settings.node, facts)
    TRACES.keep_in(StatePaths(settings.state_dir).hot_trace)  # a restart keeps what restores recorded
    with ContainerdClient(settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as containerd:
        thawed = recover_interrupted(
            containerd, StatePaths(settings.state_dir), freezer.lookup, dumplock.release_leftover
        )
    if thawed:
        log.warning("thawed containers an interrupted snapshot had left frozen: %s", ", ".join(thawed))
    publish_facts(kube, settings, facts)
    # this node's own signing key, registered in the trust ConfigMap before its first save
    signer = NodeSigner(kube, settings.node, settings.state_dir)
    signer.try_register()
    # issue 43: several saves at once (a node's notice is too short to save its pods in turn), one CRIU
    # dump at a time by default so that each freeze stays short while the others package and upload
    save_workers = O.worker_count(settings.save_concurrency, os.cpu_count(), what="--save-concurrency")
    dump_slots = O.worker_count(settings.dump_concurrency, None, what="--dump-concurrency", default_min=1)
    log.info("saves: %d at once, %d freezing and dumping at once", save_workers, dump_slots)
    queue = WorkQueue("snapshots", on_length=metrics.queue.set, workers=save_workers)
    # encryption at rest is on: namespace keys in one Secret of the agent's namespace (adapters/keystore.py),
    # or, installed with the key broker (the default), behind it (adapters/keybroker.py), which alone reads it
    broker_url = os.environ.get(K.ENV_KEY_BROKER, "")
    keys: KeyProvider = BrokerKeyProvider(broker_url) if broker_url else SecretKeyProvider(kube)
    log.info("namespace keys: %s", f"the key broker at {broker_url}" if broker_url else "the key Secret")
    autosave = Autosave(
        kube,
        settings.node,
        registry_for=lambda ns, secret, insecure: registry_for(kube, ns, secret, insecure=insecure),
    )
    snapshots = SnapshotWorker(
        kube=kube,
        settings=settings,
        facts=facts,
        metrics=metrics,
        queue=queue,
        keys=keys,
        on_saved=autosave.on_saved,
        signer=signer,
        dump_gate=DumpGate(dump_slots),
    )
    # Issue 10: restores run per namespace in turn, two per namespace and four in all, so one
    # namespace cannot starve another and a slow registry holds up one restore, not the next.
    restores = RestoreWorker(
        kube=kube,
        settings=settings,
        facts=facts,
        metrics=metrics,
        scheduler=FairScheduler(workers=RESTORE_WORKERS, per_key=2, name="restore"),
        keys=keys,
    )

    for path in restores.end_orphaned_lazy():  # before any restore of this agent: none of them is its own
        log.info("removed what an earlier agent's lazy restore left: %s", path)
    # issue 13: a protected pod being terminated is saved with stop before its containers get SIGTERM
    final = FinalSaver(kube, settings.node, policy_of=autosave.policy, workload_of=autosave.workload)

    def on_pod(pod: dict[str, Any]) -> None:
        restores.consider(pod)
        autosave.pod_changed(pod)
        final.pod_changed(pod)

    def on_pod_gone(pod: dict[str, Any]) -> None:
        autosave.pod_gone(pod)
        final.pod_gone(pod)

    informers = node_informers(kube, settings.node, snapshots.consider, on_pod)
    informers[-1].on_delete = on_pod_gone  # the node's pods: autosave and final save forget deleted ones
    informers += autosave_informers(kube, autosave)
    for inf in informers:
        threading.Thread(target=inf.run, name=inf.name, args=(stop,), daemon=True).start()
    while not all(inf.ready.is_set() for inf in informers):
        if stop.wait(0.2):
            return
    with open(ready_file, "w") as f:
        f.write("ready\n")
    log.info("agent ready")
    threading.Thread(target=autosave.run, name="autosave", args=(stop,), daemon=True).start()
    threading.Thread(target=final.run, name="final-save", args=(stop,), daemon=True).start()
    while not stop.wait(60):
        publish_facts(kube, settings, facts)
        for path in restores.collect_garbage():
            log.info("removed staged data of a pod that is gone: %s", path)
        snapshots.flush_results()
    if not wait_until_idle(STOP_LAZY_WAIT_S):  # a roll: the lazy phases served here finish first
        log.warning("stopping with lazy restores still serving pages: the next agent restores them again, eagerly")
