"""Autosave: each agent saves the pods of its own node that a SnapshotPolicy selects, every interval.

The agent only creates PodSnapshots (labelled with the policy, the pod and its workload); the
snapshot worker of the same node claims and runs them as it runs any other. What this module adds:

- the schedule (kubectl_snapshot/core/autosave.py decides): a pod's next save is due one interval
  after its newest save was created, read back from the PodSnapshots themselves when the agent
  starts, so a restart neither skips nor doubles a save; never a second save while one is in flight;
  a failed save is retried after an exponential backoff capped at the interval (the pod is never
  touched: a save that fails leaves it running, as every failed snapshot does);
- retention after each finished save: the registry manifests (and their ``.sig`` signatures) of the
  saves beyond the policy are deleted by digest, then their PodSnapshots; what could not be deleted is
  tried again after a backoff even when no save follows (a suspended policy);
- the policy's status: this node's entries in ``status.pods``, server-side applied with a field
  manager of its own (``kubectl-snapshot-agent/<node>``), so agents never overwrite each other and
  the entries of pods that left the node disappear with the next apply; Events on the policy for
  failed saves;
- the pod's ``kubectl-snapshot.io/last-save`` annotation after every good save (``on_saved``, called
  by the snapshot worker for policy and manual saves alike).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import AlreadyExists, NotFound, SnapshotError
from kubectl_snapshot.core.provenance import signature_tag
from kubectl_snapshot.core.reference import Reference
from shim.controller.events import policy_event
from shim.controller.kube_api import KubeApi

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often due saves are looked for
POLL_S = 2.0  # how often a save in flight is read back
# saves retention could not delete are tried again (also while suspended) after 30 s, then twice as
# long after each failure up to 30 min: a registry that refuses deletes is not asked (nor an Event
# recorded) every 30 s for ever
RETENTION_RETRY_S = 30.0
RETENTION_RETRY_MAX_S = 1800.0
NAME_ATTEMPTS = 5
ORPHAN_SWEEP_S = 300.0  # saves of pods that are gone are looked at this often (max age only)

Obj = dict[str, Any]
PairKey = tuple[str, str, str]  # namespace, policy, pod uid


def field_manager(node: str) -> str:
    return f"{K.AGENT_NAME}/{node}"[:128]


@dataclasses.dataclass
class _Pair:
    saves: list[A.Save]
    first_due: float | None = None  # when the first save is due (A.first_save_due), while there is none
    not_before: float = 0.0  # a save overdue when this agent took the pod up waits until then (A.overdue_not_before)
    next_check: float = 0.0
    retention_retry: float = 0.0  # when to try again deleting saves retention could not delete (0: nothing left)
    retention_failures: int = 0  # retention passes in a row that left a doomed save undeleted
    applied: dict[str, Any] = dataclasses.field(default_factory=dict)


class Autosave:
    def __init__(
        self,
        kube: KubeApi,
        node: str,
        *,
        registry_for: Callable[[str, str | None, bool], Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.node = node
        self.registry_for = registry_for  # (namespace, secret, insecure) -> RegistryClient
        self.clock = clock
        self.manager = field_manager(node)
        self._lock = threading.Lock()
        self._policies: dict[tuple[str, str], Obj] = {}
        self._pods: dict[str, Obj] = {}
        self._pairs: dict[PairKey, _Pair] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._rs_owners: dict[tuple[str, str], Obj] = {}
        self._started = False
        self._last_sweep = 0.0

    # --- what the informers hand in ----------------------------------------------------------------

    @staticmethod
    def _key(obj: Obj) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return str(meta.get("namespace") or ""), str(meta.get("name") or "")

    def policy_changed(self, obj: Obj) -> None:
        with self._lock:
            self._policies[self._key(obj)] = obj
            self._dirty.add(self._key(obj))

    def policy_gone(self, obj: Obj) -> None:
        with self._lock:
            self._policies.pop(self._key(obj), None)

    def pod_changed(self, obj: Obj) -> None:
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        with self._lock:
            if (obj.get("spec") or {}).get("nodeName") == self.node:
                self._pods[uid] = obj
            else:
                self._pods.pop(uid, None)

    def pod_gone(self, obj: Obj) -> None:
        with self._lock:
            self._pods.pop(str((obj.get("metadata") or {}).get("uid") or ""), None)

    def policy(self, namespace: str, name: str) -> Obj | None:
        """The SnapshotPolicy as the informer last saw it (the final save reads its destination)."""
        with self._lock:
            return self._policies.get((namespace, name))

    def workload(self, pod: Obj) -> W.Workload:
        return self._workload(pod)

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(TICK_S):
            try:
                self.tick()
            except Exception:  # a bug must not end autosave for the node
                log.exception("autosave tick failed")

    def tick(self) -> None:
        now = self.clock()
        with self._lock:
            policies = dict(self._policies)
            pods = list(self._pods.values())
            if not self._started:  # entries an earlier life of this agent applied may be stale
                self._dirty |= set(policies)
                self._started = True
        wanted: set[PairKey] = set()
        for pod in pods:
            if not A.eligible(pod, self.node):
                continue
            for pkey, policy in policies.items():
                if pkey[0] != (pod.get("metadata") or {}).get("namespace"):
                    continue
                workload = self._workload(pod)
                if not A.selects(policy, pod, workload):
                    continue
                key = (pkey[0], pkey[1], str(pod["metadata"].get("uid") or ""))
                wanted.add(key)
                try:
                    self._step(key, policy, pod, workload, now)
                except SnapshotError as e:
                    log.warning("autosave %s/%s of pod %s: %s", pkey[0], pkey[1], pod["metadata"].get("name"), e)
        for key in [k for k in self._pairs if k not in wanted]:
            del self._pairs[key]
            self._dirty.add((key[0], key[1]))
        self._publish(policies, pods, now)
        if now - self._last_sweep >= ORPHAN_SWEEP_S:
            self._last_sweep = now
            self._sweep_orphans(policies, pods, now)

    # --- one pod under one policy -------------------------------------------------------------------

    def _step(self, key: PairKey, policy: Obj, pod: Obj, workload: W.Workload, now: float) -> None:
        ns, pname, uid = key
        spec = policy.get("spec") or {}
        interval = A.parse_duration(str(spec.get("interval") or ""), "interval")
        pair = self._pairs.get(key)
        if pair is None:
            started = T.seconds((pod.get("status") or {}).get("startTime")) or 0.0
            came = T.seconds((policy.get("metadata") or {}).get("creationTimestamp")) or 0.0
            first = A.first_save_due(uid, interval, pod_started=started, policy_created=came)
            pair = _Pair(saves=self._saves(ns, pname, uid), first_due=first)
            if pair.saves:
                due = A.schedule(pair.saves, interval, now).due
                pair.not_before = A.overdue_not_before(uid, interval, due, now)
            self._pairs[key] = pair
            self._dirty.add((ns, pname))
        sched = self._schedule(pair, interval, now)
        if sched.in_flight is not None:
            if now < pair.next_check:
                return
            pair.next_check = now + POLL_S
            try:
                current = A.Save.of(self.kube.get_snapshot(ns, sched.in_flight))
            except NotFound:
                pair.saves = self._saves(ns, pname, uid)  # deleted by someone: start over from what exists
                self._dirty.add((ns, pname))
                return
            if not current.terminal:
                return
            pair.saves = [current if s.name == current.name else s for s in pair.saves]
            self._dirty.add((ns, pname))
            self._finished(policy, pod, pair, current, interval, now)
            sched = self._schedule(pair, interval, now)
        elif pair.retention_retry and now >= pair.retention_retry:
            self._retain(policy, pair, now)
        if spec.get("suspend") or now < sched.due:
            return
        created = self._create(policy, pod, workload)
        pair.saves.append(A.Save.of(created))
        pair.next_check = now + POLL_S
        self._dirty.add((ns, pname))

    @staticmethod
    def _schedule(pair: _Pair, interval: float, now: float) -> A.Schedule:
        sched = A.schedule(pair.saves, interval, now, first_due=pair.first_due)
        if sched.due < pair.not_before:
            return dataclasses.replace(sched, due=pair.not_before)
        return sched

    def _saves(self, ns: str, policy: str, uid: str) -> list[A.Save]:
        selector = f"{K.LABEL_POLICY}={policy},{K.LABEL_POD_UID}={uid}"
        return [A.Save.of(o) for o in self.kube.list_snapshots(ns, label_selector=selector)]

    def _create(self, policy: Obj, pod: Obj, workload: W.Workload) -> Obj:
        ns = str(pod["metadata"]["namespace"])
        when = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        for attempt in range(1, NAME_ATTEMPTS + 1):
            body = A.save_object(policy, pod, workload, when, attempt)
            try:
                return dict(self.kube.create_snapshot(ns, body))
            except AlreadyExists:
                continue
            except SnapshotError as e:
                pname = str(policy["metadata"]["name"])
                message = f"could not start a save of pod {pod['metadata']['name']}: {e.message}"
                policy_event(self.kube, policy, K.EVENT_SNAPSHOT_FAILED, message, warning=True)
                raise SnapshotError(f"policy {ns}/{pname}: {message}") from e
        raise AlreadyExists(f"pod {ns}/{pod['metadata']['name']}: every save name of this second is taken")

    def _finished(self, policy: Obj, pod: Obj, pair: _Pair, save: A.Save, interval: float, now: float) -> None:
        pod_name = pod["metadata"]["name"]
        if not save.good:
            sched = A.schedule(pair.saves, interval, now)
            retry = A.format_duration(max(0.0, sched.due - now))
            message = f"save {save.name} of pod {pod_name} failed: {save.message or 'no message'}; retry in {retry}"
            policy_event(self.kube, policy, K.EVENT_SNAPSHOT_FAILED, message, warning=True)
        self._retain(policy, pair, now)

    def _retain(self, policy: Obj, pair: _Pair, now: float) -> None:
        """Delete what retention dooms among the pair's finished saves; what could not be deleted is
        tried again RETENTION_RETRY_S later, whether or not another save is made meanwhile."""
        ns, pname = self._key(policy)
        retention = (policy.get("spec") or {}).get("retention") or {}
        max_age = retention.get("maxAge")
        doomed = A.retention(
            pair.saves,
            keep_last=int(retention.get("keepLast") or 3),
            max_age_s=A.parse_duration(str(max_age), "maxAge") if max_age else None,
            now=now,
        )
        pair.retention_retry = 0.0
        if not doomed:
            return
        deleted = self._delete_saves(policy, [s.name for s in doomed])
        pair.saves = [s for s in pair.saves if s.name not in deleted]
        if len(deleted) < len(doomed):
            pair.retention_failures += 1
            backoff = RETENTION_RETRY_S * 2 ** min(pair.retention_failures - 1, 16)
            pair.retention_retry = now + min(backoff, RETENTION_RETRY_MAX_S)
        else:
            pair.retention_failures = 0
        if deleted:
            log.info("policy %s/%s: retention deleted %s", ns, pname, ", ".join(sorted(deleted)))

    # --- retention ---------------------------------------------------------------------------------

    def _delete_saves(self, policy: Obj, names: list[str]) -> set[str]:
        """Delete each save's manifest (and signature) from the registry, then its PodSnapshot; a save
        whose manifest cannot be deleted is kept (and tried again: `_retain`)."""
        ns = self._key(policy)[0]
        spec = policy.get("spec") or {}
        deleted: set[str] = set()
        registry = None
        for name in names:
            try:
                obj = self.kube.get_snapshot(ns, name)
            except NotFound:
                deleted.add(name)
                continue
            ref_text = str((obj.get("status") or {}).get("reference") or "")
            try:
                if ref_text:
                    if registry is None:
                        registry = self.registry_for(ns, spec.get("registrySecret") or None, bool(spec.get("insecure")))
                    delete_manifest(registry, Reference.parse(ref_text))
                self.kube.delete_snapshot(ns, name)
            except NotFound:
                pass
            except SnapshotError as e:
                message = f"retention could not delete save {name}: {e.message}"
                policy_event(self.kube, policy, "RetentionFailed", message, warning=True)
                continue
            deleted.add(name)
        return deleted

    def _sweep_orphans(self, policies: dict[tuple[str, str], Obj], pods: list[Obj], now: float) -> None:
        """Saves this node made for pods that no longer exist: deleted only once older than maxAge
        (a replacement pod may resume from them until then)."""
        for (ns, pname), policy in policies.items():
            max_age = ((policy.get("spec") or {}).get("retention") or {}).get("maxAge")
            if not max_age:
                continue
            try:
                objs, _ = self.kube.list_snapshots_versioned(
                    ns,
                    field_selector=f"{K.SNAPSHOT_NODE_FIELD}={self.node}",
                    label_selector=f"{K.LABEL_POLICY}={pname}",
                )
                live = {str(p["metadata"].get("uid")) for p in self.kube.list_pods(ns)}
            except SnapshotError as e:
                log.warning("autosave sweep of %s/%s: %s", ns, pname, e)
                continue
            gone = [o for o in objs if (o["metadata"].get("labels") or {}).get(K.LABEL_POD_UID) not in live]
            doomed = A.orphan_retention([A.Save.of(o) for o in gone], max_age_s=A.parse_duration(max_age), now=now)
            if doomed:
                self._delete_saves(policy, [s.name for s in doomed])

    # --- status ------------------------------------------------------------------------------------

    def _publish(self, policies: dict[tuple[str, str], Obj], pods: list[Obj], now: float) -> None:
        by_uid = {str(p["metadata"].get("uid")): p for p in pods}
        for pkey in sorted(self._dirty):
            policy = policies.get(pkey)
            if policy is None:
                self._dirty.discard(pkey)
                continue
            spec = policy.get("spec") or {}
            try:
                interval = A.parse_duration(str(spec.get("interval") or ""), "interval")
            except SnapshotError:
                self._dirty.discard(pkey)
                continue
            entries = []
            for (ns, pname, uid), pair in sorted(self._pairs.items()):
                if (ns, pname) != pkey or uid not in by_uid:
                    continue
                sched = self._schedule(pair, interval, now)
                entries.append(A.pod_status_entry(by_uid[uid], self.node, sched, suspended=bool(spec.get("suspend"))))
            try:
                self.kube.apply_policy_pods(pkey[0], pkey[1], entries, field_manager=self.manager)
            except NotFound:
                pass
            except SnapshotError as e:
                log.warning("could not write the status of policy %s/%s: %s", pkey[0], pkey[1], e)
                continue  # stays dirty: written on the next tick
            self._dirty.discard(pkey)

    # --- the pod's workload ------------------------------------------------------------------------

    def _workload(self, pod: Obj) -> W.Workload:
        ns = str(pod["metadata"].get("namespace") or "")
        return W.workload_of(pod, lambda rs: self._replicaset(ns, rs))

    def _replicaset(self, ns: str, name: str) -> Obj | None:
        """The ReplicaSet's ownership (cached: a ReplicaSet's controller never changes)."""
        key = (ns, name)
        if key not in self._rs_owners:
            try:
                rs = self.kube.get_replicaset(ns, name)
            except NotFound:
                return None  # not cached: a ReplicaSet that appears later is read again
            except SnapshotError as e:
                log.warning("could not read replicaset %s/%s: %s", ns, name, e)
                return None
            if rs is None:
                return None
            owners = (rs.get("metadata") or {}).get("ownerReferences") or []
            self._rs_owners[key] = {"metadata": {"ownerReferences": list(owners)}}
        return self._rs_owners[key]

    # --- after every good save (policy or manual) ---------------------------------------------------

    def on_saved(self, snapshot: Obj, pod: Obj) -> None:
        """Publish the time of the pod's last good save on it (``kubectl-snapshot.io/last-save``)."""
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return
        stamp = T.rfc3339(self.clock())
        ns, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            self.kube.patch_pod_annotations(ns, name, {K.ANN_LAST_SAVE: stamp}, status=True)
        except NotFound:
            return  # stopped (spec.stop) or deleted meanwhile
        except SnapshotError as e:
            log.warning("could not set %s on pod %s/%s: %s", K.ANN_LAST_SAVE, ns, name, e)


def delete_manifest(registry: Any, ref: Reference) -> None:
    """Delete a save's manifest by digest, and first the cosign-style signature stored beside it
    (tag ``sha256-<hex>.sig``, resolved to its digest: registries delete manifests by digest). Blobs
    are never deleted here: those shared with kept saves stay; the registry's garbage collection
    frees the rest. Already gone is fine."""
    if not ref.digest:
        return
    sig = Reference(registry=ref.registry, repository=ref.repository, tag=signature_tag(ref.digest))
    try:
        _, _, sig_digest = registry.get_manifest(sig)
    except NotFound:
        sig_digest = ""
    if sig_digest:
        with contextlib.suppress(NotFound):
            registry.delete_manifest(sig, sig_digest)
    with contextlib.suppress(NotFound):
        registry.delete_manifest(ref, ref.digest)
