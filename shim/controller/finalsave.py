"""Final save: the agent saves, with stop, a protected pod of its node that is being terminated
gracefully, while the pod's preStop sleep hook holds its containers back from SIGTERM.

The decisions are core/finalsave.py; this module watches the node's pods (the agent's pod informer
hands them in), creates the final save (a PodSnapshot of the pod's SnapshotPolicy with ``stop`` and
the ``kubectl-snapshot.io/final-save`` label; the snapshot worker of this node runs it like any
other, deletes the pod object once the push is verified and kills the frozen containers), and
follows it to its end to record the outcome as Events on the pod and, when it failed, on the policy.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import finalsave as F
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import AlreadyExists, NotFound, SnapshotError
from shim.controller.events import pod_event, policy_event

log = logging.getLogger(__name__)

POLL_S = 1.0
NAME_ATTEMPTS = 5
Obj = dict[str, Any]


@dataclass
class _Tracked:
    pod: Obj
    policy: Obj
    save: str
    grace_s: int


class FinalSaver:
    def __init__(
        self,
        kube: Any,
        node: str,
        *,
        policy_of: Callable[[str, str], Obj | None],
        workload_of: Callable[[Obj], W.Workload],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube, self.node, self.clock = kube, node, clock
        self.policy_of = policy_of  # (namespace, name) -> the SnapshotPolicy (the autosave informer's copy)
        self.workload_of = workload_of
        self._lock = threading.Lock()
        self._decided: set[str] = set()  # pod uids decided on (one decision, one Event per pod)
        self._tracked: dict[str, _Tracked] = {}  # pod uid -> its final save in flight

    # --- the node's pods (informer thread) -----------------------------------------------------------

    def pod_changed(self, pod: Obj) -> None:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if not meta.get("deletionTimestamp") or not F.protected(pod):
            return
        if (pod.get("spec") or {}).get("nodeName") != self.node:
            return
        with self._lock:
            if uid in self._decided:
                return
            self._decided.add(uid)
        try:
            self._consider(pod)
        except SnapshotError as e:
            log.warning("final save of %s/%s: %s", meta.get("namespace"), meta.get("name"), e)
            pod_event(self.kube, pod, K.EVENT_FINAL_SAVE_FAILED, f"no final save: {e.message}", warning=True)

    def pod_gone(self, pod: Obj) -> None:
        with self._lock:
            self._decided.discard(str((pod.get("metadata") or {}).get("uid") or ""))

    def _consider(self, pod: Obj) -> None:
        meta = pod["metadata"]
        ns, uid = str(meta["namespace"]), str(meta["uid"])
        already = bool(
            self.kube.list_snapshots(ns, label_selector=f"{K.LABEL_FINAL_SAVE}=true,{K.LABEL_POD_UID}={uid}")
        )
        decision = F.decide(pod, node=self.node, now=self.clock(), already=already)
        if not decision.save:
            if decision.event:
                pod_event(self.kube, pod, K.EVENT_FINAL_SAVE_FAILED, decision.reason, warning=True)
            return
        policy_name = str((meta.get("annotations") or {}).get(K.ANN_RESUME_POLICY) or "")
        policy = self.policy_of(ns, policy_name)
        if policy is None:
            message = f"no final save: SnapshotPolicy {ns}/{policy_name} is gone"
            pod_event(self.kube, pod, K.EVENT_FINAL_SAVE_FAILED, message, warning=True)
            return
        workload = self.workload_of(pod)
        refused = A.why_not_selected(policy, pod, workload)
        if refused:  # the annotation names a policy; only the policy's selector says it protects this pod
            pod_event(self.kube, pod, K.EVENT_FINAL_SAVE_FAILED, f"no final save: {refused}", warning=True)
            return
        created = self._create(policy, pod, workload)
        name = str(created["metadata"]["name"])
        grace = int(
            meta.get("deletionGracePeriodSeconds")
            or (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            or F.DEFAULT_GRACE_S
        )
        with self._lock:
            self._tracked[uid] = _Tracked(pod=pod, policy=policy, save=name, grace_s=grace)
        log.info(
            "final save %s/%s of terminating pod %s (%.0fs before SIGTERM)", ns, name, meta["name"], decision.window_s
        )
        pod_event(
            self.kube,
            pod,
            K.EVENT_FINAL_SAVE,
            f"final save {name} started: the containers are frozen and saved before SIGTERM"
            f" ({decision.window_s:.0f}s left of the preStop hook); the pod ends when it is pushed",
        )

    def _create(self, policy: Obj, pod: Obj, workload: W.Workload) -> Obj:
        ns = str(pod["metadata"]["namespace"])
        when = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        for attempt in range(1, NAME_ATTEMPTS + 1):
            body = A.save_object(policy, pod, workload, when, attempt)
            body["spec"]["stop"] = True
            body["metadata"]["labels"] = F.final_labels(body["metadata"].get("labels") or {})
            try:
                return dict(self.kube.create_snapshot(ns, body))
            except AlreadyExists:
                continue
        raise AlreadyExists(f"pod {ns}/{pod['metadata']['name']}: every save name of this second is taken")

    # --- following the saves in flight ---------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # a bug must not end final saves for the node
                log.exception("final save poll failed")

    def poll(self) -> None:
        with self._lock:
            tracked = list(self._tracked.items())
        for uid, t in tracked:
            ns = str(t.pod["metadata"]["namespace"])
            try:
                obj = self.kube.get_snapshot(ns, t.save)
            except NotFound:
                self._forget(uid)
                continue
            except SnapshotError as e:
                log.warning("final save %s/%s: %s", ns, t.save, e)
                continue
            save = A.Save.of(obj)
            if not save.terminal:
                continue
            self._forget(uid)
            if save.good:
                pod_event(
                    self.kube,
                    t.pod,
                    K.EVENT_FINAL_SAVE,
                    f"final save {t.save} pushed as {save.reference}; the pod was stopped before SIGTERM and its"
                    " replacement resumes from this save",
                )
                continue
            message = F.late_message(t.save, t.grace_s, save.message or "it failed", self._last_good(ns, uid))
            pod_event(self.kube, t.pod, K.EVENT_FINAL_SAVE_FAILED, message, warning=True)
            policy_event(
                self.kube,
                t.policy,
                K.EVENT_FINAL_SAVE_FAILED,
                f"pod {t.pod['metadata']['name']}: {message}",
                warning=True,
            )

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._tracked.pop(uid, None)

    def _last_good(self, ns: str, uid: str) -> str | None:
        try:
            saves = [A.Save.of(o) for o in self.kube.list_snapshots(ns, label_selector=f"{K.LABEL_POD_UID}={uid}")]
        except SnapshotError:
            return None
        good = sorted((s for s in saves if s.good), key=lambda s: (s.completed or s.created, s.name), reverse=True)
        return good[0].name if good else None
