"""Whole-pod restore on the real cluster: connections between a pod's containers survive a move to the
other node, connections that leave the pod are closed at once, Unix stream sockets between containers
are refused up front, and a pod of which one container cannot be restored fails whole."""

from __future__ import annotations

import json
import shutil
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.reference import Reference
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.images import push_tarball, python_tarball

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]

# server and client hold ONE TCP connection over loopback; the client sends "<token> <n>" every 0.2 s
SERVER = (
    # nc's own stdin never ends (busybox nc closes the connection when its stdin does); /tmp/eof is
    # written as soon as the connection ends
    'sleep 1000000 | nc -l -p 7000 | { while read tok n; do echo "$tok $n" > /tmp/got.t; mv /tmp/got.t /tmp/got; '
    "done; echo eof > /tmp/eof; }; sleep 100000"
)
CLIENT = (
    "until cat /proc/net/tcp /proc/net/tcp6 | awk '$2 ~ /:1B58$/ && $4 == \"0A\" {f=1} END {exit !f}'; "
    "do sleep 0.2; done; "
    "tok=$(cat /proc/sys/kernel/random/uuid); n=0; "
    'while true; do n=$((n+1)); echo "$tok $n"; sleep 0.2; done | nc 127.0.0.1 7000; '
    "echo closed > /tmp/closed; sleep 100000"
)
# a connection that leaves the pod (to another pod's address): it cannot follow the pod to n2
AWAY = "while true; do echo x; sleep 0.5; done | nc {ip} 7001; echo closed > /tmp/closed; sleep 100000"
FAR = "while true; do sleep 1000000 | nc -l -p 7001 > /dev/null; done"
COUNTER = (
    "tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 0.2; done'
)


def _pod(name: str, ns: str, image: str, containers: dict[str, list[str]], node: str, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": c, "image": image, "command": cmd} for c, cmd in containers.items()],
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 1,
        **extra,
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def _get(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = json.loads(cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
    return pod


def _running(cluster: Cluster, ns: str, name: str, timeout: float = 180) -> dict[str, Any]:
    def ok() -> bool:
        r = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
        if r.returncode != 0:
            return False
        st = json.loads(r.stdout)["status"]
        cs = st.get("containerStatuses") or []
        return st.get("phase") == "Running" and bool(cs) and all("running" in (c.get("state") or {}) for c in cs)

    try:
        cluster.wait_for(f"pod {ns}/{name} running", ok, timeout)
    except AssertionError:
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        st = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False).stdout
        raise AssertionError(f"{name}: {st[-3000:]}\n{events[-3000:]}") from None
    return _get(cluster, ns, name)


def _cat(cluster: Cluster, ns: str, pod: str, container: str, path: str) -> str:
    r = cluster.kubectl("exec", "-n", ns, pod, "-c", container, "--", "cat", path, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def _got(cluster: Cluster, ns: str, pod: str) -> tuple[str, int]:
    text = _cat(cluster, ns, pod, "server", "/tmp/got")
    tok, _, n = text.partition(" ")
    return tok, int(n or 0)


def _restarts(pod: dict[str, Any]) -> dict[str, int]:
    return {c["name"]: c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or []}


def test_loopback_tcp_between_containers_survives_and_outside_connections_close(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    ns = namespace
    cluster.apply(_pod("far", ns, cluster.busybox_image, {"far": _sh(FAR)}, n1))
    far_ip = _running(cluster, ns, "far")["status"]["podIP"]
    containers = {"server": _sh(SERVER), "client": _sh(CLIENT), "away": _sh(AWAY.format(ip=far_ip))}
    cluster.apply(_pod("conn", ns, cluster.busybox_image, containers, n1))
    _running(cluster, ns, "conn")
    cluster.wait_for("the client's messages", lambda: _got(cluster, ns, "conn")[1] >= 10, timeout=60)
    tok, before = _got(cluster, ns, "conn")
    assert _cat(cluster, ns, "conn", "away", "/tmp/closed") == ""  # connected to the other pod, open

    out = plugin("snapshot", "pod/conn", "-n", ns, "--to", f"{cluster.registry}/e2e/conn", "--stop", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    cluster.wait_for(
        "the original to be deleted",
        lambda: cluster.kubectl("get", "pod", "conn", "-n", ns, check=False).returncode != 0,
    )
    plugin("restore", psnap["metadata"]["name"], "-n", ns, "--name", "conn2", "--node", n2)
    restored = _running(cluster, ns, "conn2")
    assert restored["spec"]["nodeName"] == n2

    # the loopback connection carries on: the same client process (token), its count goes on
    cluster.wait_for(
        "the restored client's messages to arrive",
        lambda: _got(cluster, ns, "conn2")[1] > before + 5,
        timeout=60,
    )
    tok2, _ = _got(cluster, ns, "conn2")
    assert tok2 == tok
    assert _cat(cluster, ns, "conn2", "client", "/tmp/closed") == ""
    assert _cat(cluster, ns, "conn2", "server", "/tmp/eof") == ""
    # the connection to the other pod did not hang: the application saw it closed and went on
    cluster.wait_for(
        "the outside connection to be closed",
        lambda: _cat(cluster, ns, "conn2", "away", "/tmp/closed") == "closed",
        timeout=30,
    )
    assert _restarts(_get(cluster, ns, "conn2")) == {"server": 0, "client": 0, "away": 0}


def _push_python_image(cluster: Cluster) -> str:
    """Push the cached python test image (an OCI layout tarball) into the cluster's registry."""
    push_tarball(cluster.registry, python_tarball(), "kubectl-snapshot-test/python:1")
    return f"{cluster.registry}/kubectl-snapshot-test/python:1"


UNIX_SERVER = """
import os, socket
os.makedirs('/vol', exist_ok=True)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind('/vol/sock'); s.listen(1)
c, _ = s.accept()
f = c.makefile()
for line in f:
    open('/tmp/got.t', 'w').write(line); os.rename('/tmp/got.t', '/tmp/got')
open('/tmp/eof', 'w').write('eof')
import time; time.sleep(100000)
"""
UNIX_CLIENT = """
import os, socket, time
while not os.path.exists('/vol/sock'): time.sleep(0.2)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect('/vol/sock')
tok, n = os.urandom(16).hex(), 0  # python3-minimal (the test image) has no uuid module
while True:
    n += 1; c.sendall(f'{tok} {n}\\n'.encode()); time.sleep(0.2)
"""


def test_unix_stream_socket_between_containers_is_refused_up_front(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns = namespace
    image = _push_python_image(cluster)
    containers = {"server": ["python3", "-c", UNIX_SERVER], "client": ["python3", "-c", UNIX_CLIENT]}
    manifest = _pod("usk", ns, image, containers, cluster.nodes[0], volumes=[{"name": "vol", "emptyDir": {}}])
    for c in manifest["spec"]["containers"]:
        c["volumeMounts"] = [{"name": "vol", "mountPath": "/vol"}]
    cluster.apply(manifest)
    _running(cluster, ns, "usk", timeout=300)
    cluster.wait_for("the client's messages", lambda: _got(cluster, ns, "usk")[1] >= 5, timeout=60)

    proc = plugin("snapshot", "pod/usk", "-n", ns, "--to", f"{cluster.registry}/e2e/usk", "--stop", check=False)
    assert proc.returncode == 1
    assert "connected to each other by Unix sockets" in proc.stderr, proc.stderr
    assert "'server' and 'client' (stream socket, /vol/sock)" in proc.stderr, proc.stderr
    # refused before anything was frozen or stopped: the pod runs on, connection and all
    _, n = _got(cluster, ns, "usk")
    cluster.wait_for("the messages to go on", lambda: _got(cluster, ns, "usk")[1] > n, timeout=30)
    assert _restarts(_get(cluster, ns, "usk")) == {"server": 0, "client": 0}


def test_a_pod_that_cannot_be_restored_whole_fails_and_nothing_starts_fresh(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    ns = namespace
    host_dir = Path(f"/tmp/ks-e2e-whole-pod-{uuid.uuid4().hex[:8]}")
    host_dir.mkdir()
    (host_dir / "held").write_text("held open by the holder container\n")
    try:
        containers = {
            "counter": _sh(COUNTER),
            "holder": _sh("exec 3</data/held; while true; do sleep 1; done"),
        }
        manifest = _pod(
            "broken",
            ns,
            cluster.busybox_image,
            containers,
            n1,
            volumes=[{"name": "data", "hostPath": {"path": str(host_dir), "type": "Directory"}}],
        )
        manifest["spec"]["containers"][1]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
        cluster.apply(manifest)
        _running(cluster, ns, "broken")
        to = f"{cluster.registry}/e2e/broken"
        out = plugin("snapshot", "pod/broken", "-n", ns, "--to", to, "--stop", "-o", "json")
        psnap = json.loads(out.stdout)
        assert psnap["status"]["phase"] == "Succeeded", psnap
        cluster.wait_for(
            "the original to be deleted",
            lambda: cluster.kubectl("get", "pod", "broken", "-n", ns, check=False).returncode != 0,
        )
        # the file the holder had open is gone: CRIU cannot restore that container, the counter it can
        (host_dir / "held").unlink()

        proc = plugin(
            "restore",
            psnap["metadata"]["name"],
            "-n",
            ns,
            "--name",
            "broken2",
            "--node",
            n2,
            "--timeout",
            "180s",
            check=False,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr

        def reported() -> bool:
            ann = (_get(cluster, ns, "broken2")["metadata"].get("annotations") or {}).get(K.ANN_RESTORE_STATUS, "")
            return str(ann).startswith(K.RESTORE_FAILED_PREFIX + "the pod could not be restored whole")

        cluster.wait_for("the agent to report the pod failed", reported, timeout=90)
        ann = _get(cluster, ns, "broken2")["metadata"]["annotations"][K.ANN_RESTORE_STATUS]
        assert "holder" in ann, ann
        events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=broken2").stdout
        assert K.EVENT_RESTORE_FAILED in events, events

        # none of its containers runs, now or after the kubelet's restarts (its back-off starts at 10 s)
        def none_running() -> bool:
            cs = _get(cluster, ns, "broken2")["status"].get("containerStatuses") or []
            return not any("running" in (c.get("state") or {}) for c in cs)

        cluster.wait_for("the restored counter to be stopped", none_running, timeout=60)
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            pod = _get(cluster, ns, "broken2")
            running = [c["name"] for c in pod["status"].get("containerStatuses") or [] if "running" in c["state"]]
            assert running == [], pod["status"]
            time.sleep(1)
        waiting = [
            (c.get("state") or {}).get("waiting", {}).get("message", "")
            for c in _get(cluster, ns, "broken2")["status"]["containerStatuses"]
        ]
        # the runtime's refusal, as the kubelet reports it: in the waiting message until the back-off
        # replaces it, and in the pod's Events either way
        events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=broken2")
        said = "\n".join(waiting) + events.stdout
        assert "restore failed" in said or "not started from scratch" in said, said
    finally:
        cluster.kubectl("delete", "pod", "broken2", "-n", ns, "--wait=false", check=False)
        shutil.rmtree(host_dir, ignore_errors=True)
