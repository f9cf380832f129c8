"""Stage restores for pods created on this node with the restore annotation.

The pod was created by the user (RBAC applies); its injected gate init container waits until this
agent has chosen and checked the save (provenance, the node's preflight, the pod's containers and
volumes). Then the agent takes a staging gate for each of the pod's other containers
(shim/engine/staging.py, "pod gates") and opens the pod's gate, so the kubelet creates the containers
while the agent pulls and verifies the save, extracts each container's data where the runtime wrapper
looks for it (by pod uid + container name) and puts the emptyDir contents into the pod's volume dirs.
The wrapper's create waits at its staging gate until the agent answers: "ready" (restore what is
staged, or for a resume that could not be staged, create it fresh) or "failed" (refuse: a restore
never runs a container from scratch in its place). A workload's resuming pod has no gate init
container: the wrapper holds its containers because of its resume annotation, and the agent takes
their gates as soon as it sees the pod, before it chooses the save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kubectl_snapshot.adapters.signatures import (
    authorize_restore,
    load_signed,
    load_trust,
    merge_trust,
    trust_from_data,
)
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.backlog import parse_bound
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, SnapshotError, render
from kubectl_snapshot.core.model import HostFacts
from kubectl_snapshot.core.podspec import pod_status_summary
from kubectl_snapshot.core.provenance import Grant, TrustPolicy, parse_grant
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import KeyProvider, KeyUse, Opener
from kubectl_snapshot.core.tokenclone import cloned_token_warning
from shim.controller.backlog import NamespaceBacklog
from shim.controller.events import pod_event
from shim.controller.fairness import FairScheduler
from shim.controller.kube_api import KubeApi
from shim.controller.lazypods import Fallback, end_orphaned, give_up, start_sessions
from shim.controller.podinfo import (
    check_restore_pod,
    check_resume_pod,
    empty_dir_rel,
    has_gate,
    held_restore,
    host_view,
    restore_volume_names,
    sidecars,
)
from shim.controller.resume_source import RESUME_WAIT_S, RestoreSource, Resumer, StartFresh
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import registry_for
from shim.engine.hottraces import TRACES, read_staged
from shim.engine.lazyrestore import LAZY_SLOTS, give_slot, take_slots
from shim.engine.node_ports import Registry
from shim.engine.precheck import check_staged
from shim.engine.restore import RestoreLimits, VolumeTarget, opener_for, stage_artifact
from shim.engine.staging import FAILED, READY, StagingGate, StatePaths, check_key
from shim.host import facts as hostfacts
from shim.host import private, safefs
from shim.net.podrestore import PodRestore
from shim.service.metrics import AgentMetrics

log = logging.getLogger(__name__)
# The kubelet itself waits 2 min for a pod's volumes and then tries again: so does the agent, once more.
VOLUME_WAIT_S = 300.0
POD_CHECK_S = 2.0  # while it waits: is the pod still there, and not rejected by the kubelet?
# Labels containerd's CRI plugin puts on a pod's containers.
LABEL_POD_UID = "io.kubernetes.pod.uid"
LABEL_CONTAINER_NAME = "io.kubernetes.container.name"
LABEL_CRI_KIND = "io.cri-containerd.kind"
GC_GRACE_S = 600.0  # staged data younger than this is never collected (a restore may be starting)
DOWNLOAD_GC_S = 6 * 3600.0  # partial downloads older than this belong to no live restore
WRAPPER_REFUSAL = "refusing to restore"  # how the runtime wrapper's image check starts its message
POD_FILE = ".pod"  # in staged/by-pod/UID/: the pod's namespace and name (container names never start with ".")
# in staged/by-pod/UID/ too: the save a lazy restore serves, for the eager restore of a container whose lazy
# phase an agent's restart ended (end_orphaned_lazy)
LAZY_SOURCE_FILE = ".restored-from"


def _owner(directory: str) -> tuple[str, str] | None:
    """The (namespace, name) of the pod that `directory` (a staged/by-pod dir) records, None when it records
    none (not made by this agent's staging, or unreadable)."""
    try:
        with open(os.path.join(directory, POD_FILE)) as f:
            owner = json.load(f)
        return str(owner["namespace"]), str(owner["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _age(path: str, now: float) -> float:
    try:
        return now - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def wants_restore(pod: dict[str, Any], node: str) -> bool:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    return (
        K.ANN_RESTORE_FROM in annotations
        and K.ANN_RESTORE_STATUS not in annotations
        and spec.get("nodeName") == node
        and not meta.get("deletionTimestamp")
    )


def wants_resume(pod: dict[str, Any], node: str) -> bool:
    """A new pod of a protected workload (the resume-policy annotation, set by admission) on this node."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    return (
        K.ANN_RESUME_POLICY in annotations
        and K.ANN_RESTORE_FROM not in annotations
        and K.ANN_RESTORE_STATUS not in annotations
        and spec.get("nodeName") == node
        and not meta.get("deletionTimestamp")
    )


def annotated_source(pod: dict[str, Any]) -> RestoreSource:
    annotations = pod["metadata"]["annotations"]
    lazy = annotations.get(K.ANN_RESTORE_MODE) == K.RESTORE_MODE_LAZY
    return RestoreSource(
        Reference.parse(annotations[K.ANN_RESTORE_FROM]), annotations.get(K.ANN_REGISTRY_SECRET), lazy=lazy
    )


def wrapper_refusal(pod: dict[str, Any], node: str) -> str:
    """The runtime wrapper's refusal of a staged pod's CRIU images, as the kubelet reports it in the
    container's status (CreateContainerError), once: the restore status then says Failed with it."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if (meta.get("annotations") or {}).get(K.ANN_RESTORE_STATUS) != K.RESTORE_STAGED or spec.get("nodeName") != node:
        return ""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        message = str(waiting.get("message") or "")
        if waiting.get("reason") == "CreateContainerError" and WRAPPER_REFUSAL in message:
            return f"container {cs.get('name')}: {message[message.index(WRAPPER_REFUSAL) :]}"
    return ""


class _Clock:
    """Where a staging's time went, for its log line and RestoreStaged Event."""

    LABELS = {
        "choose": "choosing the save",
        "check": "its config and provenance",
        "volumes": "the pod's volumes",
        "download": "download, verify, extract",
        "image check": "the image check",
    }

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.laps: list[tuple[str, float, str]] = []

    def lap(self, what: str, *, of_it: str = "") -> None:
        """`of_it`: a part of this lap worth naming (shown in brackets after it)."""
        now = time.monotonic()
        self.laps.append((what, now - self.last, of_it))
        self.last = now

    def __str__(self) -> str:
        # never raises: it runs after the pod's gates are answered, where a failure would lose the Event
        parts = ", ".join(f"{self.LABELS.get(w, w)} {s:.2f} s" + (f" ({n})" if n else "") for w, s, n in self.laps)
        return f"in {self.last - self.start:.2f} s ({parts})"


def _failure_reason(err: SnapshotError) -> str:
    """The Event reason of a restore that did not happen: refused (the images ask for more than the pod
    grants) or failed (anything else)."""
    return K.EVENT_RESTORE_REFUSED if err.message.startswith("refusing to restore") else K.EVENT_RESTORE_FAILED


def _refuse(err: SnapshotError) -> Callable[[dict[str, Any]], RestoreSource | StartFresh]:
    """A restore source that refuses: staged with it, the pod fails with `err` (status, Event, its gate)."""

    def source(pod: dict[str, Any]) -> RestoreSource | StartFresh:
        raise err

    return source


def gated_containers(pod: dict[str, Any]) -> list[str]:
    """Every container of the pod the kubelet may create once the pod's gate is open: its init
    containers after the gate, and its app containers (none may run on half-written volumes), an app
    container that happens to be named like the gate included (only the gate init container waits
    for the agent by itself)."""
    spec = pod.get("spec") or {}
    inits = [c.get("name") for c in spec.get("initContainers") or [] if c.get("name") != K.GATE_CONTAINER]
    names = [*inits, *(c.get("name") for c in spec.get("containers") or [])]
    return [str(n) for n in names if n]


class _PodGates:
    """The staging gates of one pod's containers (shim/engine/staging.py, "pod gates"), answered once."""

    def __init__(self) -> None:
        self._gates: list[StagingGate] = []

    def take(self, paths: StatePaths, uid: str, names: list[str]) -> None:
        for name in names:
            self._gates.append(StagingGate(paths.pod_gate(uid, name)))

    def answer(self, state: str, message: str = "") -> None:
        """Answer every gate not answered yet, then let go of it (it stays for later creates)."""
        for g in self._gates:
            if not g.answered:
                try:
                    g.answer(state, message[:4000])
                except OSError as e:  # its lock still goes with the fd: the hook then waits for a successor
                    log.warning("could not answer the staging gate %s: %s", g.path, e)
            g.release()


class RestoreWorker:
    def __init__(
        self,
        *,
        kube: KubeApi,
        settings: NodeSettings,
        facts: HostFacts,
        metrics: AgentMetrics | None = None,
        scheduler: FairScheduler | None = None,
        limits: RestoreLimits | None = None,
        keys: KeyProvider | None = None,
    ) -> None:
        self.kube = kube
        self.keys = keys
        self.settings = settings
        self.facts = facts
        self.metrics = metrics or AgentMetrics()
        self.paths = StatePaths(settings.state_dir)
        self.scheduler = scheduler  # None: run in the caller's thread (tests)
        self.limits = limits or RestoreLimits()
        self._seen: set[str] = set()
        self._failed: set[str] = set()
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self.resume = Resumer(kube, wait_s=RESUME_WAIT_S)
        # threat E2: what each namespace may have queued or running here (core/backlog.py)
        self.backlog = NamespaceBacklog(parse_bound(settings.namespace_backlog), "restores", settings.node)

    def consider(self, pod: dict[str, Any]) -> None:
        if self.follow(pod):  # not restored whole: reported with the wrapper's reason (it includes refusals)
            return
        refused = wrapper_refusal(pod, self.settings.node)
        if refused:
            self._annotate(pod, K.RESTORE_FAILED_PREFIX + refused)
            pod_event(self.kube, pod, K.EVENT_RESTORE_REFUSED, refused, warning=True)
            return
        if not (wants_restore(pod, self.settings.node) or wants_resume(pod, self.settings.node)):
            return
        uid = pod["metadata"]["uid"]
        if uid in self._seen:
            return
        self._seen.add(uid)
        ns = pod["metadata"]["namespace"]
        # a namespace's burst is bounded: one restore more than it may have waiting or running here fails at
        # once, its gate answered with the reason (a resume, a workload's replacement, is never refused)
        over = self.backlog.admit(ns, exempt=not wants_restore(pod, self.settings.node))
        if over is not None:
            self.stage(pod, _refuse(over))
            return
        if self.scheduler is None:
            self._run_tracked(pod)
        else:  # per namespace, in turn: one namespace's restores (or a slow registry) do not hold up others
            self.scheduler.submit(ns, lambda: self._run_tracked(pod))

    def _run_tracked(self, pod: dict[str, Any]) -> None:
        try:
            self._run_active(pod)
        finally:
            self.backlog.done(pod["metadata"]["namespace"])

    def _run_active(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            self._active.add(uid)
        try:
            started = time.monotonic()
            with self.metrics.in_progress.labels("restore").track_inprogress():
                ok = self.run(pod)
            if ok:
                self.metrics.restored(time.monotonic() - started)
            else:
                self.metrics.restore_failed()
        finally:
            with self._lock:
                self._active.discard(uid)

    def collect_garbage(self, *, now: float | None = None) -> list[str]:
        """Remove staged data of pods that are gone (deleted before their containers were created, say)
        and the downloads and node-level staging a crashed agent left; returns what was removed.

        Each pod's staged dir (and its gates' dir) records the pod's namespace and name (POD_FILE); only dirs older than
        GC_GRACE_S and not in use are looked at, one GET each, so a steady agent lists nothing."""
        now = time.time() if now is None else now
        removed: list[str] = []
        with self._lock:
            active = set(self._active)
        # staged data, and the pod's staging gates (they stay as long as the pod: a container restarted
        # later reads its answer again)
        for kind in ("by-pod", "pod-gates"):
            parent = os.path.join(self.paths.root, C.STAGING_SUBDIR, kind)
            for uid in _listdir(parent):
                path = os.path.join(parent, uid)
                if uid in active or _age(path, now) < GC_GRACE_S or self._pod_still_here(path, uid):
                    continue
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        # partial downloads, and a node-level restore's staged container dirs and private page dirs
        # (`.pages-*`): each is consumed or removed within its restore; one this old outlived an agent
        for parent in (self.paths.downloads(), os.path.join(self.paths.root, C.STAGING_SUBDIR, "by-id")):
            for name in _listdir(parent):
                path = os.path.join(parent, name)
                if _age(path, now) >= DOWNLOAD_GC_S:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                    removed.append(path)
        return removed

    def _pod_still_here(self, path: str, uid: str) -> bool:
        """True unless the API server says the pod that owns `path` is gone (errors: keep it)."""
        owner = _owner(path)
        if owner is None:
            return False  # not made by this agent's staging (or unreadable): nothing refers to it
        ns, name = owner
        try:
            pod = self.kube.get_pod(ns, name)
        except NotFound:
            return False
        except SnapshotError:
            return True
        return bool((pod.get("metadata") or {}).get("uid") == uid)

    def _record_owner(self, pod: dict[str, Any], d: str | None = None) -> None:
        """Name the pod that owns `d` (default: its staged dir), for garbage collection once it is gone."""
        meta = pod["metadata"]
        d = d or os.path.join(self.paths.root, C.STAGING_SUBDIR, "by-pod", check_key(meta["uid"], "pod uid"))
        private.makedirs(d)
        with private.create(os.path.join(d, POD_FILE)) as f:
            json.dump({"namespace": meta["namespace"], "name": meta["name"]}, f)

    def run(self, pod: dict[str, Any]) -> bool:
        """Stage the pod's restore (its restore-from annotation, or for a resuming pod the save of its
        predecessor that the resume chooses) and open its gate; False when it failed (the gate says why)."""
        annotations = pod["metadata"].get("annotations") or {}
        if K.ANN_RESTORE_FROM in annotations:
            return self.stage(pod, annotated_source)
        return self.stage(pod, self.resume.source)

    def stage(self, pod: dict[str, Any], source: Callable[[dict[str, Any]], RestoreSource | StartFresh]) -> bool:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        gates = _PodGates()
        gate: str | None = None  # the gate init container's volume (None: a pod held by the wrapper)
        try:
            restore = K.ANN_RESTORE_FROM in (meta.get("annotations") or {})
            gated = has_gate(pod) or (restore and not held_restore(pod))
            shape: SnapshotError | None = None
            if gated:
                try:
                    check_restore_pod(pod)
                    gate = empty_dir_rel(uid, K.GATE_VOLUME)
                except SnapshotError as e:
                    shape = e
            # Its containers wait at their create for these gates (the wrapper waits for those of a pod
            # with the restore or resume annotation to appear): taken first, so that every way out below
            # answers them, starting fresh and a pod refused as not a restore pod included.
            gates.take(self.paths, uid, gated_containers(pod))
            self._record_owner(pod, self.paths.pod_gates(uid))
            if shape is not None:
                raise shape
            if not gated:
                # what an agent that died while staging this pod left (its containers wait at the gates)
                shutil.rmtree(self.paths.pod_dir(uid), ignore_errors=True)
                try:
                    check_resume_pod(pod)
                except SnapshotError as e:  # what already runs there started fresh: so does the rest
                    if restore:  # a restore is refused instead (nothing of the snapshot is written)
                        raise
                    return self._start_fresh(pod, None, e.message, gates)
        except (SnapshotError, OSError) as e:
            err = e if isinstance(e, SnapshotError) else SnapshotError(f"internal error: {e}")
            # a pod that is not a restore pod is not ours to touch: no write into any of its volumes
            # (`gate` is set only once check_restore_pod passed: then its gate says why)
            self._fail(pod, gate, err)
            gates.answer(FAILED, render(err))
            return False
        staged: list[str] = []
        lazy = False  # node slots held for lazy sessions not started yet
        src: RestoreSource | None = None
        clock = _Clock()
        try:
            chosen = source(pod)
            clock.lap("choose")
            if isinstance(chosen, StartFresh):
                return self._start_fresh(pod, gate, chosen.reason, gates)
            src = chosen
            registry, artifact, opener = self._opened(pod, src)
            config = artifact.config
            spec = pod.get("spec") or {}
            clock.lap("check")
            restore_volume_names(pod, [v.name for v in config.volumes])
            root = host_view(self.settings.kubelet_root)
            targets = [VolumeTarget(root, empty_dir_rel(uid, vol.name)) for vol in config.volumes]
            self._wait_for_dirs(root, [*([gate] if gate else []), *(t.rel for t in targets)], pod)
            clock.lap("volumes")
            staged = [self.paths.staged_by_pod(uid, c.name) for c in config.containers]
            # Before anything is staged: the runtime wrapper restores the pod whole or not at all.
            PodRestore(self.paths.pod_dir(uid)).record([c.name for c in config.containers])
            self._record_owner(pod)  # for garbage collection once the pod is gone
            # The kubelet creates the containers while the save downloads; each create waits at its gate.
            if gate is not None:
                self._open_gate(gate, K.GATE_STAGED_FILE, f"staging {artifact.reference}\n")
            paged = sum(1 for c in config.containers if c.pages)  # a container without page files is not lazy
            lazy = src.lazy and self._lazy_slots(pod, paged)
            spent: dict[str, float] = {}
            stages = stage_artifact(
                artifact,
                staged,
                registry=registry,
                paths=self.paths,
                volume_targets=targets,
                limits=self.limits,
                opener=opener,
                namespace=ns,  # the tenant restoring: its restores together keep within its share
                lazy=lazy,
                timings=spent,
            )
            if lazy:
                give_slot(paged - len(stages))  # containers staged eagerly after all
            lazy = False  # the slots are the stages' from here
            clock.lap("download", of_it=f"of it the blobs' presence {spent.get('presence_ms', 0) / 1000:.2f} s")
            # what the image check at create would certainly refuse, refused now with its reason
            try:
                check_staged(
                    spec,
                    [(c.name, d) for c, d in zip(config.containers, staged, strict=True)],
                    cache_dir=self.paths.image_cache(),
                )
            except BaseException:
                give_slot(len(stages))
                raise
            read = {st.staged_dir: st.hot for st in stages or ()}  # a lazy stage read its layer's list already
            for c, d in zip(config.containers, staged, strict=True):  # to the pod's next save (a lazy phase's
                TRACES.remember(uid, c.name, read[d] if d in read else read_staged(d))  # own faults replace them)
            if stages:  # their daemons listen in the staged dirs before any create is let through
                self._record_lazy_source(uid, artifact.reference, src)
                again = Fallback(artifact, registry, opener, self.paths, self.limits, src.resume)
                start_sessions(self.kube, pod, stages, criu=self.settings.criu, facts=self.facts,
                               registry_host=artifact.reference.registry,
                               stop=lambda uid, names: self._stop_containers(uid, only=names),
                               fallback=again)  # fmt: skip
            gates.answer(READY)
            clock.lap("image check")
        except Exception as e:  # never leave a gate closed forever
            if lazy:  # failed while staging lazily: no session took the slots
                give_slot(paged)
            if not isinstance(e, SnapshotError):
                log.exception("restore of %s/%s failed", ns, name)
            err = e if isinstance(e, SnapshotError) else SnapshotError(f"internal error: {e}")
            for d in staged:
                shutil.rmtree(d, ignore_errors=True)
            if src is not None and src.resume:
                return self._resume_failed(pod, gate, src, err, gates)
            self._fail(pod, gate, err)
            gates.answer(FAILED, render(err))
            return False
        finally:
            gates.answer(FAILED, "internal error: the agent's staging ended without an answer")  # if none yet
        if gate is not None:
            with contextlib.suppress(OSError, SnapshotError):  # a record for whoever reads the pod's gate volume
                self._open_gate(gate, K.GATE_STAGED_FILE, f"staged {artifact.reference}\n")
        self._annotate(pod, K.RESTORE_STAGED)
        what = "resume from" if src.resume else "snapshot"
        message = f"{what} {artifact.reference} staged on {self.settings.node} {clock}"
        log.info("%s/%s: %s", ns, name, message)
        pod_event(self.kube, pod, K.EVENT_RESTORE_STAGED, message)
        cloned = cloned_token_warning(config)
        if cloned:
            pod_event(self.kube, pod, K.EVENT_CLONED_TOKEN, cloned, warning=True)
        return True

    def _opened(self, pod: dict[str, Any], src: RestoreSource) -> tuple[Registry, Artifact, Opener | None]:
        """The snapshot `src` names, read and checked for `pod` on this node: its registry client, the
        artifact (signature, provenance, namespace binding) and, when sealed, its opener."""
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        registry = registry_for(self.kube, ns, src.registry_secret, insecure=src.insecure)
        artifact, signatures = load_signed(registry, src.reference)
        config = artifact.config
        # provenance before anything else is fetched: signed by a key the cluster trusts, exactly
        # this digest, from this namespace or one that granted it (docs/security.md)
        allowed = authorize_restore(registry, artifact.reference, config, ns, self._trust(), self._grants, signatures)
        log.info("restore of %s into %s/%s allowed: %s", artifact.reference, ns, name, allowed.reason)
        problems = hostfacts.preflight_problems(config.host, self.facts)
        if problems:
            raise FailedPrecondition(
                f"node {self.settings.node} cannot restore {src.reference}: {'; '.join(problems)}",
                hint="restore on a node that has CRIU and matches the snapshot's (choose it with --node)",
            )
        spec = pod.get("spec") or {}
        app = {c["name"] for c in [*(spec.get("containers") or []), *sidecars(spec)]}
        missing = [c.name for c in config.containers if c.name not in app]
        if missing:
            raise FailedPrecondition(
                f"the pod has no container named {', '.join(missing)} that the snapshot holds",
                hint="create the pod with `kubectl snapshot restore`, which copies the recorded spec",
            )
        # an encrypted snapshot opens only in the namespace it was sealed for (before any download)
        # (a granted restore into another namespace opens it with the key of the namespace it is bound to)
        sealed_for_source = config.encryption is not None and config.encryption.namespace == allowed.source_namespace
        # (with the key broker: asked for this pod's restore of exactly this snapshot)
        use = KeyUse(
            ns, name, uid, snapshot=str(artifact.reference),
            manifest=artifact.manifest_bytes, config=artifact.config_bytes,
        )  # fmt: skip
        return registry, artifact, opener_for(config, self.keys, ns, other_namespace_ok=sealed_for_source, use=use)

    def _record_lazy_source(self, uid: str, reference: Reference, src: RestoreSource) -> None:
        record = {
            "reference": str(reference),  # by digest: the very save
            "registrySecret": src.registry_secret or "",
            "insecure": src.insecure,
            "resume": src.resume,
        }
        path = os.path.join(self.paths.pod_dir(uid), LAZY_SOURCE_FILE)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with private.create(path) as f:
            json.dump(record, f)

    def _again_eagerly(self, uid: str, container: str) -> Callable[[], object] | None:
        """For end_orphaned: the container's staging gate taken, and what stages the save its lazy restore
        served (its record) eagerly for it, verified again as any restore; None without a record."""
        try:
            with open(os.path.join(self.paths.pod_dir(uid), LAZY_SOURCE_FILE)) as f:
                record = json.load(f)
            owner = _owner(self.paths.pod_dir(uid))
            if owner is None:
                raise ValueError(f"{self.paths.pod_dir(uid)} names no pod")
            ns, name = owner
            src = RestoreSource(
                Reference.parse(str(record["reference"]), default_tag=None),
                str(record.get("registrySecret") or "") or None,
                insecure=bool(record.get("insecure")),
                resume=bool(record.get("resume")),
            )
        except (OSError, ValueError, KeyError, TypeError, SnapshotError) as e:
            log.warning("pod %s: container %s's lazy restore left no record of its save: %s", uid, container, e)
            return None
        try:
            gate = StagingGate(self.paths.pod_gate(uid, container))
        except (OSError, SnapshotError) as e:
            log.warning("pod %s: container %s's staging gate could not be taken again: %s", uid, container, e)
            return None

        def restage() -> None:
            try:
                pod = self.kube.get_pod(ns, name)
                if pod["metadata"].get("uid") != uid:
                    raise NotFound(f"pod {ns}/{name} is another pod now")
            except SnapshotError as e:
                log.warning("%s/%s: container %s not restored again: %s", ns, name, container, e.message)
                gate.release()
                return
            try:
                registry, artifact, opener = self._opened(pod, src)
            except Exception as e:  # the save can no longer be read or is refused: as a failed eager staging
                give_up(self.kube, self.paths, pod, container, gate, e, resume=src.resume)
                gate.release()
                return
            Fallback(artifact, registry, opener, self.paths, self.limits, src.resume).stage(
                self.kube, pod, container, gate
            )

        return restage

    def end_orphaned_lazy(self) -> list[str]:
        """At start: the lazy phases an earlier agent left unfinished ended (lazypods.end_orphaned), each
        container restored again, eagerly, from the save its lazy restore served."""

        def report(uid: str, container: str, reason: str) -> None:
            try:
                owner = _owner(self.paths.pod_dir(uid))
            except SnapshotError:  # not a pod uid
                owner = None
            if owner is None:
                log.warning("pod %s: %s", uid, reason)
                return
            meta = {"namespace": owner[0], "name": owner[1], "uid": uid}
            log.warning("%s/%s: %s", owner[0], owner[1], reason)
            pod_event(self.kube, {"apiVersion": "v1", "kind": "Pod", "metadata": meta}, K.EVENT_LAZY_RESTORE_FAILED,
                      reason, warning=True)  # fmt: skip

        root = os.path.join(self.paths.root, C.STAGING_SUBDIR, "by-pod")
        return end_orphaned(
            root, lambda uid, names: self._stop_containers(uid, only=names), report, again=self._again_eagerly
        )

    def _lazy_slots(self, pod: dict[str, Any], containers: int) -> bool:
        """Places on this node for the lazy sessions of that many containers; False (said in the log): eager."""
        if not containers or take_slots(containers):
            return containers > 0
        meta = pod["metadata"]
        log.warning("%s/%s asked for a lazy restore: restored eagerly, %d lazy restores already run on %s",
                    meta["namespace"], meta["name"], LAZY_SLOTS, self.settings.node)  # fmt: skip
        return False

    def _start_fresh(self, pod: dict[str, Any], gate: str | None, reason: str, gates: _PodGates) -> bool:
        """Open the gate (the gate init container's, when the pod has one, and its containers' staging
        gates) with nothing staged: the runtime wrapper then creates the containers as runc would."""
        try:
            return self._say_fresh(pod, gate, reason)
        finally:  # nothing staged, no record: the wrapper creates the waiting containers as runc would
            gates.answer(READY, f"no restore: {reason}")

    def _say_fresh(self, pod: dict[str, Any], gate: str | None, reason: str) -> bool:
        # said before the gate opens: whoever sees the pod run can read why it started fresh
        self._annotate(pod, K.RESTORE_SKIPPED_PREFIX + reason)
        pod_event(self.kube, pod, K.EVENT_RESUME_SKIPPED, f"the pod starts fresh: {reason}")
        if gate is None:
            return True
        try:
            self._wait_for_dirs(host_view(self.settings.kubelet_root), [gate], pod)
            self._open_gate(gate, K.GATE_STAGED_FILE, f"no restore: {reason}\n")
        except (OSError, SnapshotError) as e:
            err = e if isinstance(e, SnapshotError) else SnapshotError(f"could not open the gate: {e}")
            self._fail(pod, None, err)
            return False
        return True

    def _resume_failed(
        self, pod: dict[str, Any], gate: str | None, src: RestoreSource, err: SnapshotError, gates: _PodGates
    ) -> bool:
        """A resume that could not be staged: reported like a failed restore, then the pod starts fresh
        (nothing of the save is used; a workload's pod is never held in its gate by a bad save)."""
        pod_event(self.kube, pod, _failure_reason(err), f"resume from {src.reference}: {render(err)}", warning=True)
        shutil.rmtree(self.paths.pod_dir(pod["metadata"]["uid"]), ignore_errors=True)  # no whole-pod record left
        return self._start_fresh(pod, gate, f"resume from {src.reference} failed: {err.message}", gates)

    def _trust(self) -> TrustPolicy:
        """Read per restore, from the mounted trust ConfigMap and from the live one through the API: a
        node's key is registered by that node's agent when it starts, and the kubelet brings it to the
        mounted copy up to a minute later; a save that node took meanwhile must restore here too. The
        mounted copy alone serves while the API does not answer; neither: nothing is trusted, and every
        restore is refused with the reason."""
        policies = []
        if os.path.isdir(self.settings.trust_dir):
            policies.append(load_trust([self.settings.trust_dir]))
        try:
            live = self.kube.get_config_map(K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
        except SnapshotError as e:
            log.debug("trust ConfigMap not read through the API: %s", e.message)
        else:
            where = f"ConfigMap {K.AGENT_NAMESPACE}/{K.TRUST_CONFIG_MAP}"
            policies.append(trust_from_data(live.get("data") or {}, where=where))
        return merge_trust(policies) if policies else TrustPolicy()

    def _grants(self, namespace: str) -> list[Grant]:
        return [g for g in map(parse_grant, self.kube.list_snapshot_grants(namespace)) if g is not None]

    def _wait_for_dirs(self, root: str, rels: list[str], pod: dict[str, Any]) -> None:
        """Wait until the kubelet made each directory (below its root, reached without links). Given up
        early when the pod is gone or ended (a kubelet that rejects a pod at admission fails it: it never
        mounts anything), with what the pod's status says."""
        deadline = time.monotonic() + VOLUME_WAIT_S
        next_check = time.monotonic() + POD_CHECK_S
        while True:
            missing = []
            for rel in rels:
                try:
                    os.close(safefs.open_dir(root, rel))
                except FileNotFoundError:
                    missing.append(rel)
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                raise FailedPrecondition(
                    f"the kubelet did not set up the pod's volumes in {VOLUME_WAIT_S:.0f}s: {', '.join(missing)}"
                    f" ({self._pod_state(pod)})",
                    hint="the pod needs the emptyDir volumes of the snapshot and the gate volume; "
                    "kubectl describe pod shows the kubelet's events (FailedMount)",
                )
            if now > next_check:
                next_check = now + POD_CHECK_S
                self._check_pod_waits(pod)
            time.sleep(0.05)  # the kubelet makes them just after it sees the pod, as this agent does

    def _check_pod_waits(self, pod: dict[str, Any]) -> None:
        """Raise when the pod (this uid) is gone or has ended; an API that does not answer is no reason."""
        meta = pod.get("metadata") or {}
        try:
            live = self.kube.get_pod(str(meta.get("namespace")), str(meta.get("name")))
        except NotFound:
            live = None
        except SnapshotError as e:
            log.debug("pod %s not read while its volumes are awaited: %s", meta.get("name"), e.message)
            return
        if live is None or (live.get("metadata") or {}).get("uid") != meta.get("uid"):
            raise FailedPrecondition(
                "the pod was deleted before the kubelet set up its volumes",
                hint="restore again; nothing was staged",
            )
        if (live.get("metadata") or {}).get("deletionTimestamp"):
            raise FailedPrecondition("the pod is being deleted", hint="restore again; nothing was staged")
        status = live.get("status") or {}
        if status.get("phase") in ("Failed", "Succeeded"):
            raise FailedPrecondition(
                f"the kubelet ended the pod before setting up its volumes: {pod_status_summary(status)}",
                hint="a pod rejected at admission (resources, node pressure) is never started: free the node "
                "or restore on another one (--node), after deleting this pod",
            )

    def _pod_state(self, pod: dict[str, Any]) -> str:
        meta = pod.get("metadata") or {}
        try:
            live = self.kube.get_pod(str(meta.get("namespace")), str(meta.get("name")))
        except SnapshotError as e:
            return f"the pod's status not read: {e.message}"
        return pod_status_summary(live.get("status") or {})

    def follow(self, pod: dict[str, Any]) -> bool:
        """A staged pod of this node: report it failed (once) when the wrapper could not restore it
        whole; True when it did (now or before). Its state dir goes with the staged data (collect_garbage)."""
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        uid = str(meta.get("uid") or "")
        if uid in self._failed:
            return True
        if (
            annotations.get(K.ANN_RESTORE_STATUS) != K.RESTORE_STAGED
            or (pod.get("spec") or {}).get("nodeName") != self.settings.node
        ):
            return False
        try:
            state = PodRestore(self.paths.pod_dir(uid))
        except SnapshotError:
            return False
        fresh = state.fresh()
        if fresh is not None:  # a resume the wrapper could not restore: the pod goes on from its images
            self._failed.add(uid)
            stopped = self._stop_containers(uid, only=state.restored())
            reason = fresh.strip() + (f" (stopped the restored containers {', '.join(stopped)})" if stopped else "")
            self._say_fresh(pod, None, reason)
            return True
        why = state.failed()
        if why is None:
            return False
        self._failed.add(uid)
        stopped = self._stop_containers(uid)
        err = FailedPrecondition(
            f"the pod could not be restored whole: {why.strip()}",
            hint="no container of the pod was started from scratch"
            + (f" (stopped the restored ones: {', '.join(stopped)})" if stopped else "")
            + "; delete the pod, fix the cause and restore again",
        )
        self._annotate(pod, K.RESTORE_FAILED_PREFIX + err.message)
        # a refusal of the images (they grant more than the pod's spec) is told apart from a failure
        reason = K.EVENT_RESTORE_REFUSED if "refusing to restore" in why else K.EVENT_RESTORE_FAILED
        pod_event(self.kube, pod, reason, render(err), warning=True)
        return True

    def _stop_containers(self, uid: str, only: list[str] | None = None) -> list[str]:
        """Kill the pod's running app containers (those named in `only`, where given): the wrapper
        refuses to create them again, or creates them fresh for a resume it gave up."""
        from shim.containerd.client import ContainerdClient  # the agent's adapter; not needed by pure tests

        stopped = []
        try:
            with ContainerdClient(self.settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE) as c:
                for info in c.list_containers():
                    labels = info.labels
                    if labels.get(LABEL_POD_UID) != uid or labels.get(LABEL_CRI_KIND) != "container":
                        continue
                    if only is not None and labels.get(LABEL_CONTAINER_NAME) not in only:
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

    def _fail(self, pod: dict[str, Any], gate: str | None, err: SnapshotError) -> None:
        message = render(err)
        with contextlib.suppress(SnapshotError, OSError):
            PodRestore(self.paths.pod_dir(pod["metadata"]["uid"])).fail(err.message)
        if gate is not None:
            try:
                self._open_gate(gate, K.GATE_FAILED_FILE, message + "\n")
            except (OSError, SnapshotError) as e:
                log.warning("could not write the gate's failure file: %s", e)
        self._annotate(pod, K.RESTORE_FAILED_PREFIX + err.message)
        pod_event(self.kube, pod, _failure_reason(err), message, warning=True)

    def _open_gate(self, gate: str, name: str, content: str) -> None:
        """Write the gate file through a link-free fd of the gate volume (its containers can write there)."""
        with safefs.opened_dir(host_view(self.settings.kubelet_root), gate) as fd:
            safefs.write_file(fd, name, content.encode(), mode=0o644)

    def _annotate(self, pod: dict[str, Any], value: str) -> None:
        meta = pod["metadata"]
        try:
            self.kube.patch_pod_annotations(
                meta["namespace"], meta["name"], {K.ANN_RESTORE_STATUS: value[:1000]}, status=True
            )
        except SnapshotError:
            log.warning("could not annotate %s/%s", meta["namespace"], meta["name"])
