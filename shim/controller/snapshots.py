"""Take PodSnapshot objects for pods on this node and run the node engine for them.

Claiming is optimistic: the first agent to write `status.phase` with the object's resourceVersion
owns it; every other agent gets a conflict and lets go. The pod is looked up only in the
PodSnapshot's own namespace, so permission to create a PodSnapshot in namespace A never reaches a
pod in namespace B.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient
from kubectl_snapshot.adapters.signatures import load_trust
from kubectl_snapshot.core import finalsave as F
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import saveorder as O
from kubectl_snapshot.core import status as S
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.backlog import parse_bound
from kubectl_snapshot.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SnapshotError,
    SourcePodReplaced,
)
from kubectl_snapshot.core.freeze import FreezePlan, probe_budgets
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.podspec import check_snapshot_source
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import KeyProvider, KeyUse, Sealer
from shim import freeze_guard as guard
from shim.containerd.client import ContainerdClient
from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.controller.backlog import NamespaceBacklog
from shim.controller.dumpgate import DumpGate
from shim.controller.events import pod_event, snapshot_event
from shim.controller.kube_api import ContainerdFor, KubeApi, RegistryFor
from shim.controller.mounts import previous_repositories
from shim.controller.podinfo import empty_dirs, host_view, record_pod, running_containers
from shim.controller.settings import NodeSettings
from shim.controller.signing import NodeSigner
from shim.controller.workqueue import WorkQueue
from shim.criu import parasite
from shim.engine import criufail
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.node_ports import Freezer
from shim.engine.publish import CheckpointResult
from shim.engine.staging import StatePaths, check_key
from shim.host import freezer
from shim.net import dumplock, unixpeers
from shim.service.metrics import AgentMetrics

log = logging.getLogger(__name__)
SENT_KEPT = 4096  # pods whose last save's size the agent keeps for the save order (the most recent)
STATUS_INTERVAL_S = 1.0
STATUS_CLOSE_S = 10.0  # a progress write still in flight when the outcome is ready: waited for this long
RESULT_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def now() -> str:
    return T.rfc3339(time.time())


def registry_for(kube: KubeApi, namespace: str, secret: str | None, *, insecure: bool) -> RegistryClient:
    store = CredentialStore()
    if secret:
        try:
            obj = kube.get_secret(namespace, secret)
        except PermissionDenied as e:
            raise PermissionDenied(
                f"the agent may not read secret {namespace}/{secret}: {e.message}",
                hint=f"an admin of namespace {namespace} lets the agent read its registry Secrets with: kubectl "
                f"create rolebinding {K.AGENT_SECRETS_ROLE} -n {namespace} --clusterrole={K.AGENT_SECRETS_ROLE} "
                f"--serviceaccount={K.AGENT_NAMESPACE}:{K.AGENT_NAME}",
            ) from e
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
        self,
        *,
        kube: KubeApi,
        settings: NodeSettings,
        facts: HostFacts,
        clock: Callable[[], float] = time.monotonic,
        metrics: AgentMetrics | None = None,
        queue: WorkQueue | None = None,
        keys: KeyProvider | None = None,
        on_saved: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
        registries: RegistryFor | None = None,
        containerd: ContainerdFor | None = None,
        signer: NodeSigner | None = None,
        dump_gate: DumpGate | None = None,
    ) -> None:
        self.kube = kube
        # every save is signed with this node's own key (shim/controller/signing.py)
        self.signer = signer or NodeSigner(kube, settings.node, settings.state_dir)
        # the clients a snapshot uses: the real adapters unless a test passes fakes of the ports
        self.registries: RegistryFor = registries or (
            lambda ns, secret, insecure: registry_for(kube, ns, secret, insecure=insecure)
        )
        self.containerd: ContainerdFor = containerd or (
            lambda checkpointer: ContainerdClient(
                settings.containerd_socket,
                K.CONTAINERD_K8S_NAMESPACE,
                checkpointer=checkpointer,
                state_dir=settings.state_dir,  # RCU grace periods expedited while it dumps (shim/host/rcu.py)
            )
        )
        self.on_saved = on_saved  # after every good save: (PodSnapshot, pod); autosave's last-save annotation
        self.keys = keys  # encryption at rest: every snapshot sealed with its namespace's key
        self.settings = settings
        self.facts = facts
        self.clock = clock
        self.metrics = metrics or AgentMetrics()
        # Claimed snapshots run on the queue's workers, in core/saveorder.py's order; the watch goes on meanwhile.
        self.queue = queue or WorkQueue.inline()
        # how many of them freeze and dump at once (--dump-concurrency)
        self.dump_gate = dump_gate or DumpGate(1)
        # threat E2: what each namespace may have queued or running here (core/backlog.py)
        self.backlog = NamespaceBacklog(parse_bound(settings.namespace_backlog), "snapshots", settings.node)
        self._sent: dict[str, int] = {}  # pod uid -> bytes its last save sent (what its next is expected to)
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
                if self._write_recorded_result(obj):
                    return  # it had finished; only its status write had failed (issue 10)
                stopping = bool(spec.get("stop"))
                self._finish_failed(
                    obj,
                    None,
                    SnapshotError(
                        "the agent restarted while this snapshot ran; "
                        + (
                            "with stop, the pod may have been stopped after its snapshot was pushed"
                            if stopping
                            else "the pod was thawed and keeps running"
                        ),
                        hint="check the pod and the registry (kubectl snapshot list) before creating a new PodSnapshot"
                        if stopping
                        else "create a new PodSnapshot",
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
        final = (meta.get("labels") or {}).get(K.LABEL_FINAL_SAVE) == "true" and spec.get("stop")
        if final and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            # a final save stops only a pod that is already being terminated (core/finalsave.py): the
            # label that lets an agent create a stop save never stops a pod that would have run on
            self._claim_and_fail(
                obj,
                f"refused: {K.LABEL_FINAL_SAVE} is for the final save of a pod being terminated, and pod"
                f" {ns}/{pod['metadata']['name']} is not",
                "take a save with stop without that label (kubectl snapshot pod/NAME --stop)",
            )
            return
        try:
            check_snapshot_source(spec, pod)  # the pod the PodSnapshot was made for, not a new one of its name
        except SourcePodReplaced as e:
            if self._claim(obj):
                self._finish_failed(obj, None, e, event_reason=K.EVENT_SOURCE_POD_REPLACED)
            return
        # final saves first, then by deadline and size, namespaces in turn (issue 10, issue 43)
        order = self.order_of(obj, pod)
        # a namespace's burst is bounded: one more than it may have waiting or running here fails at once
        # (a final save, a pod's last chance, is never refused)
        refused = self.backlog.admit(ns, exempt=order.kind == O.URGENT)
        if refused is not None:
            if self._claim(obj):
                self._finish_failed(obj, pod, refused)
            return
        try:
            claimed = self._claim(obj)
        except BaseException:
            self.backlog.done(ns)
            raise
        if not claimed:
            self.backlog.done(ns)
            return

        def dropped(why: str) -> None:
            self.backlog.done(ns)
            self._finish_failed(obj, pod, FailedPrecondition(f"not started: {why}"))

        self.queue.submit(lambda: self._run_counted(obj, pod), key=ns, order=order, on_drop=dropped)

    def _run_counted(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        try:
            self._run_tracked(obj, pod)
        finally:
            self.backlog.done(obj["metadata"]["namespace"])

    def _remember_sent(self, uid: str, sent: int) -> None:
        """What a pod's next save is expected to send; the oldest pods' entries go past SENT_KEPT (pods
        come and go for as long as the agent runs)."""
        self._sent.pop(uid, None)
        self._sent[uid] = sent
        while len(self._sent) > SENT_KEPT:
            del self._sent[next(iter(self._sent))]

    def order_of(self, obj: dict[str, Any], pod: dict[str, Any]) -> O.SaveRequest:
        """Where the save of `obj` goes in the node's save queue (core/saveorder.py)."""
        labels = obj["metadata"].get("labels") or {}
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if labels.get(K.LABEL_FINAL_SAVE) == "true" and (obj.get("spec") or {}).get("stop"):
            kind, deadline = O.URGENT, F.thaw_by(pod)
        else:
            kind, deadline = (O.PERIODIC if labels.get(K.LABEL_POLICY) else O.USER), None
        return O.SaveRequest(pod=uid, kind=kind, deadline=deadline, estimate=self._sent.get(uid, 0))

    def _run_tracked(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        with self.metrics.in_progress.labels("snapshot").track_inprogress():
            self.run(obj, pod)

    def _claim(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        # Before the patch: the claim's own watch event (another thread) must not look like a restart.
        self._handled.add(meta.get("uid"))
        try:
            self.kube.patch_snapshot_status(
                meta["namespace"],
                meta["name"],
                S.claimed(node=self.settings.node, now=now(), generation=meta.get("generation")),
                resource_version=meta.get("resourceVersion"),
            )
        except FailedPrecondition:  # another agent won the race
            self._handled.discard(meta.get("uid"))
            return False
        return True

    def _claim_and_fail(self, obj: dict[str, Any], message: str, hint: str) -> None:
        # Every agent sees such an object; the claim makes exactly one of them report it.
        if self._claim(obj):
            self._finish_failed(obj, None, FailedPrecondition(message, hint=hint))

    # --- running ----------------------------------------------------------------------------------

    def run(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        meta = obj["metadata"]
        order = self.order_of(obj, pod)  # its rank at the dump gate, and a final save's thaw_by
        clamp = _ThawClamp(order.deadline)
        ns, name = meta["namespace"], meta["name"]
        started = f"snapshot {name} started on {self.settings.node}"
        snapshot_event(self.kube, obj, K.EVENT_SNAPSHOT_STARTED, started)
        pod_event(self.kube, pod, K.EVENT_SNAPSHOT_STARTED, started)
        reporter = _StatusReporter(self.kube, ns, name, self.clock)
        try:
            try:
                result = self._save(obj, pod, order, clamp, reporter)
            finally:
                reporter.close()  # no progress may land after the outcome written below
        except SnapshotError as e:
            if clamp.passed():
                e = type(e)(f"{O.thawed_message(name, F.THAW_MARGIN_S)}: {e.message}", hint=e.hint, details=e.details)
            self._finish_failed(obj, pod, e)
            return
        except Exception as e:  # a bug: still report it, never leave the object Running forever
            log.exception("snapshot %s/%s failed", ns, name)
            self._finish_failed(obj, pod, SnapshotError(f"internal error: {e}"))
            return
        self._finish_ok(obj, pod, result)

    def _save(
        self,
        obj: dict[str, Any],
        pod: dict[str, Any],
        order: O.SaveRequest,
        clamp: _ThawClamp,
        reporter: _StatusReporter,
    ) -> CheckpointResult:
        """The save itself: provenance recorded, the pod's containers checkpointed and pushed."""
        meta, spec = obj["metadata"], obj.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        # before anything is frozen: a save whose provenance is not recorded is never resumed from
        self._record_provenance(obj, pod)
        containers = running_containers(pod)
        # through the host's mount namespace: memory-backed emptyDirs are mounts made after the agent started
        root = host_view(self.settings.kubelet_root)
        volumes = empty_dirs(pod, root) if spec.get("includeVolumes", True) else {}
        registry = self.registries(ns, spec.get("registrySecret"), bool(spec.get("insecure")))
        target = Reference.parse(spec.get("destination", ""))
        registry.add_mount_sources(previous_repositories(self.kube, ns, str(spec.get("podName") or ""), target))
        signing_key = self.signer.key_for_save()
        trust = load_trust([self.settings.trust_dir]) if os.path.isdir(self.settings.trust_dir) else None
        req = CheckpointRequest(
            containers=containers.ids,
            names=containers.names,
            target=target,
            volumes=list(volumes.values()),
            volume_names=list(volumes.keys()),
            stop=bool(spec.get("stop")),
            group=pod["metadata"]["name"],
            namespace=ns,
            pod=record_pod(pod, self.settings.node),
            probe_budgets=probe_budgets(pod),
            ignore_liveness=bool(spec.get("ignoreLiveness")),
            signing_key=signing_key,
            cluster=trust.cluster if trust is not None else "",
            node=self.settings.node,
        )
        # the key first: a key store problem fails the snapshot before anything is frozen
        # (with the key broker: asked for this pod's save, which it checks runs on this node)
        use = KeyUse(ns, str(pod["metadata"]["name"]), str(pod["metadata"].get("uid") or ""))
        sealer = Sealer(self.keys.namespace_key(ns, create=True, use=use), ns) if self.keys is not None else None
        report = {"namespace": ns, "name": name, "uid": meta.get("uid", "")}
        checkpointer = RuncCheckpointer(self.settings.criu, self.settings.runc_path)  # the installed CRIU
        with (
            self._guard(report) as held,
            self.containerd(checkpointer) as containerd,
            self.dump_gate.phases(order, reporter.stage, name=name) as on_phase,
        ):
            return checkpoint(
                req,
                containerd=containerd,
                registry=registry,
                paths=StatePaths(self.settings.state_dir),
                on_phase=on_phase,
                on_bytes=reporter.bytes,
                before_stop=lambda: self._delete_pod(pod),
                host=self.facts,
                freezer_for=clamp.wrap(held.freezer_for),
                memory_of=freezer.task_memory,
                on_plan=reporter.plan,
                sealer=sealer,
                unix_links=unixpeers.find_cross_links,
                net_lock=dumplock.pod_network_locked,
                criu_lock=criufail.cleaned_after_failure,
                criu_cure=parasite.cured_after_failure,
            )

    def _record_provenance(self, obj: dict[str, Any], pod: dict[str, Any]) -> None:
        """Overwrite the pod/workload labels and the images annotation from the real pod (a tenant's own
        values never survive) and drop any claim a tenant wrote (docs/kubernetes.md)."""
        meta = obj["metadata"]
        pod_ns = pod["metadata"]["namespace"]
        workload = W.workload_of(pod, lambda rs: self.kube.get_replicaset(pod_ns, rs))
        self.kube.patch_snapshot_metadata(
            meta["namespace"],
            meta["name"],
            labels=W.provenance_labels(pod, workload),
            annotations={K.ANN_POD_IMAGES: W.encode_images(W.pod_images(pod)), K.ANN_CLAIMED_BY: None},
        )

    @contextlib.contextmanager
    def _guard(self, report: dict[str, str]) -> Iterator[guard.GuardClient]:
        """The freeze guard container beside the agent (DaemonSet), else a private one for this snapshot
        (it survives the agent's process, not a restart of the agent's container)."""
        if self.settings.guard_socket:
            yield guard.GuardClient(self.settings.guard_socket, report)
        else:
            with guard.private_guard(report) as client:
                yield client

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        """With stop: the pod object goes first, so that the kubelet does not restart what we kill."""
        meta = pod["metadata"]
        self.kube.delete_pod(meta["namespace"], meta["name"], grace_period_seconds=0)

    def _finish_ok(self, obj: dict[str, Any], pod: dict[str, Any], r: CheckpointResult) -> None:
        meta = obj["metadata"]
        outcome = S.Outcome(
            reference=str(r.reference),
            tag=str(r.tagged),
            size=r.size,
            frozen_by=r.frozen_by,
            timings_ms=r.timings_ms,
        )
        status = S.succeeded(outcome, node=self.settings.node, now=now(), generation=meta.get("generation"))
        if r.plan is not None:
            status.update(_plan_status(r.plan))
        # Issue 10: the pod may already be stopped; a failed status write must never leave the object
        # Running (an agent restart would then report "thawed, keeps running"). The result is kept on
        # the node first, the write retried, and a later pass (or the next agent) writes it.
        self._record_result(meta.get("uid"), status)
        if self._patch_with_retries(meta["namespace"], meta["name"], status):
            self._forget_result(meta.get("uid"))
        pod_meta = pod["metadata"]
        self._remember_sent(str(pod_meta.get("uid") or ""), r.uploaded or r.size)
        self.metrics.saved(
            pod_meta["namespace"], pod_meta["name"], timings_ms=r.timings_ms, size=r.size, uploaded=r.uploaded
        )
        message = f"snapshot {meta['name']} pushed as {r.reference} ({S.human_bytes(r.size)})"
        log.info(
            "%s/%s: %s; frozen %.0f ms, dumped to %s",
            meta["namespace"], meta["name"], message, r.timings_ms.get("freeze_ms", 0.0),
            "memory" if r.work_in_memory else "disk",
        )  # fmt: skip
        snapshot_event(self.kube, obj, K.EVENT_SNAPSHOT_SUCCEEDED, message)
        pod_event(self.kube, pod, K.EVENT_SNAPSHOT_SUCCEEDED, message)
        if self.on_saved is not None and not (obj.get("spec") or {}).get("stop"):
            self.on_saved(obj, pod)

    # --- results that must reach the API server -------------------------------------------------

    def _results_dir(self) -> str:
        return os.path.join(self.settings.state_dir, "results")

    def _result_path(self, uid: Any) -> str | None:
        try:
            return os.path.join(self._results_dir(), check_key(str(uid), "snapshot uid") + ".json")
        except SnapshotError:
            return None

    def _record_result(self, uid: Any, status: dict[str, Any]) -> None:
        path = self._result_path(uid)
        if path is None:
            return
        try:
            os.makedirs(self._results_dir(), mode=0o700, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(status, f)
            os.replace(path + ".tmp", path)
        except OSError as e:
            log.warning("could not keep the result of snapshot %s on the node: %s", uid, e)

    def _forget_result(self, uid: Any) -> None:
        path = self._result_path(uid)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _patch_with_retries(self, ns: str, name: str, status: dict[str, Any]) -> bool:
        for delay in (*RESULT_RETRY_S, None):
            try:
                self.kube.patch_snapshot_status(ns, name, status)
                return True
            except NotFound:
                return True  # the object is gone: nobody is left to tell
            except SnapshotError as e:
                if delay is None:
                    log.error("could not record the result of %s/%s (kept on the node, retried later): %s", ns, name, e)
                    return False
                time.sleep(delay)
        return False

    def _write_recorded_result(self, obj: dict[str, Any]) -> bool:
        """Write a result kept on the node for `obj`; True if there was one."""
        meta = obj["metadata"]
        path = self._result_path(meta.get("uid"))
        if path is None or not os.path.exists(path):
            return False
        try:
            with open(path) as f:
                status = json.load(f)
        except (OSError, ValueError):
            return False
        if self._patch_with_retries(meta["namespace"], meta["name"], status):
            self._forget_result(meta.get("uid"))
        return True

    def flush_results(self) -> None:
        """Retry the results whose status write failed (called periodically by the agent's main loop)."""
        try:
            names = os.listdir(self._results_dir())
        except OSError:
            return
        for name in names:
            if not name.endswith(".json"):
                continue
            uid = name[: -len(".json")]
            for obj in self._snapshots_with_uid(uid):
                self._write_recorded_result(obj)

    def _snapshots_with_uid(self, uid: str) -> list[dict[str, Any]]:
        try:
            return [o for o in self.kube.list_snapshots(None) if o["metadata"].get("uid") == uid]
        except SnapshotError:
            return []

    def _finish_failed(
        self,
        obj: dict[str, Any],
        pod: dict[str, Any] | None,
        err: SnapshotError,
        *,
        event_reason: str = K.EVENT_SNAPSHOT_FAILED,
    ) -> None:
        meta = obj["metadata"]
        status = S.failed(
            node=self.settings.node,
            now=now(),
            generation=meta.get("generation"),
            reason=type(err).__name__,
            message=err.message,
            hint=err.hint,
            details=err.details,
        )
        try:
            self.kube.patch_snapshot_status(meta["namespace"], meta["name"], status)
        except SnapshotError:
            log.exception("could not record the failure of %s/%s", meta["namespace"], meta["name"])
        self.metrics.save_failed()
        message = f"snapshot {meta['name']} failed: {err.message}"
        snapshot_event(self.kube, obj, event_reason, message, warning=True)
        if pod is not None:
            pod_event(self.kube, pod, K.EVENT_SNAPSHOT_FAILED, message, warning=True)


class _StatusReporter:
    """Writes a save's progress into its status at most once per interval (the API server is not a
    progress bar), from a thread of its own: the save never waits on the API server to say where it is
    (the dump's stage is reached with the pod frozen: a write there would lengthen the freeze). Only the
    latest progress waits to be written (a stage the writer did not reach in time is skipped); `close`,
    before the outcome is written, drops what is still waiting and waits for a write in flight, so that
    no progress lands after the outcome."""

    def __init__(self, kube: KubeApi, ns: str, name: str, clock: Callable[[], float]) -> None:
        self.kube, self.ns, self.name, self.clock = kube, ns, name, clock
        self.done = 0
        self.total = 0
        self.current = ""
        self._last = 0.0
        self._cv = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._writing = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def plan(self, plan: FreezePlan) -> None:
        self._post(_plan_status(plan))

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
        self._post(S.progress(stage=self.current, done=self.done, total=self.total))

    def _post(self, patch: dict[str, Any]) -> None:
        with self._cv:
            if self._closed:
                return
            self._pending = {**(self._pending or {}), **patch}
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="status-writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _write(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                patch, self._pending, self._writing = self._pending, None, True
            try:
                self.kube.patch_snapshot_status(self.ns, self.name, patch or {})
            except SnapshotError:
                log.warning("could not update the progress of %s/%s", self.ns, self.name)
            except Exception:  # a bug: the next progress is still written, the save goes on
                log.exception("could not update the progress of %s/%s", self.ns, self.name)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()

    def close(self, timeout: float = STATUS_CLOSE_S) -> None:
        """No more progress: what waits is dropped, a write in flight is waited for (up to `timeout`)."""
        with self._cv:
            self._closed, self._pending = True, None
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._writing, timeout)


class _ThawBy:
    """A freezer whose freeze never outlasts `thaw_by` (seconds since the epoch): the freeze guard thaws
    the container at whichever deadline comes first, the plan's or the save's (a final save's preStop
    hook end, issue 43)."""

    def __init__(self, inner: Freezer, thaw_by: float) -> None:
        self.inner, self.thaw_by = inner, thaw_by
        self.froze = False

    def ready(self) -> None:
        self.inner.ready()

    def freeze(self, *, deadline_s: float | None = None) -> None:
        left = max(0.1, self.thaw_by - time.time())
        self.inner.freeze(deadline_s=min(deadline_s, left) if deadline_s else left)
        self.froze = True

    def thaw(self) -> None:
        self.inner.thaw()

    def frozen(self) -> bool:
        return self.inner.frozen()


class _ThawClamp:
    """The freezers of one save, each held to the save's thaw_by (none: the plan's deadline alone)."""

    def __init__(self, thaw_by: float | None) -> None:
        self.thaw_by = thaw_by
        self.freezers: list[_ThawBy] = []

    def wrap(self, freezer_for: Callable[[int], Freezer | None]) -> Callable[[int], Freezer | None]:
        thaw_by = self.thaw_by
        if thaw_by is None:
            return freezer_for

        def wrapped(pid: int) -> Freezer | None:
            fz = freezer_for(pid)
            if fz is None:
                return None
            self.freezers.append(_ThawBy(fz, thaw_by))
            return self.freezers[-1]

        return wrapped

    def passed(self) -> bool:
        """The save froze its pod and its thaw_by has passed: the freeze guard thawed it there."""
        return self.thaw_by is not None and time.time() >= self.thaw_by and any(f.froze for f in self.freezers)


def _plan_status(plan: FreezePlan) -> dict[str, Any]:
    return {
        "expectedFreezeSeconds": round(plan.expected_s, 1),
        "freezeDeadlineSeconds": round(plan.deadline_s, 1),
    }
