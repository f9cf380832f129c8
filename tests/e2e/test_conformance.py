"""The conformance suite (issue 41): real workloads x the settings clusters use x operations, on the real
two-node cluster. Each case is a pod of a real application (tests/support/workloads.py) with one or more
settings (tests/support/conformance.py); it is snapshotted on the first node and restored on the second
(or migrated there), and its own state is read before and after: the same token only its memory holds,
the same pids, a counter that carried on.

The cases run as one batch (all pods at once, saves through the node's queue, restores in parallel),
so the suite costs minutes, not a cluster per case; each case is its own test for the report.
docs/conformance.md is generated from the same table (hack/gen-conformance-doc.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from tests.support.agent import _plugin, agent
from tests.support.cluster import Cluster, cluster
from tests.support.conformance import (
    CASES,
    CONFIG_MAP,
    DRAIN,
    LOCALHOST_PROFILE,
    LOCALHOST_PROFILE_JSON,
    MIGRATE,
    PROTECTED_OPERATIONS,
    RESUME,
    SECRET,
    Case,
    manifest,
    pod_name,
)
from tests.support.images import push_tarball
from tests.support.workloads import BUSYBOX_WL, carried_on

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster"]
# a developer's quick run: KS_CONFORMANCE_ONLY=gunicorn,static (substrings of case ids); CI runs them all
_ONLY = [w for w in os.environ.get("KS_CONFORMANCE_ONLY", "").split(",") if w]
_CHOSEN = tuple(c for c in CASES if not _ONLY or any(w in c.id for w in _ONLY))
SELECTED = tuple(c for c in _CHOSEN if c.operation not in PROTECTED_OPERATIONS)
PROTECTED = tuple(c for c in _CHOSEN if c.operation in PROTECTED_OPERATIONS)


@dataclass
class Outcome:
    case: Case
    before: str = ""
    after: str = ""
    restored: str = ""
    node: str = ""
    refusal: str = ""
    still_running: bool = False
    problems: list[str] = field(default_factory=list)


def _exec(cluster: Cluster, ns: str, pod: str, argv: list[str]) -> str | None:
    r = cluster.kubectl("exec", "-n", ns, pod, "-c", "app", "--", *argv, check=False, timeout=60)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def _wait(what: str, predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(1)
    return False


def _pod(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    r = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def _ready(cluster: Cluster, ns: str, name: str) -> bool:
    p = _pod(cluster, ns, name)
    if p is None or p["status"].get("phase") != "Running":
        return False
    return all(c.get("ready") for c in p["status"].get("containerStatuses") or [])


def _why_not_running(cluster: Cluster, ns: str, name: str) -> str:
    p = _pod(cluster, ns, name) or {}
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", check=False
    ).stdout
    return f"{json.dumps(p.get('status'))[:1500]}\n{events[-1500:]}"


class Batch:
    """One run of every case, in order: start, operate, restore, read."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        self.results = {c.id: Outcome(c) for c in SELECTED}
        self.psnaps: dict[str, str] = {}
        self.n1, self.n2 = cluster.nodes[:2]

    def state(self, c: Case, pod: str) -> str | None:
        return _exec(self.cluster, self.ns, pod, c.workload.read)

    def start(self, images: dict[str, str]) -> None:
        bb = self.cluster.busybox_image
        self.cluster.apply([manifest(c, self.ns, images[c.workload.name], self.n1, bb) for c in SELECTED])
        for c in SELECTED:
            self._read_before(c, pod_name(c))

    def _read_before(self, c: Case, name: str) -> None:
        o = self.results[c.id]
        if not _wait(name, lambda: _ready(self.cluster, self.ns, name) and self.state(c, name) is not None, 420):
            o.problems.append(f"never ran on {self.n1}: {_why_not_running(self.cluster, self.ns, name)}")
            return
        o.before = self.state(c, name) or ""

    def operate(self, c: Case) -> None:
        """Snapshot (or migrate) the case's pod, through the node's snapshot queue."""
        o, name = self.results[c.id], pod_name(c)
        if o.problems:
            return
        o.before = self.state(c, name) or o.before
        dest = f"{self.cluster.registry}/e2e/conformance/{name}"
        if c.operation == MIGRATE:
            args: tuple[str, ...] = ("migrate", f"pod/{name}", "-n", self.ns, "--node", self.n2, "--to", dest)
            r = _plugin(self.cluster, *args, "-o", "json", check=False)
            if r.returncode != 0:
                o.problems.append(f"migrate failed: {r.stderr.strip()[-2000:]}")
            else:
                o.restored = json.loads(r.stdout)["restored"]["name"]
            return
        r = _plugin(self.cluster, "snapshot", f"pod/{name}", "-n", self.ns, "--to", dest, "-o", "json", check=False)
        if c.refused:  # refused up front: the pod runs on, its application carrying on
            o.refusal = r.stderr if r.returncode != 0 else f"not refused: {r.stdout[-500:]}"
            o.still_running = _ready(self.cluster, self.ns, name)
            o.after = self.state(c, name) or ""
            return
        if r.returncode != 0:
            o.problems.append(f"snapshot failed: {r.stderr.strip()[-2000:]}")
            return
        self.psnaps[c.id] = json.loads(r.stdout)["metadata"]["name"]

    def delete_originals(self) -> None:
        saved = [c for c in SELECTED if c.id in self.psnaps]
        for c in saved:
            self.cluster.kubectl("delete", "pod", pod_name(c), "-n", self.ns, "--wait=false", check=False)
        for c in saved:
            self._gone(pod_name(c))

    def _gone(self, name: str) -> None:
        _wait(f"{name} to go", lambda: _pod(self.cluster, self.ns, name) is None, 120)

    def restore(self, c: Case) -> None:
        name = f"{pod_name(c)}-r"
        args = ("restore", self.psnaps[c.id], "-n", self.ns, "--name", name, "--node", self.n2, "--timeout", "300s")
        r = _plugin(self.cluster, *args, check=False, timeout=420)
        if r.returncode != 0:
            uid = str(((_pod(self.cluster, self.ns, name) or {}).get("metadata") or {}).get("uid") or name)
            kubelet = self.cluster.log_lines(f"kubelet-{self.n2}", uid)
            self.results[c.id].problems.append(
                f"restore failed: {(r.stdout + r.stderr).strip()[-2000:]}\n"
                f"{_why_not_running(self.cluster, self.ns, name)}\nthe kubelet of {self.n2} on {uid}:\n{kubelet}"
            )
        else:
            self.results[c.id].restored = name

    def read_after(self, c: Case) -> None:
        o = self.results[c.id]
        if o.problems or not o.restored or c.refused:
            return
        if not _wait(o.restored, lambda: _ready(self.cluster, self.ns, o.restored), 180):
            o.problems.append(f"restored pod not ready: {_why_not_running(self.cluster, self.ns, o.restored)}")
            return
        o.node = str(((_pod(self.cluster, self.ns, o.restored) or {}).get("spec") or {}).get("nodeName"))
        o.after = self.state(c, o.restored) or ""


def _images(cluster: Cluster, cases: tuple[Case, ...]) -> dict[str, str]:
    images: dict[str, str] = {}
    for w in {c.workload.name: c.workload for c in cases}.values():
        images[w.name] = (
            cluster.busybox_image if w is BUSYBOX_WL else push_tarball(cluster.registry, w.tarball(), w.image)
        )
    return images


@pytest.fixture(scope="module")
def outcomes(cluster: Cluster, agent: Any) -> Iterator[dict[str, Outcome]]:
    ns = f"e2e-conf-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    profiles = [cluster.state_dir / n / "kubelet" / "seccomp" / LOCALHOST_PROFILE for n in cluster.nodes]
    try:
        has_sa = lambda: cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0  # noqa: E731
        assert _wait("the default service account", has_sa, 60)
        for p in profiles:  # what a cluster's security team installs on every node
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(LOCALHOST_PROFILE_JSON))
        cluster.kubectl("create", "configmap", CONFIG_MAP, "-n", ns, "--from-literal=app.conf=mode=conformance")
        cluster.kubectl("create", "secret", "generic", SECRET, "-n", ns, "--from-literal=password=s3cret")
        batch = Batch(cluster, ns)
        batch.start(_images(cluster, SELECTED))
        for c in SELECTED:
            batch.operate(c)
        batch.delete_originals()
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(batch.restore, [c for c in SELECTED if c.id in batch.psnaps]))
        for c in SELECTED:
            batch.read_after(c)
        yield batch.results
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for p in profiles:
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("case", SELECTED, ids=[c.id for c in SELECTED])
def test_conformance(outcomes: dict[str, Outcome], cluster: Cluster, case: Case) -> None:
    o = outcomes[case.id]
    assert not o.problems, "\n".join(o.problems)
    if case.refused:
        assert case.refused in o.refusal and "hint:" in o.refusal, o.refusal
        assert o.still_running, "the refused pod is not running any more"
    else:
        assert o.node == cluster.nodes[1], f"restored on {o.node}"
    assert o.after, f"{case.workload.name}: no state read after the restore"
    why = carried_on(case.workload, o.before, o.after)
    assert why is None, f"{why}\nbefore: {o.before}\nafter: {o.after}"


# --- protected workloads: autosave resume and drain ----------------------------------------------------

GRACE_S = 30
DRAIN_MARK = "e2e-conformance-drain"


def _protected(case: Case, ns: str, image: str, n1: str, bb: str, registry: str) -> list[dict[str, Any]]:
    """A SnapshotPolicy (one periodic save when the pod starts) and a one-pod StatefulSet of the case,
    preferring the first node while it is schedulable."""
    pod = manifest(case, ns, image, n1, bb)
    name = pod["metadata"]["name"]
    spec = pod["spec"]
    spec.pop("nodeSelector")
    spec["terminationGracePeriodSeconds"] = GRACE_S
    prefer = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [n1]}]}
    spec["affinity"] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": prefer}]}
    }
    labels = {"app": name, DRAIN_MARK: ns if case.operation == DRAIN else "no"}
    policy = {
        "apiVersion": K.API_VERSION,
        "kind": K.POLICY_KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "workload": {"kind": "StatefulSet", "name": name},
            "interval": "10m",
            "destination": f"{registry}/e2e/{ns}/{name}",
        },
    }
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }
    return [policy, sts]


def _saved(cluster: Cluster, ns: str, uid: str) -> bool:
    items = cluster.get_json(K.PLURAL, "-n", ns, "-l", f"{K.LABEL_POD_UID}={uid}")["items"]
    return any((s.get("status") or {}).get("phase") == K.PHASE_SUCCEEDED for s in items)


def _replaced(cluster: Cluster, ns: str, name: str, old_uid: str) -> bool:
    p = _pod(cluster, ns, name)
    if p is None or p["metadata"]["uid"] == old_uid or p["metadata"].get("deletionTimestamp"):
        return False
    return _ready(cluster, ns, name)


@pytest.mark.skipif(not PROTECTED, reason="no protected case chosen (KS_CONFORMANCE_ONLY)")
def test_protected_workloads_resume_on_the_other_node(cluster: Cluster, agent: Any) -> None:
    """Each protected case (operation S or D of docs/conformance.md): its StatefulSet pod runs on the first
    node and gets its periodic save; resume cases are deleted with that node cordoned, drain cases are
    drained off it; every replacement on the second node must carry on the same process's state."""
    ns = f"e2e-prot-{uuid.uuid4().hex[:6]}"
    n1, n2 = cluster.nodes[:2]
    cluster.kubectl("create", "namespace", ns)
    problems: dict[str, list[str]] = {c.id: [] for c in PROTECTED}
    try:
        cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={cluster.registry}/e2e/{ns}")
        images = _images(cluster, PROTECTED)
        for c in PROTECTED:
            cluster.apply(_protected(c, ns, images[c.workload.name], n1, cluster.busybox_image, cluster.registry))
        pods: dict[str, dict[str, Any]] = {}
        for c in PROTECTED:
            name = f"{pod_name(c)}-0"
            if not _wait(name, partial(_ready, cluster, ns, name), 420):
                problems[c.id].append(f"never ran: {_why_not_running(cluster, ns, name)}")
                continue
            pods[c.id] = _pod(cluster, ns, name) or {}
            uid = pods[c.id]["metadata"]["uid"]
            if not _wait("its periodic save", partial(_saved, cluster, ns, uid), 240):
                problems[c.id].append("no periodic save within 180 s")
        before = {
            c.id: _exec(cluster, ns, f"{pod_name(c)}-0", c.workload.read) or "" for c in PROTECTED if c.id in pods
        }
        try:
            cluster.kubectl("cordon", n1)
            for c in PROTECTED:
                if c.operation == RESUME and c.id in pods:
                    cluster.kubectl("delete", "pod", f"{pod_name(c)}-0", "-n", ns, "--wait=false")
            if any(c.operation == DRAIN for c in PROTECTED):
                cluster.kubectl(
                    "drain", n1, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s",
                    f"--pod-selector={DRAIN_MARK}={ns}", timeout=300,
                )  # fmt: skip
            for c in PROTECTED:
                if c.id not in pods or problems[c.id]:
                    continue
                name, uid = f"{pod_name(c)}-0", pods[c.id]["metadata"]["uid"]
                if not _wait(f"{name}'s replacement", partial(_replaced, cluster, ns, name, uid), 300):
                    problems[c.id].append(f"no replacement ready: {_why_not_running(cluster, ns, name)}")
                    continue
                new = _pod(cluster, ns, name) or {}
                status = (new["metadata"].get("annotations") or {}).get(K.ANN_RESTORE_STATUS, "")
                if new["spec"].get("nodeName") != n2 or status != K.RESTORE_STAGED:
                    problems[c.id].append(f"replacement on {new['spec'].get('nodeName')}, restore status {status!r}")
                    continue
                after = _exec(cluster, ns, name, c.workload.read) or ""
                # a resume comes from the periodic save, taken at some point after `before` was read or
                # before: the same process (token, pids) but no counter bound; a drain's final save is later
                workload = c.workload if c.operation == DRAIN else replace(c.workload, grows=-1)
                why = carried_on(workload, before[c.id], after) if after else "no state read after"
                if why:
                    problems[c.id].append(f"{why}\nbefore: {before[c.id]}\nafter: {after}")
        finally:
            cluster.kubectl("uncordon", n1, check=False)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    failed = {k: v for k, v in problems.items() if v}
    assert not failed, json.dumps(failed, indent=1)[:8000]


def test_the_suite_covers_at_least_30_cases() -> None:
    assert len(CASES) >= 30 and len({c.workload.name for c in CASES}) >= 7
