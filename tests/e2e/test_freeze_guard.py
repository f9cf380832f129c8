"""A frozen pod is thawed within seconds, whatever happens to the agent (issue 18), on the real cluster.

The agent DaemonSet runs with the test-only KUBECTL_SNAPSHOT_TEST_FROZEN_HOLD_S while these tests run:
the agent keeps the pod frozen (up to that long) before dumping, so that the test can reach it while it
is frozen. Then the agent's process is killed (SIGKILL: the kubelet restarts its container), several
times in a row; stopped (SIGSTOP: the freeze guard thaws at the deadline); or its whole pod is deleted.
Each time the workload runs again within 2 s of the kill or of the deadline, from where it was (the
same process and token: nothing lost, no container restarted) and its PodSnapshot ends Failed with
the reason within seconds. The test reads the workload's cgroup freezer and counter from the host (the
cluster's nodes are processes of this machine); `kubectl exec` then shows the pod answers.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from shim.containerd.client import ContainerdClient
from shim.engine.checkpoint import ENV_TEST_FROZEN_HOLD_S
from shim.host import freezer
from tests.e2e.test_snapshot_flows import COUNTER, pod, running
from tests.support.agent import AgentInstall, agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e

HOLD_S = 120  # far past any deadline here: only a kill or the guard ends a freeze


def _psnap(ns: str, name: str, pod_name: str, destination: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": K.API_VERSION,
        "kind": K.KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podName": pod_name, "destination": destination, **spec},
    }


def task_pid(cluster: Cluster, node: str, container_id: str) -> int:
    with ContainerdClient(str(cluster.containerd_socket(node)), K.CONTAINERD_K8S_NAMESPACE) as c:
        task = c.get_task(container_id.split("://", 1)[1])
    assert task is not None
    return int(task.pid)


def container_status(pod_obj: dict[str, Any], name: str) -> dict[str, Any]:
    [cs] = [c for c in pod_obj["status"]["containerStatuses"] if c["name"] == name]
    return cs  # type: ignore[no-any-return]


def count(pid: int) -> tuple[str, int]:
    """The counter, through the task's root from the host (an exec would hang while it is frozen)."""
    for _ in range(100):
        parts = Path(f"/proc/{pid}/root/tmp/count").read_text().split()
        if len(parts) == 2:
            return parts[0], int(parts[1])
        time.sleep(0.01)
    raise AssertionError("the counter file stays empty")


class Victim:
    """A counter pod on the first node, seen from the host: its task, its freezer, its counter."""

    def __init__(self, cluster: Cluster, ns: str, name: str) -> None:
        self.cluster, self.ns, self.name, self.node = cluster, ns, name, cluster.nodes[0]
        cluster.apply(pod(name, ns, cluster.busybox_image, {"counter": COUNTER}, node=self.node))
        obj = running(cluster, ns, name)
        cs = container_status(obj, "counter")
        self.pid = task_pid(cluster, self.node, cs["containerID"])
        fz = freezer.lookup(self.pid)
        assert fz is not None, "the workload's cgroup freezer should be placeable from the host"
        self.fz = fz
        self.token = count(self.pid)[0]

    def snapshot(self, name: str, **spec: Any) -> float:
        """Create a PodSnapshot and return when its pod is frozen (monotonic time)."""
        self.cluster.apply(_psnap(self.ns, name, self.name, f"{self.cluster.registry}/e2e/guard:{name}", **spec))
        deadline = time.monotonic() + 90
        while not self.fz.frozen():
            assert time.monotonic() < deadline, f"{name}: the pod was never frozen"
            time.sleep(0.01)
        frozen_at = time.monotonic()
        before = count(self.pid)
        time.sleep(0.6)  # the counter ticks every 0.2 s when it runs
        assert count(self.pid) == before, "the counter went on while frozen"
        self.before = before
        return frozen_at

    def seconds_until_thawed(self, since: float, limit: float) -> float:
        while self.fz.frozen():
            assert time.monotonic() - since < limit, f"still frozen {limit} s later"
            time.sleep(0.01)
        return time.monotonic() - since

    def assert_intact(self) -> None:
        """It answers, goes on from where it was in the same process, and no container restarted."""
        deadline = time.monotonic() + 10
        while count(self.pid)[1] <= self.before[1] + 2:
            assert time.monotonic() < deadline, "the counter did not go on"
            time.sleep(0.05)
        out = self.cluster.kubectl("exec", "-n", self.ns, self.name, "--", "cat", "/tmp/count", timeout=20).stdout
        tok, value = out.split()
        assert tok == self.token and int(value) > self.before[1]
        obj = self.cluster.get_json("pod", self.name, "-n", self.ns)
        assert container_status(obj, "counter")["restartCount"] == 0

    def failed_within(self, name: str, since: float, limit: float) -> dict[str, Any]:
        while True:
            obj = self.cluster.get_json("podsnapshot", name, "-n", self.ns)
            status = obj.get("status") or {}
            if status.get("phase") == K.PHASE_FAILED:
                return status
            assert status.get("phase") != K.PHASE_SUCCEEDED, status
            assert time.monotonic() - since < limit, f"{name} not Failed {limit} s later: {status}"
            time.sleep(0.2)


def agent_status(agent: AgentInstall, node: str) -> tuple[dict[str, Any], dict[str, Any]]:
    p = agent.agent_pod(node)
    assert p is not None
    return p, container_status(p, "agent")


def wait_agent_back(agent: AgentInstall, node: str, restarts_before: int, timeout: float = 240) -> None:
    def back() -> bool:
        p = agent.agent_pod(node)
        if p is None or p["metadata"].get("deletionTimestamp"):
            return False
        cs = [c for c in p["status"].get("containerStatuses", []) if c["name"] == "agent"]
        return bool(cs and cs[0]["restartCount"] > restarts_before and cs[0].get("ready"))

    agent.cluster.wait_for(f"the agent on {node} to come back", back, timeout)


def _hold_env(agent: AgentInstall, value: str | None) -> None:
    setting = f"{ENV_TEST_FROZEN_HOLD_S}={value}" if value else f"{ENV_TEST_FROZEN_HOLD_S}-"
    agent.cluster.kubectl("set", "env", f"daemonset/{K.AGENT_NAME}", "-n", K.AGENT_NAMESPACE, "-c", "agent", setting)

    def rolled() -> bool:
        for node in agent.cluster.nodes:
            p = agent.agent_pod(node)
            if p is None or p["metadata"].get("deletionTimestamp"):
                return False
            [c] = [c for c in p["spec"]["containers"] if c["name"] == "agent"]
            has = any(e["name"] == ENV_TEST_FROZEN_HOLD_S for e in c.get("env", []))
            ready = any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"].get("conditions", []))
            if has != bool(value) or not ready:
                return False
        return True

    agent.cluster.wait_for("the agent DaemonSet to roll out", rolled, 300)


# --- the liveness preflight (the agent as installed, no test hold) ---------------------------------


def test_a_snapshot_that_would_outlast_a_liveness_probe_is_refused(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    body = pod("live", namespace, cluster.busybox_image, {"counter": COUNTER}, node=cluster.nodes[0])
    body["spec"]["containers"][0]["livenessProbe"] = {
        "exec": {"command": ["true"]},
        "periodSeconds": 10,
        "failureThreshold": 1,  # one probe that does not answer within a second restarts it
        "timeoutSeconds": 1,
    }
    cluster.apply(body)
    running(cluster, namespace, "live")
    refused = plugin("pod/live", "-n", namespace, "--to", f"{cluster.registry}/e2e/live", check=False)
    assert refused.returncode == 1
    assert "liveness probe of container 'counter'" in refused.stderr and "--ignore-liveness" in refused.stderr
    ok = plugin("pod/live", "-n", namespace, "--to", f"{cluster.registry}/e2e/live", "--ignore-liveness", "-o", "json")
    status = json.loads(ok.stdout)["status"]
    assert status["phase"] == K.PHASE_SUCCEEDED and status["freezeDeadlineSeconds"] > 0


# --- the freeze guard (the agent holds each freeze for HOLD_S) -------------------------------------


@pytest.fixture(scope="module")
def holding_agent(agent: AgentInstall) -> Iterator[AgentInstall]:
    _hold_env(agent, str(HOLD_S))
    try:
        yield agent
    finally:
        _hold_env(agent, None)


def test_sigkill_of_the_agent_thaws_within_two_seconds_every_time(cluster, namespace, holding_agent):  # type: ignore[no-untyped-def]
    victim = Victim(cluster, namespace, "killed")
    for i in range(3):
        agent_pod, agent_cs = agent_status(holding_agent, victim.node)
        restarts = agent_cs["restartCount"]
        agent_pid = task_pid(cluster, victim.node, agent_cs["containerID"])
        name = f"kill-{i}-{uuid.uuid4().hex[:4]}"
        victim.snapshot(name)
        t_kill = time.monotonic()
        os.kill(agent_pid, signal.SIGKILL)
        assert victim.seconds_until_thawed(t_kill, limit=10) < 2.0, f"round {i}"
        status = victim.failed_within(name, t_kill, limit=10)
        assert "freeze guard" in status["message"] and "went away" in status["message"], status["message"]
        victim.assert_intact()
        # the kubelet restarts the agent's container; the guard's container runs on untouched
        wait_agent_back(holding_agent, victim.node, restarts)
        again, _ = agent_status(holding_agent, victim.node)
        assert again["metadata"]["uid"] == agent_pod["metadata"]["uid"]
        assert container_status(again, "guard")["restartCount"] == container_status(agent_pod, "guard")["restartCount"]


def test_a_hung_agent_is_thawed_at_the_deadline(cluster, namespace, holding_agent):  # type: ignore[no-untyped-def]
    victim = Victim(cluster, namespace, "hung")
    _, agent_cs = agent_status(holding_agent, victim.node)
    agent_pid = task_pid(cluster, victim.node, agent_cs["containerID"])
    name = f"hung-{uuid.uuid4().hex[:4]}"
    frozen_at = victim.snapshot(name)
    os.kill(agent_pid, signal.SIGSTOP)
    try:
        obj = cluster.get_json("podsnapshot", name, "-n", namespace)
        deadline_s = float(obj["status"]["freezeDeadlineSeconds"])
        assert deadline_s < HOLD_S
        waited = victim.seconds_until_thawed(frozen_at, limit=deadline_s + 10)
        assert deadline_s - 1.0 < waited < deadline_s + 2.0, (waited, deadline_s)
        status = victim.failed_within(name, time.monotonic(), limit=10)
        assert "deadline" in status["message"], status["message"]
        victim.assert_intact()
    finally:
        os.kill(agent_pid, signal.SIGCONT)

    # the agent goes on, finds its hold expired and fails the snapshot itself: never Succeeded
    def agent_reported() -> bool:
        st = cluster.get_json("podsnapshot", name, "-n", namespace)["status"]
        assert st["phase"] == K.PHASE_FAILED, st
        return "before the dump ended" in st["message"]

    cluster.wait_for("the resumed agent to fail the snapshot itself", agent_reported, 120)
    victim.assert_intact()


def test_deleting_the_agents_pod_thaws_within_two_seconds(cluster, namespace, holding_agent):  # type: ignore[no-untyped-def]
    victim = Victim(cluster, namespace, "deleted")
    agent_pod, _ = agent_status(holding_agent, victim.node)
    name = f"deleted-{uuid.uuid4().hex[:4]}"
    victim.snapshot(name)
    t_kill = time.monotonic()
    cluster.kubectl(
        "delete", "pod", "-n", K.AGENT_NAMESPACE, agent_pod["metadata"]["name"], "--wait=false"
    )  # both containers get SIGTERM
    assert victim.seconds_until_thawed(t_kill, limit=10) < 2.0
    status = victim.failed_within(name, t_kill, limit=15)
    assert "freeze guard" in status["message"], status["message"]
    victim.assert_intact()
    holding_agent.wait_ready(victim.node, not_uid=agent_pod["metadata"]["uid"])
