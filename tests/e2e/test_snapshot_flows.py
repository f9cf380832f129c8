"""`kubectl snapshot` end to end on the real two-node cluster: snapshot, restore on the other node,
migrate, tenancy and failures. The plugin runs as a user runs it (a subprocess); the agent runs as
the DaemonSet installed by `kubectl snapshot install`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.reference import Reference
from tests.support.agent import AgentInstall, agent, assert_installed_criu_ran, criu_launches, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.containerd import tmpfs_large_folios

pytestmark = pytest.mark.e2e

COUNTER = (
    "tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 0.2; done'
)
WRITER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/mine.t; mv /tmp/mine.t /tmp/mine; "
    "echo $i > /vol/seq.t; mv /vol/seq.t /vol/seq; usleep 2000; done"
)
READER = "while true; do v=$(cat /vol/seq 2>/dev/null) && echo ${v:-0} > /tmp/seen.t && mv /tmp/seen.t /tmp/seen; done"


def pod(
    name: str, ns: str, image: str, containers: dict[str, str], *, node: str, empty_dir: bool = False
) -> dict[str, Any]:
    mounts = [{"name": "vol", "mountPath": "/vol"}] if empty_dir else []
    spec: dict[str, Any] = {
        "containers": [
            {"name": cname, "image": image, "command": ["sh", "-c", cmd], "volumeMounts": mounts}
            for cname, cmd in containers.items()
        ],
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 1,
    }
    if empty_dir:
        spec["volumes"] = [{"name": "vol", "emptyDir": {}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": spec,
    }


def running(cluster: Cluster, ns: str, name: str, timeout: float = 180) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def ok() -> bool:
        nonlocal last
        r = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
        if r.returncode != 0:
            return False
        last = json.loads(r.stdout)
        return bool(last["status"].get("phase") == "Running")

    try:
        cluster.wait_for(f"pod {ns}/{name} Running", ok, timeout)
    except AssertionError:
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        raise AssertionError(f"{name}: {json.dumps(last.get('status'))[:2000]}\n{events[-3000:]}") from None
    return last


def read(cluster: Cluster, ns: str, name: str, container: str, path: str) -> str:
    """`cat path` in the container. A pod of an autosave policy is frozen while a save dumps it (runc then
    refuses an exec: "cannot exec in a paused container"): asked again until the save has thawed it."""
    deadline = time.monotonic() + 30
    while True:
        proc = cluster.kubectl("exec", "-n", ns, name, "-c", container, "--", "cat", path, check=False)
        if proc.returncode == 0 or "paused container" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl exec -n {ns} {name} -c {container} -- cat {path} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def counter_value(cluster: Cluster, ns: str, name: str, container: str = "counter") -> tuple[str, int]:
    tok, value = read(cluster, ns, name, container, "/tmp/count").split()
    return tok, int(value)


def test_snapshot_then_restore_on_the_other_node(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("counter", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "counter")
    cluster.wait_for("the counter to reach 10", lambda: counter_value(cluster, namespace, "counter")[1] >= 10)
    tok, before = counter_value(cluster, namespace, "counter")
    launched = {n: len(criu_launches(n)) for n in (n1, n2)}

    out = plugin("snapshot", "pod/counter", "-n", namespace, "--to", f"{cluster.registry}/e2e/counter", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    ref = psnap["status"]["reference"]
    assert ref.startswith(f"{cluster.registry}/e2e/counter@sha256:")
    RegistryClient().get_manifest(Reference.parse(ref))  # the digest resolves in the registry
    assert psnap["status"]["node"] == n1
    # the agent (a container with hostPID) froze the pod's container through the host's cgroupfs itself
    assert psnap["status"]["frozenBy"] == "cgroup freezer", psnap["status"]
    # the dump ran the CRIU that install-node put in the node's directory (runc --criu), not the host's
    assert_installed_criu_ran(n1, "checkpoint", launched[n1])
    # a small pod's dump went to the host's tmpfs the DaemonSet mounts (shim/host/memwork.py), not the disk
    logs = cluster.kubectl(
        "logs", "-n", "kubectl-snapshot-system", "-l", "app.kubernetes.io/name=kubectl-snapshot-agent", "-c", "agent",
        "--tail=-1", check=False,
    ).stdout  # fmt: skip
    mine = [line for line in logs.splitlines() if f"{namespace}/{psnap['metadata']['name']}: snapshot" in line]
    assert mine and all(line.endswith("dumped to memory") for line in mine), logs[-3000:]
    assert "dumps go to disk, not memory" not in logs, logs[-3000:]
    # into the tmpfs with large folios install-node mounted on the agent's area (shim/host/workfs.py)
    assert not tmpfs_large_folios() or "install-node's tmpfs with large folios" in logs, logs[-3000:]
    listed = cluster.get_json("podsnapshots", "-n", namespace)["items"]
    assert [x["metadata"]["name"] for x in listed] == [psnap["metadata"]["name"]]

    cluster.kubectl("delete", "pod", "counter", "-n", namespace, "--wait=true")
    restoring = plugin("restore", psnap["metadata"]["name"], "-n", namespace, "--name", "counter2", "--node", n2)
    # the counter mounts its ServiceAccount token (the default): its processes may hold the old pod's (C13)
    assert "warning: the restored processes of container(s) counter may hold" in restoring.stderr, restoring.stderr
    restored = running(cluster, namespace, "counter2")
    assert restored["spec"]["nodeName"] == n2
    tok2, after = counter_value(cluster, namespace, "counter2")
    assert tok2 == tok  # the same process memory, not a fresh start
    assert after >= before
    cluster.wait_for("the restored counter to go on", lambda: counter_value(cluster, namespace, "counter2")[1] > after)
    assert restored["metadata"]["annotations"]["kubectl-snapshot.io/restore-from"].endswith(ref.split("@")[1])
    assert_installed_criu_ran(n2, "restore", launched[n2])  # through the runtime wrapper, with the installed CRIU
    # the snapshot and the restore each left an Event saying where and what (threat D12): kubectl describe
    saved = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.kind=PodSnapshot")
    assert "SnapshotSucceeded" in {e["reason"] for e in saved["items"]}, saved["items"]
    uid = restored["metadata"]["uid"]
    told: list[dict[str, str]] = []

    def staged() -> list[str]:  # posted once the gates are answered: it may follow the pod's start
        told[:] = cluster.get_json("events", "-n", namespace, "--field-selector", f"involvedObject.uid={uid}")["items"]
        return [e["message"] for e in told if e["reason"] == K.EVENT_RESTORE_STAGED]

    cluster.wait_for("the RestoreStaged Event", lambda: bool(staged()), timeout=30)
    assert ref.split("@")[1] in staged()[0] and f"staged on {n2}" in staged()[0], told

    def cloned() -> list[dict[str, str]]:  # posted right after RestoreStaged
        staged()
        return [e for e in told if e["reason"] == K.EVENT_CLONED_TOKEN]

    cluster.wait_for("the ClonedServiceAccountToken Event", lambda: bool(cloned()), timeout=30)
    assert cloned()[0]["type"] == "Warning", told
    assert "stops working once the old pod is deleted" in cloned()[0]["message"], told


def test_two_containers_sharing_an_empty_dir(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(
        pod("pair", namespace, cluster.busybox_image, {"writer": WRITER, "reader": READER}, node=n1, empty_dir=True)
    )
    running(cluster, namespace, "pair")
    cluster.wait_for("the writer", lambda: int(read(cluster, namespace, "pair", "writer", "/vol/seq") or 0) > 200)
    out = plugin(
        "snapshot", "pod/pair", "-n", namespace, "--to", f"{cluster.registry}/e2e/pair", "--stop", "-o", "json"
    )
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded"
    # --stop: the original pod is gone once the snapshot is in the registry
    cluster.wait_for(
        "the original to be deleted",
        lambda: cluster.kubectl("get", "pod", "pair", "-n", namespace, check=False).returncode != 0,
    )
    plugin("restore", psnap["status"]["reference"], "-n", namespace, "--name", "pair2", "--node", n2)
    running(cluster, namespace, "pair2")
    seq_restored = int(read(cluster, namespace, "pair2", "writer", "/vol/seq"))
    assert seq_restored > 200  # the emptyDir came back with its contents
    for _ in range(10):
        seen = int(read(cluster, namespace, "pair2", "reader", "/tmp/seen") or 0)
        seq = int(read(cluster, namespace, "pair2", "writer", "/vol/seq"))
        assert seen <= seq


def test_migrate_moves_the_pod_and_deletes_the_original_after(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("mover", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "mover")
    cluster.wait_for("the counter", lambda: counter_value(cluster, namespace, "mover")[1] >= 5)
    tok, before = counter_value(cluster, namespace, "mover")
    out = plugin(
        "migrate", "pod/mover", "-n", namespace, "--node", n2, "--to", f"{cluster.registry}/e2e/mover", "-o", "json"
    )
    new_name = json.loads(out.stdout)["restored"]["name"]
    moved = running(cluster, namespace, new_name)
    assert moved["spec"]["nodeName"] == n2
    cluster.wait_for(
        "the original to be gone",
        lambda: cluster.kubectl("get", "pod", "mover", "-n", namespace, check=False).returncode != 0,
        timeout=60,
    )
    tok2, after = counter_value(cluster, namespace, new_name)
    assert tok2 == tok and after >= before


def _psnap(ns: str, name: str, pod_name: str, destination: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubectl-snapshot.io/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podName": pod_name, "destination": destination, **spec},
    }


def _final(cluster: Cluster, ns: str, name: str, timeout: float = 120) -> dict[str, Any]:
    obj: dict[str, Any] = {}

    def done() -> bool:
        nonlocal obj
        obj = cluster.get_json("podsnapshot", name, "-n", ns)
        return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    cluster.wait_for(f"podsnapshot {name} to finish", done, timeout)
    return obj


def test_agent_refuses_a_pod_of_another_namespace(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    other = f"e2e-other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", other)
    try:
        cluster.apply(pod("victim", other, cluster.busybox_image, {"c": "sleep 3600"}, node=cluster.nodes[0]))
        running(cluster, other, "victim")
        steal = _psnap(namespace, "steal", "victim", f"{cluster.registry}/e2e/steal:v1", podNamespace=other)
        # refused at admission now (deploy/admission.py), even for the cluster admin; the agent refuses too
        proc = cluster.kubectl("create", "-f", "-", input=json.dumps(steal), check=False)
        assert proc.returncode != 0 and "spec.podNamespace must be empty or" in proc.stderr, proc.stderr
        assert cluster.kubectl("get", "podsnapshot", "steal", "-n", namespace, check=False).returncode != 0
        with pytest.raises(NotFound):
            RegistryClient().get_manifest(Reference.parse(f"{cluster.registry}/e2e/steal:v1"))
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_unreachable_registry_fails_and_the_pod_keeps_running(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    cluster.apply(pod("keep", namespace, cluster.busybox_image, {"counter": COUNTER}, node=cluster.nodes[0]))
    running(cluster, namespace, "keep")
    proc = plugin("snapshot", "pod/keep", "-n", namespace, "--to", "127.0.0.1:1/nowhere", "--stop", check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "127.0.0.1:1" in proc.stderr
    status = running(cluster, namespace, "keep")["status"]
    assert all(cs.get("restartCount", 0) == 0 for cs in status["containerStatuses"])
    _, v = counter_value(cluster, namespace, "keep")
    cluster.wait_for("the counter to go on", lambda: counter_value(cluster, namespace, "keep")[1] > v)


def test_bad_input_gives_clear_errors(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    proc = plugin("snapshot", "pod/nope", "-n", namespace, "--to", f"{cluster.registry}/e2e/x", check=False)
    assert proc.returncode == 1 and "error:" in proc.stderr and "nope" in proc.stderr
    proc = plugin("restore", f"{cluster.registry}/e2e/does-not-exist:v1", "-n", namespace, check=False)
    assert proc.returncode == 1 and "error:" in proc.stderr


def test_restore_onto_a_node_without_an_agent(cluster, namespace, agent: AgentInstall, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("lonely", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "lonely")
    ref = json.loads(
        plugin("snapshot", "pod/lonely", "-n", namespace, "--to", f"{cluster.registry}/e2e/lonely", "-o", "json").stdout
    )["status"]["reference"]
    with agent.without_agent_on(n2):
        proc = plugin("restore", ref, "-n", namespace, "--name", "lonely2", "--node", n2, check=False)
    assert proc.returncode == 1
    assert f"no kubectl-snapshot agent is ready on node {n2}" in proc.stderr
    assert cluster.kubectl("get", "pod", "lonely2", "-n", namespace, check=False).returncode != 0  # nothing created
    running(cluster, namespace, "lonely")


def test_restore_onto_a_node_that_cannot(cluster, namespace, agent: AgentInstall, plugin):  # type: ignore[no-untyped-def]
    """Preflight: the target node's CRIU is missing -> the restore fails with the reason, nothing runs."""
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("pre", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "pre")
    out = plugin("snapshot", "pod/pre", "-n", namespace, "--to", f"{cluster.registry}/e2e/pre", "-o", "json")
    ref = json.loads(out.stdout)["status"]["reference"]
    with agent.node_override(n2, criuPath="/nonexistent/criu"):
        proc = plugin("restore", ref, "-n", namespace, "--name", "pre2", "--node", n2, "--timeout", "120s", check=False)
        agent_pod = agent.agent_pod(n2)
        logs = (
            ""
            if agent_pod is None
            else cluster.kubectl(
                "logs", "-n", "kubectl-snapshot-system", agent_pod["metadata"]["name"], "--all-containers", check=False
            ).stdout[-3000:]
        )
    assert proc.returncode == 1
    assert "CRIU is not installed" in proc.stderr, proc.stderr + "\nagent on n2:\n" + logs
    assert running(cluster, namespace, "pre")  # the original is untouched
    time.sleep(0)
