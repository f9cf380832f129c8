"""A resuming pod's source: the save of its predecessor it resumes from, claimed where it must be.

For a pod the resume admission policy annotated (deploy/resume.py), on this agent's node. The pure
choice is core/resume.py; this module reads the policy, the workload, the saves and the namespace's
pods, claims a ReplicaSet/Deployment save atomically, and checks the images. Authorization: the
policy's creation was checked at admission (its creator may restore in the namespace); the agent
only ever uses saves of the pod's own namespace and workload (docs/security.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import resume as R
from kubectl_snapshot.core import workload as W
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, SnapshotError
from kubectl_snapshot.core.reference import Reference
from shim.controller.kube_api import KubeApi

log = logging.getLogger(__name__)
RESUME_WAIT_S = 180.0  # how long a new pod waits for a predecessor's save still running (a migrate's stop save)
POLL_S = 1.0
CLAIM_ATTEMPTS = 8


@dataclass(frozen=True)
class RestoreSource:
    """What to stage into a pod: a restore-from annotation's, or the save a resuming pod chose."""

    reference: Reference
    registry_secret: str | None = None
    insecure: bool = False
    resume: bool = False  # a failure starts the pod fresh instead of failing it (a workload never blocks)
    lazy: bool = False  # pages served from the registry as the processes touch them (docs/lazy-restore.md)


@dataclass(frozen=True)
class StartFresh:
    """A resuming pod with nothing to resume from: the gate opens with no restore, and why."""

    reason: str


class Resumer:
    def __init__(
        self,
        kube: KubeApi,
        *,
        wait_s: float = RESUME_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kube, self.wait_s, self.clock, self.sleep = kube, wait_s, clock, sleep

    def source(self, pod: dict[str, Any]) -> RestoreSource | StartFresh:
        """The save to stage, or why the pod starts fresh. API errors start it fresh too (with the
        reason in an Event): a protected workload's pod is never held in its gate by the agent."""
        try:
            return self._source(pod)
        except SnapshotError as e:
            log.warning("resume of %s/%s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], e)
            return StartFresh(f"could not choose a save: {e.message}")

    def _source(self, pod: dict[str, Any]) -> RestoreSource | StartFresh:
        meta = pod["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        policy_name = (meta.get("annotations") or {}).get(K.ANN_RESUME_POLICY, "")
        try:
            policy = self.kube.get_policy(ns, policy_name)
        except NotFound:
            return StartFresh(f"SnapshotPolicy {ns}/{policy_name} is gone")
        spec = policy.get("spec") or {}
        if spec.get("resume") is False:
            return StartFresh(f"SnapshotPolicy {policy_name} has resume: false")
        # The annotation names a policy; only the policy's own selector, matched against this pod's labels
        # and its workload read from its real owners, says the pod is one the policy protects (a template
        # can carry any annotation: docs/security.md, "Automatic restores").
        workload = W.workload_of(pod, lambda rs: self.kube.get_replicaset(ns, rs))
        refused = A.why_not_selected(policy, pod, workload)
        if refused:
            return StartFresh(refused)
        selector = R.label_selector(workload, pod)
        if selector is None:
            return StartFresh(f"{workload.kind} {workload.name}: its pods have no identity to resume by")
        deadline = self.clock() + self.wait_s
        for _ in range(CLAIM_ATTEMPTS):
            while True:
                saves = self.kube.list_snapshots(ns, label_selector=selector)
                running, terminating = self._pods(ns, policy_name)
                choice = R.choose(
                    workload,
                    pod,
                    saves,
                    running_pod_uids=running,
                    terminating=terminating,
                    wait_for_running=self.clock() < deadline,
                    down_nodes=self._down_nodes(saves, terminating),
                )
                if not choice.wait:
                    break
                self.sleep(POLL_S)
            if choice.save is None:
                return StartFresh(choice.reason)
            save = choice.save
            smeta = save["metadata"]
            images = W.decode_images((smeta.get("annotations") or {}).get(K.ANN_POD_IMAGES))
            mismatch = W.image_mismatch(images, pod)
            if mismatch:
                return StartFresh(f"save {smeta['name']} does not fit: {mismatch}")
            if choice.claim:
                try:
                    self.kube.patch_snapshot_metadata(
                        ns,
                        smeta["name"],
                        annotations={K.ANN_CLAIMED_BY: uid},
                        resource_version=smeta.get("resourceVersion"),
                    )
                except FailedPrecondition:  # 409: another new pod claimed a save of it first; pick again
                    continue
            ref = str((save.get("status") or {}).get("reference") or "")
            log.info("pod %s/%s resumes from %s (%s)", ns, meta["name"], smeta["name"], ref)
            return RestoreSource(
                Reference.parse(ref),
                registry_secret=spec.get("registrySecret") or None,
                insecure=bool(spec.get("insecure")),
                resume=True,
                lazy=spec.get("restoreMode") == K.RESTORE_MODE_LAZY,  # absent (an older CRD): eager
            )
        return StartFresh("other new pods kept claiming the saves first")

    def _down_nodes(self, saves: list[dict[str, Any]], terminating: list[dict[str, Any]]) -> set[str]:
        """The nodes of saves still in progress, and of terminating predecessors, that are down: a dead
        node's save never finishes and its pods never finish terminating (docs/node-loss.md); the pod
        resumes from the newest good save instead of waiting for them."""
        nodes = {R.save_node(s) for s in R.in_progress(saves)}
        nodes |= {str((p.get("spec") or {}).get("nodeName") or "") for p in terminating}
        down = set()
        for node in nodes - {""}:
            try:
                found: dict[str, Any] | None = self.kube.get_node(node)
            except NotFound:
                found = None
            except SnapshotError as e:  # not known to be down: keep waiting for its save
                log.warning("could not read node %s: %s", node, e)
                continue
            if R.node_down(found):
                down.add(node)
        return down

    def _pods(self, ns: str, policy: str) -> tuple[set[str], list[dict[str, Any]]]:
        """Uids of the namespace's pods that run on (not terminating, not finished), and its pods being
        deleted that the same policy protects (their final save may still come: core/finalsave.py)."""
        running: set[str] = set()
        terminating = []
        for p in self.kube.list_pods(ns):
            meta = p["metadata"]
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if not meta.get("deletionTimestamp"):
                running.add(str(meta.get("uid")))
            elif (meta.get("annotations") or {}).get(K.ANN_RESUME_POLICY) == policy:
                terminating.append(p)
        return running, terminating
