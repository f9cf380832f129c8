"""A pod's two containers holding one TCP connection over loopback, dumped by CRIU and restored one
after the other through the runtime wrapper, as the kubelet does: the connection carries on.

Real containerd (two instances), runc, CRIU 4.2.1 and a registry; the pod's network namespaces
(old and new) are made here (``unshare -n``), as the pause container holds a pod's. The restore side
is what the agent and the kubelet do for a restored pod: stage by pod uid + container name, record
the container set, then create each container with the CRI annotations under the wrapper.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.artifact import load_artifact
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient, RuncOptions
from shim.engine.restore import stage_artifact
from shim.engine.staging import StatePaths
from shim.net.podrestore import LOCK_TABLE, RELEASED_FILE, PodRestore
from shim.runtime_wrapper import ANN_CONTAINER_NAME, ANN_CONTAINER_TYPE, ANN_SANDBOX_UID
from tests.integration.test_agent_roundtrip import WRAPPER, agent, on, unique, wait_for
from tests.support.containerd import ContainerdDaemon, containerd_a, containerd_b
from tests.support.images import busybox_image
from tests.support.nft import nft_tables
from tests.support.registry import registry

pytestmark = pytest.mark.integration
__all__ = ["containerd_a", "containerd_b", "registry"]

SERVER = (
    # nc's own stdin never ends (busybox nc closes the connection when its stdin does); /tmp/eof is
    # written as soon as the connection ends
    'sleep 1000000 | nc -l -p 7000 | { while read tok n; do echo "$tok $n" > /tmp/got.t; mv /tmp/got.t /tmp/got; '
    "done; echo eof > /tmp/eof; }; sleep 100000"
)
CLIENT = (
    "until cat /proc/net/tcp /proc/net/tcp6 | awk '$2 ~ /:1B58$/ && $4 == \"0A\" {f=1} END {exit !f}'; "
    "do sleep 0.1; done; "
    "tok=$(cat /proc/sys/kernel/random/uuid); n=0; "
    'while true; do n=$((n+1)); echo "$tok $n"; usleep 100000; done | nc 127.0.0.1 7000; '
    "echo closed > /tmp/closed; sleep 100000"
)


class Netns:
    """A network namespace with lo up, held by a sleeping process (like a pod sandbox)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 900"])
        self.path = f"/proc/{self.proc.pid}/ns/net"
        wait_for(lambda: "UP" in self.sh("ip -o link show lo"), what="the namespace's lo")

    def sh(self, script: str) -> str:
        r = subprocess.run(["nsenter", f"--net={self.path}", "sh", "-c", script], capture_output=True, text=True)
        return r.stdout + r.stderr

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def netns() -> Iterator[list[Netns]]:
    made: list[Netns] = []
    yield made
    for n in made:
        n.close()


def got(c: ContainerdClient, cid: str) -> tuple[str, int]:
    code, out, _ = c.exec_in_task(cid, ["cat", "/tmp/got"])
    tok, _, n = out.decode().strip().partition(" ")
    return (tok, int(n)) if code == 0 and n else ("", 0)


def exists(c: ContainerdClient, cid: str, path: str) -> bool:
    return c.exec_in_task(cid, ["test", "-e", path])[0] == 0


def pod_spec(spec: Mapping[str, Any], *, cid: str, namespace: str, netns: str, uid: str, name: str) -> dict[str, Any]:
    """The recorded spec as the kubelet would create it in the new pod: new cgroup, netns, CRI annotations."""
    s = copy.deepcopy(dict(spec))
    s["linux"]["cgroupsPath"] = f"/{namespace}/{cid}"
    s["linux"]["namespaces"] = [
        {"type": "network", "path": netns} if ns["type"] == "network" else ns for ns in s["linux"]["namespaces"]
    ]
    s["annotations"] = {ANN_SANDBOX_UID: uid, ANN_CONTAINER_NAME: name, ANN_CONTAINER_TYPE: "container"}
    # the snapshot stores no environment (it may hold secrets); the kubelet's spec has one
    s["process"].setdefault("env", ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
    return s


def test_loopback_tcp_between_two_containers_of_a_pod_survives(  # type: ignore[no-untyped-def]
    containerd_a: ContainerdDaemon, containerd_b: ContainerdDaemon, registry, netns, tmp_path: Path
):
    a, b = containerd_a.client(), containerd_b.client()
    image = busybox_image(containerd_a)
    busybox_image(containerd_b)
    old = Netns()
    netns.append(old)
    srv, cli = unique("server"), unique("client")
    try:
        for cid, script in ((srv, SERVER), (cli, CLIENT)):
            a.run_container(
                cid,
                image=image,
                args=["sh", "-c", script],
                netns_path=old.path,
                runc_options=containerd_a.runc_options,
                log_path=str(tmp_path / f"{cid}.log"),
            )
        try:
            wait_for(lambda: got(a, srv)[1] >= 10, what="the client's messages")
        except BaseException:
            for cid in (srv, cli):
                log = tmp_path / f"{cid}.log"
                print(cid, log.read_text()[-2000:] if log.exists() else "", a.exec_in_task(cid, ["ps"]))
            print(old.sh("ss -tanp"))
            raise
        tok, before = got(a, srv)
        ref = agent("checkpoint", *on(containerd_a), "--stop", "--to", registry.ref("pod-pair", "v1"), srv, cli)
        ref_text = ref.stdout.strip()
    finally:
        for cid in (srv, cli):
            a.remove_container(cid)

    # the new pod: its own network namespace; the agent stages by pod uid + container name
    new = Netns()
    netns.append(new)
    uid = str(uuid.uuid4())
    paths = StatePaths()
    reg = RegistryClient()
    artifact = load_artifact(reg, Reference.parse(ref_text))
    names = [c.name for c in artifact.config.containers]
    pod = PodRestore(paths.pod_dir(uid))
    pod.record(names)
    stage_artifact(artifact, [paths.staged_by_pod(uid, n) for n in names], registry=reg, paths=paths)

    created: list[str] = []
    try:
        for i, rec in enumerate(artifact.config.containers):
            cid = unique(f"r{i}")
            created.append(cid)
            spec = pod_spec(rec.spec, cid=cid, namespace=b.namespace, netns=new.path, uid=uid, name=rec.name)
            rootfs = b.prepare_snapshot("overlayfs", cid, b.image_chain_id(rec.image))
            b.create_container(
                cid,
                image=rec.image,
                spec=spec,
                snapshotter="overlayfs",
                snapshot_key=cid,
                runc_options=RuncOptions(binary_name=WRAPPER, root=containerd_b.runc_root),
            )
            log_uri = "file://" + str(tmp_path / f"{cid}.log")
            b.create_task(cid, rootfs=rootfs, stdout=log_uri, stderr=log_uri)
            if i == 0:
                # one end is back, the other not yet: the pod's network is locked, nothing moves
                assert LOCK_TABLE in nft_tables(new.path)
                time.sleep(1)  # long enough for retransmissions that would meet no peer
            b.start_task(cid)
        assert LOCK_TABLE not in nft_tables(new.path)
        assert (Path(pod.directory) / RELEASED_FILE).exists() and pod.failed() is None
        server, client = created
        wait_for(lambda: got(b, server)[1] > before + 20, timeout=30, what="the restored client's messages")
        assert got(b, server)[0] == tok  # the same client process, over the same connection
        assert not exists(b, client, "/tmp/closed") and not exists(b, server, "/tmp/eof")
    finally:
        for cid in created:
            b.remove_container(cid)
        shutil.rmtree(pod.directory, ignore_errors=True)


UNIX_SERVER = """
import os, socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind('/vol/sock'); s.listen(1)
c, _ = s.accept()
for line in c.makefile():
    open('/tmp/got.t', 'w').write(line); os.rename('/tmp/got.t', '/tmp/got')
time.sleep(100000)
"""
UNIX_CLIENT = """
import os, socket, time
while not os.path.exists('/vol/sock'): time.sleep(0.1)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect('/vol/sock')
n = 0
while True:
    n += 1; c.sendall(f'tok {n}\\n'.encode()); time.sleep(0.1)
"""


def test_a_unix_stream_connection_between_containers_is_found_and_criu_cannot_dump_it(  # type: ignore[no-untyped-def]
    containerd_a: ContainerdDaemon, registry, netns, tmp_path: Path
):
    from shim.net.unixpeers import CrossLink, find_cross_links
    from tests.support.images import python_image

    a = containerd_a.client()
    image = python_image(containerd_a)
    pod_net = Netns()
    netns.append(pod_net)
    vol = tmp_path / "vol"
    vol.mkdir()
    mount = {"destination": "/vol", "type": "bind", "source": str(vol), "options": ["rbind", "rw"]}
    srv, cli = unique("userver"), unique("uclient")
    try:
        pids = [
            a.run_container(
                cid,
                image=image,
                args=["python3", "-c", script],
                mounts=[mount],
                netns_path=pod_net.path,
                runc_options=containerd_a.runc_options,
            )
            for cid, script in ((srv, UNIX_SERVER), (cli, UNIX_CLIENT))
        ]
        wait_for(lambda: got(a, srv)[1] >= 5, what="the client's messages over the Unix socket")
        assert find_cross_links(pids) == [CrossLink(0, 1, "stream", "/vol/sock")]
        assert find_cross_links(pids[:1]) == []
        # what the agent refuses up front is what CRIU cannot do: dump one end of the connection
        # (without --ext-unix-sk: "External socket is used"; with it: "Can't dump half of stream unix connection")
        proc = agent("checkpoint", *on(containerd_a), "--to", registry.ref("usk", "v1"), srv, cli, check=False)
        assert proc.returncode != 0
        assert "External socket is used" in proc.stderr or "half of stream unix" in proc.stderr, proc.stderr
        # and the pair runs on, connection and all
        _, n = got(a, srv)
        wait_for(lambda: got(a, srv)[1] > n, what="the messages to go on")
    finally:
        for cid in (srv, cli):
            a.remove_container(cid)
