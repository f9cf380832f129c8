"""Losing a node of the local cluster, and what a protected pod on it goes through (docs/node-loss.md).

Shared by tests/e2e/test_node_loss.py and bench/recovery.py. ``lost_node(cluster, node)`` kills the
node abruptly (hack/cluster/kill-node.sh) and always brings it back (hack/cluster/start-node.sh, the
out-of-service taint removed, Ready, its DaemonSet pods Ready); ``recover`` plays the operator's
automation after the kill: it waits until the control plane sees the node NotReady, applies the
``node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`` taint, and times what follows for the
StatefulSet pod that ran there, polling the API server (a timestamp on an object has a resolution of
one second; the polls see each step within ~0.25 s).

Only under the e2e lock (/run/ks-e2e.lock): a killed node disrupts every other user of the cluster.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.policyspec import policy_object
from tests.support.cluster import HACK, Cluster

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
OUT_OF_SERVICE_TAINT = f"{OUT_OF_SERVICE}=nodeshutdown:NoExecute"
POLL_S = 0.25

# Counts in memory (a fresh start draws a new token) and, with MIB > 0, first fills that much of its
# shell's memory with incompressible data (base64 of random bytes: 3/4 of it entropy).
COUNTING = (
    "hold=$(head -c {fill} /dev/urandom | base64 -w0); tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 0.2; done'
)


def counting_command(mib: int) -> str:
    return COUNTING.format(fill=(mib << 20) * 3 // 4)


def statefulset(name: str, ns: str, image: str, *, mib: int, prefer: str) -> dict[str, Any]:
    """One replica counting in memory, preferring node `prefer` (the scheduler may use the other)."""
    affinity = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "preference": {
                        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [prefer]}]
                    },
                }
            ]
        }
    }
    container: dict[str, Any] = {"name": "counter", "image": image, "command": ["sh", "-c", counting_command(mib)]}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 1, "affinity": affinity},
            },
        },
    }


def protect(cluster: Cluster, ns: str, name: str, interval_s: int, *, keep: int = 3) -> str:
    """A SnapshotPolicy saving StatefulSet `name`'s pods every interval_s into the cluster's registry
    (which the namespace is told to allow: the agent, no namespace admin, creates the saves)."""
    repo = f"{cluster.registry}/e2e/{ns}/{name}"
    cluster.kubectl("annotate", "--overwrite", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={repo}")
    cluster.apply(
        policy_object(
            name=name,
            namespace=ns,
            selector={"app": name},
            interval=f"{interval_s}s",
            destination=repo,
            workload={"kind": "StatefulSet", "name": name},
            keep_last=keep,
        )
    )
    return repo


def policy_saves(cluster: Cluster, ns: str, policy: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(K.PLURAL, "-n", ns, "-l", f"{K.LABEL_POLICY}={policy}")["items"]
    return items


def good_saves(cluster: Cluster, ns: str, policy: str) -> list[dict[str, Any]]:
    """The policy's Succeeded saves, oldest first."""
    good = [s for s in policy_saves(cluster, ns, policy) if (s.get("status") or {}).get("phase") == K.PHASE_SUCCEEDED]
    return sorted(good, key=lambda s: str(s["status"].get("completionTime")) + s["metadata"]["name"])


def node_ready(cluster: Cluster, node: str) -> str:
    """The node's Ready condition status as the API server has it: True, False or Unknown."""
    conds = cluster.get_json("node", node)["status"].get("conditions") or []
    return next((str(c["status"]) for c in conds if c["type"] == "Ready"), "Unknown")


def _script(name: str, node: str, timeout: float) -> None:
    r = subprocess.run([str(HACK / name), node], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"hack/cluster/{name} {node} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def kill_node(node: str) -> None:
    _script("kill-node.sh", node, 120)


def start_node(node: str) -> None:
    _script("start-node.sh", node, 600)


@contextlib.contextmanager
def lost_node(cluster: Cluster, node: str) -> Iterator[float]:
    """Kill `node` now (yields the wall-clock time of the kill); whatever happens in the block, take
    the out-of-service taint off, start the node again and wait until it and its agent are Ready."""
    try:
        t = time.time()
        kill_node(node)
        yield t
    finally:
        cluster.kubectl("taint", "node", node, f"{OUT_OF_SERVICE}-", check=False)
        start_node(node)
        assert node_ready(cluster, node) == "True", f"{node} is not Ready after start-node.sh"


@dataclass
class Recovery:
    """Wall-clock times (time.time()) of each step after the kill, as first seen by polling."""

    killed: float
    not_ready: float = 0.0  # the node's Ready condition left True (node-monitor grace period)
    tainted: float = 0.0  # the automation applied the out-of-service taint
    old_gone: float = 0.0  # the dead node's pod object is deleted (taint eviction + pod GC)
    created: float = 0.0  # the StatefulSet controller's replacement exists
    scheduled: float = 0.0  # ... bound to a node
    staged: float = 0.0  # the agent there pulled and staged the save (restore-status: Staged)
    running: float = 0.0  # the replacement runs (restored)
    pod: dict[str, Any] = field(default_factory=dict)  # the replacement as last seen

    def breakdown(self) -> dict[str, float]:
        """Seconds per step: detection, taint (the automation), rescheduling, pull (stage), restore."""
        return {
            "detection_s": self.not_ready - self.killed,
            "taint_s": self.tainted - self.not_ready,
            "rescheduling_s": self.scheduled - self.tainted,
            "pull_s": self.staged - self.scheduled,
            "restore_s": self.running - self.staged,
            "kill_to_running_s": self.running - self.killed,
        }


def recover(
    cluster: Cluster, ns: str, pod: str, old_uid: str, dead: str, killed: float, *, timeout: float = 300
) -> Recovery:
    """After `dead` was killed at `killed`: wait for NotReady, taint it out of service (what the
    operator's automation does), and follow the StatefulSet's pod `pod` until its replacement runs."""
    rec = Recovery(killed=killed)
    deadline = time.monotonic() + timeout

    def poll(what: str) -> None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s after killing {dead}, waiting for {what}")
        time.sleep(POLL_S)

    while node_ready(cluster, dead) == "True":
        poll(f"{dead} to be NotReady")
    rec.not_ready = time.time()
    cluster.kubectl("taint", "node", dead, OUT_OF_SERVICE_TAINT, "--overwrite")
    rec.tainted = time.time()
    while True:
        r = cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "json", check=False)
        now = time.time()
        if r.returncode == 0:
            p = json.loads(r.stdout)
            if p["metadata"]["uid"] != old_uid:
                rec.pod = p
                rec.old_gone = rec.old_gone or now
                rec.created = rec.created or now
                if p["spec"].get("nodeName"):
                    rec.scheduled = rec.scheduled or now
                ann = p["metadata"].get("annotations") or {}
                if ann.get(K.ANN_RESTORE_STATUS) == K.RESTORE_STAGED:
                    rec.staged = rec.staged or now
                elif str(ann.get(K.ANN_RESTORE_STATUS, "")).startswith(
                    (K.RESTORE_SKIPPED_PREFIX, K.RESTORE_FAILED_PREFIX)
                ):
                    raise AssertionError(f"the replacement started fresh: {ann.get(K.ANN_RESTORE_STATUS)}")
                if p["status"].get("phase") == "Running":
                    rec.running = now
                    rec.staged = rec.staged or now
                    return rec
        else:
            rec.old_gone = rec.old_gone or now
        poll(f"a replacement of {ns}/{pod} Running")
