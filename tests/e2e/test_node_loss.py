"""A dead node's protected pod comes back on the other node from the last periodic save (issue 13, item 2).

A StatefulSet pod counting in memory runs on ks-n1 under a SnapshotPolicy saving every 20 s. After at
least one periodic save, ks-n1 is killed abruptly (hack/cluster/kill-node.sh: kubelet, containerd,
shims and containers SIGKILLed, nothing graceful). The test then does what an operator's automation
does (docs/node-loss.md): once the control plane sees the node NotReady, it applies the
``node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`` taint, so that Kubernetes deletes the
dead node's pods and the StatefulSet controller makes the replacement. The replacement must run on
ks-n2 resumed from the last save the dead node's agent made (same in-memory token, counter never back
to zero, at most one interval of progress lost), although that save's status.node is the dead node.
It prints the progress lost and the time from the kill to Running, step by step. Whatever happens, the
taint is removed and ks-n1 is started again and Ready (hack/cluster/start-node.sh).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from tests.e2e.test_snapshot_flows import counter_value, running
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.node_loss import good_saves, lost_node, protect, recover, statefulset

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]

INTERVAL_S = 20
NAME = "sts"


def test_killed_node_pod_resumes_on_the_other_node_from_the_last_periodic_save(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    ns, (n1, n2) = namespace, cluster.nodes[:2]
    repo = protect(cluster, ns, NAME, INTERVAL_S)
    cluster.apply(statefulset(NAME, ns, cluster.busybox_image, mib=0, prefer=n1))
    pod = f"{NAME}-0"
    first = running(cluster, ns, pod)
    assert first["spec"]["nodeName"] == n1, "the StatefulSet pod was not scheduled on the node to kill"
    assert first["spec"]["runtimeClassName"] == K.RUNTIME_CLASS  # protected: admission prepared it for resume

    # the counter's rate (counts per second), to turn counts lost into seconds lost
    cluster.wait_for("the counter", lambda: sample(cluster, ns, pod)[1] >= 3, timeout=60)
    tok, v0 = sample(cluster, ns, pod)
    t0 = time.time()
    cluster.wait_for("a periodic save", lambda: bool(good_saves(cluster, ns, NAME)), timeout=INTERVAL_S * 4)
    # kill in the middle of an interval, right after a fresh save (the next one starts INTERVAL_S after it)
    last = good_saves(cluster, ns, NAME)[-1]["metadata"]["name"]
    cluster.wait_for("the next periodic save", lambda: good_saves(cluster, ns, NAME)[-1]["metadata"]["name"] != last,
                     timeout=INTERVAL_S * 3)  # fmt: skip
    time.sleep(INTERVAL_S / 2)
    tok_k, v_kill = sample(cluster, ns, pod)
    t_sample = time.time()
    rate = (v_kill - v0) / (t_sample - t0)
    assert tok_k == tok and rate > 0
    saved = good_saves(cluster, ns, NAME)[-1]

    with lost_node(cluster, n1) as killed:
        cut_off_save(cluster, ns, pod, first["metadata"]["uid"], n1, repo)
        rec = recover(cluster, ns, pod, first["metadata"]["uid"], n1, killed)
        tok2, resumed = sample(cluster, ns, pod)
        counts_lost = v_kill - resumed + round(rate * (killed - t_sample))
        lost_s = counts_lost / rate
        save_s = _seconds(saved["status"]["completionTime"]) - _seconds(saved["status"]["startTime"])
        steps = " ".join(f"{k}={v:.1f}" for k, v in rec.breakdown().items())
        print(
            f"\nnode-loss: interval {INTERVAL_S}s; progress lost {counts_lost} counts = {lost_s:.1f}s "
            f"({lost_s / INTERVAL_S:.2f} of an interval; last save took {save_s:.0f}s); {steps}"
        )
        assert rec.pod["spec"]["nodeName"] == n2
        # the save the dead node left Running was not waited for (the agent waits up to 180 s for a
        # save in progress on a node that is up)
        assert rec.staged - rec.scheduled < 60, rec.breakdown()
        assert tok2 == tok, "the replacement started fresh instead of resuming"
        assert resumed >= 1
        cluster.wait_for("the resumed counter to go on", lambda: sample(cluster, ns, pod)[1] > resumed)
        # it resumed the newest save, which the dead node's agent made (status.node is ks-n1)
        ref = staged_reference(cluster, ns, rec.pod["metadata"]["uid"], agent_log=agent_log(cluster, n2, pod))
        assert _digest(ref) == _digest(saved["status"]["reference"]), (ref, saved["status"])
        assert saved["status"]["node"] == n1
        # at most one interval (plus the save's own duration: a save holds the state of its freeze) lost
        assert 0 <= lost_s <= INTERVAL_S + save_s + 2, (counts_lost, rate, lost_s)

        # the policy keeps protecting the pod where it runs now: the agent on ks-n2 saves it
        def saved_on_n2() -> bool:
            return any(s["status"]["node"] == n2 for s in good_saves(cluster, ns, NAME))

        cluster.wait_for("a periodic save on the new node", saved_on_n2, timeout=INTERVAL_S * 4)
    assert cluster.get_json("pod", pod, "-n", ns)["spec"]["nodeName"] == n2  # nothing moved back
    node = cluster.get_json("node", n1)
    assert not any(t["key"] == "node.kubernetes.io/out-of-service" for t in node["spec"].get("taints") or [])


def cut_off_save(cluster: Cluster, ns: str, pod: str, pod_uid: str, node: str, repo: str) -> None:
    """What a node that dies in the middle of a save leaves: a PodSnapshot of the pod, claimed by that
    node, Running for ever (made here right after the kill, when no save was in progress: created as the
    agent, the only identity admission lets set a save's provenance labels, then marked Running as the
    admin)."""
    body = {
        "apiVersion": K.API_VERSION,
        "kind": K.KIND,
        "metadata": {
            "name": "cut-off",
            "namespace": ns,
            "labels": {
                K.LABEL_WORKLOAD_KIND: "StatefulSet",
                K.LABEL_WORKLOAD_NAME: NAME,
                K.LABEL_POD: pod,
                K.LABEL_POD_UID: pod_uid,
                K.LABEL_POLICY: NAME,  # the agent creates only a policy's saves
            },
        },
        "spec": {"podName": pod, "podNamespace": ns, "destination": f"{repo}:cut-off"},
    }
    cluster.kubectl("--as", K.AGENT_USER, "create", "-f", "-", input=json.dumps(body))
    status = {"status": {"phase": K.PHASE_RUNNING, "node": node}}
    cluster.kubectl(
        "patch", K.PLURAL, "cut-off", "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )


def sample(cluster: Cluster, ns: str, pod: str) -> tuple[str, int]:
    """The counter, retried: while a save freezes the pod, kubectl exec waits or fails."""
    for _ in range(20):
        with contextlib.suppress(AssertionError, ValueError, subprocess.TimeoutExpired):
            return counter_value(cluster, ns, pod)
        time.sleep(0.5)
    return counter_value(cluster, ns, pod)


def agent_log(cluster: Cluster, node: str, pod: str) -> Callable[[], str]:
    """The agent's log lines on `node` that name `pod`: what a failed check shows of the agent's side."""

    def read() -> str:
        pods = cluster.get_json(
            "pods", "-n", K.AGENT_NAMESPACE, "-l", f"app.kubernetes.io/name={K.AGENT_NAME}",
            "--field-selector", f"spec.nodeName={node}",
        )["items"]  # fmt: skip
        out = []
        for p in pods:
            name = p["metadata"]["name"]
            text = cluster.kubectl("logs", name, "-n", K.AGENT_NAMESPACE, "-c", "agent", check=False).stdout
            out += [f"{name}: {line}" for line in text.splitlines() if pod in line][-40:]
            prev = cluster.kubectl("logs", name, "-n", K.AGENT_NAMESPACE, "-c", "agent", "--previous", check=False)
            if prev.returncode == 0:
                out.append(f"{name} restarted; its previous log's last lines:")
                out += prev.stdout.splitlines()[-20:]
        return "\n".join(out)

    return read


def staged_reference(cluster: Cluster, ns: str, uid: str, agent_log: Callable[[], str] = str) -> str:
    """The snapshot reference the agent staged into the pod (its RestoreStaged Event). The agent records
    the Event after it opens the pod's gates, so the pod may run (and count) before the Event is there."""
    events: list[dict[str, Any]] = []

    def recorded() -> list[str]:
        events[:] = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.uid={uid}")["items"]
        return [e["message"] for e in events if e.get("reason") == K.EVENT_RESTORE_STAGED]

    with contextlib.suppress(AssertionError):  # the assert below says which Events there were
        cluster.wait_for("the RestoreStaged Event", lambda: bool(recorded()), timeout=30)
    staged = recorded()
    assert staged, f"{[e.get('reason') for e in events]}\nthe agent's log of the pod:\n{agent_log()}"
    words = staged[-1].split()  # "resume from REFERENCE staged on NODE"
    return str(words[words.index("from") + 1])


def _digest(reference: str) -> str:
    return reference.rpartition("@")[2] or reference


def _seconds(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
