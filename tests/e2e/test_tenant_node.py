"""Issue 10 on the real cluster: what a tenant with only `create pods` can make the node agent do.

The attack of the issue: a pod that carries the restore annotation brings its own gate emptyDir, and
its own init container plants symlinks there pointing at a host file the agent (root, hostPath mounts)
can reach. The restore then fails (the "registry" below answers with an error only after the links are
in place, so the run is deterministic), and the agent used to write that registry's error message
through the link. Now the pod is refused before anything in its volumes is touched, and every gate
write goes through link-free directory fds anyway (unit tests: tests/unit/test_tenant_volumes.py).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.reference import Reference
from shim.criu.guard import CAPABILITIES
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.tamper import (
    agent_signing_key,
    edit_container_layer,
    edit_core_images,
    machine_capabilities,
    namespace_key,
    replay_signature,
    resign,
)

pytestmark = pytest.mark.e2e
STATE_ROOT = Path("/var/lib/kubectl-snapshot")


class _HeldRegistry(BaseHTTPRequestHandler):
    """Answers every request with a 500 and a body of the tenant's choosing, once `release` is set."""

    release = threading.Event()
    body = b""
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        type(self).release.wait(120)
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_HEAD = do_GET

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def held_registry() -> Iterator[tuple[str, type[_HeldRegistry]]]:
    handler: type[_HeldRegistry] = type("Held", (_HeldRegistry,), {"release": threading.Event(), "hits": 0})
    handler.body = json.dumps({"errors": [{"code": "X", "message": "#!/bin/sh\necho tenant-owned-"}]}).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def test_symlink_in_the_pods_own_gate_volume_reaches_no_host_file(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace, agent, held_registry
) -> None:
    registry, handler = held_registry
    node = cluster.nodes[0]
    victim = STATE_ROOT / node / f"e2e-victim-{secrets.token_hex(4)}"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text("host file the tenant must not write\n")
    try:
        plant = f"ln -s {victim} /gate/.failed.tmp && ln -s {victim} /gate/failed && ls -l /gate"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "evil",
                "namespace": namespace,
                "annotations": {K.ANN_RESTORE_FROM: f"{registry}/evil/x@sha256:{'0' * 64}"},
            },
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "terminationGracePeriodSeconds": 1,
                "initContainers": [
                    {
                        "name": "plant",
                        "image": cluster.busybox_image,
                        "command": ["sh", "-c", plant],
                        "volumeMounts": [{"name": K.GATE_VOLUME, "mountPath": "/gate"}],
                    }
                ],
                "containers": [{"name": "c", "image": cluster.busybox_image, "command": ["sleep", "3600"]}],
                "volumes": [{"name": K.GATE_VOLUME, "emptyDir": {}}],
            },
        }
        cluster.apply(pod)

        def planted() -> bool:
            obj = cluster.get_json("pod", "evil", "-n", namespace)
            states = [s.get("state") or {} for s in obj["status"].get("initContainerStatuses") or []]
            return bool(states) and "terminated" in states[0]

        cluster.wait_for("the tenant's init container to plant its links", planted, 120)
        handler.release.set()  # now let the "registry" answer with its error

        def decided() -> bool:
            ann = cluster.get_json("pod", "evil", "-n", namespace)["metadata"].get("annotations") or {}
            return K.ANN_RESTORE_STATUS in ann

        cluster.wait_for("the agent to decide on the pod", decided, 120)
        assert victim.read_text() == "host file the tenant must not write\n"
        assert not victim.is_symlink()
        ann = cluster.get_json("pod", "evil", "-n", namespace)["metadata"]["annotations"]
        assert ann[K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)
        assert "not a restore pod" in ann[K.ANN_RESTORE_STATUS], ann
        events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
        assert K.EVENT_RESTORE_FAILED in events
    finally:
        victim.unlink(missing_ok=True)


def test_memory_backed_empty_dir_is_captured_and_restored(cluster: Cluster, namespace, agent, plugin) -> None:  # type: ignore[no-untyped-def]
    """Item 6: a `medium: Memory` emptyDir is a tmpfs the kubelet mounts after the agent started."""
    from tests.e2e.test_snapshot_flows import WRITER, pod, read, running

    n1, n2 = cluster.nodes[:2]
    manifest = pod("mem", namespace, cluster.busybox_image, {"writer": WRITER}, node=n1, empty_dir=True)
    manifest["spec"]["volumes"] = [{"name": "vol", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}]
    cluster.apply(manifest)
    running(cluster, namespace, "mem")
    mounts = cluster.kubectl("exec", "-n", namespace, "mem", "-c", "writer", "--", "cat", "/proc/mounts").stdout
    assert any(line.split()[1] == "/vol" and line.split()[2] == "tmpfs" for line in mounts.splitlines()), mounts
    cluster.wait_for("the writer", lambda: int(read(cluster, namespace, "mem", "writer", "/vol/seq") or 0) > 200)
    out = plugin("snapshot", "pod/mem", "-n", namespace, "--to", f"{cluster.registry}/e2e/mem", "--stop", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    plugin("restore", psnap["status"]["reference"], "-n", namespace, "--name", "mem2", "--node", n2)
    restored = running(cluster, namespace, "mem2")
    vol = next(v for v in restored["spec"]["volumes"] if v["name"] == "vol")
    assert vol["emptyDir"]["medium"] == "Memory"
    seq = int(read(cluster, namespace, "mem2", "writer", "/vol/seq"))
    assert seq > 200  # the tmpfs came back with its contents
    mine = int(read(cluster, namespace, "mem2", "writer", "/tmp/mine"))
    # The writer runs on (memory first, then the volume, each round): read after the volume, the
    # counter in memory is at least the volume's, i.e. it carried on from the snapshot, not from 0.
    assert mine >= seq - 1


def _restore(plugin, ref: Reference, namespace: str, name: str, node: str) -> Any:  # type: ignore[no-untyped-def]
    return plugin(
        "restore", f"{ref.registry}/{ref.repository}@{ref.digest}", "-n", namespace, "--name", name,
        "--node", node, "--timeout", "120s", check=False,
    )  # fmt: skip


def _never_ran_privileged(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """The restore of `name` is marked failed, its container never ran, and no process of the pod on
    its node holds CAP_SYS_ADMIN (the nodes share this machine's kernel: /proc is theirs)."""

    def failed() -> bool:
        ann = cluster.get_json("pod", name, "-n", namespace)["metadata"].get("annotations") or {}
        return str(ann.get(K.ANN_RESTORE_STATUS, "")).startswith(K.RESTORE_FAILED_PREFIX)

    cluster.wait_for(f"the agent to mark the restore of {name} failed", failed, 60)
    obj: dict[str, Any] = cluster.get_json("pod", name, "-n", namespace)
    assert not any("running" in (s.get("state") or {}) for s in obj["status"].get("containerStatuses") or []), obj
    uid = obj["metadata"]["uid"]
    for proc in Path("/proc").iterdir():
        try:
            cgroup = (proc / "cgroup").read_text()
            status = (proc / "status").read_text()
        except OSError:
            continue  # not a process, or gone
        if status.startswith("Name:\trunc:["):
            continue  # runc's own init while the kubelet creates a container again: runc's code, not the pod's
        if uid in cgroup or uid.replace("-", "_") in cgroup:
            cap_eff = int(next(x for x in status.splitlines() if x.startswith("CapEff:")).split()[1], 16)
            assert not cap_eff & (1 << CAPABILITIES.index("CAP_SYS_ADMIN")), (proc, status)
    return obj


def test_edited_criu_images_cannot_restore_more_capabilities_than_the_pod_has(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace, agent, plugin
) -> None:
    """Item 2, the issue's second attack, against today's sealed and signed snapshots: every capability
    this machine has put into the CRIU images of a pod that dropped them all (and ran RuntimeDefault
    seccomp, no_new_privs), the layer resealed with the namespace's own key (the worst case: the key
    Secret leaked), pushed under a new tag of the same repository.

    1. Without the node's signing key the attacker can only replay the original signature: the agent
       refuses before it downloads a layer (provenance).
    2. With the signing key of the node that took the save stolen as well (re-signed here as its agent
       signs, with the original's signed origin), the artifact passes every provenance check, and
       only the CRIU image check (shim/criu/guard.py) stands between it and a privileged process: the
       agent runs it against the pod spec's bound while staging (shim/engine/precheck.py), and the runtime
       wrapper again against config.json before `runc restore`; it refuses, naming the capabilities, in
       the restore's status and the pod's Events. Without that check the restore goes through (the
       issue's attack at c436d96: CapEff 000001fffeffffff), and both the exit status and the message
       asserted below fail.
    """
    from tests.e2e.test_snapshot_flows import COUNTER, pod, running

    n1, n2 = cluster.nodes[:2]
    manifest = pod("locked", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1)
    manifest["spec"]["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    manifest["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False,
    }
    cluster.apply(manifest)
    running(cluster, namespace, "locked")
    out = plugin("snapshot", "pod/locked", "-n", namespace, "--to", f"{cluster.registry}/e2e/locked", "-o", "json")
    ref = Reference.parse(json.loads(out.stdout)["status"]["reference"])
    every = machine_capabilities()

    def grant_all(creds: dict[str, Any]) -> None:
        for key in ("cap_eff", "cap_prm", "cap_bnd", "cap_inh"):
            creds[key] = list(every)

    evil = edit_container_layer(
        ref,
        Reference.parse(f"{cluster.registry}/e2e/locked:edited"),
        lambda layer: edit_core_images(layer, grant_all),
        key=namespace_key(cluster, namespace),
    )
    assert evil.digest != ref.digest

    # 1. a tenant: push rights and (worst case) its namespace's key, not the signing key
    replay_signature(ref, evil)
    proc = _restore(plugin, evil, namespace, "replayed", n2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a signature replayed onto another snapshot" in proc.stderr, proc.stderr
    _never_ran_privileged(cluster, namespace, "replayed")

    # 2. the signing key stolen too: the artifact is valid in every way the agent can check
    resign(ref, evil, agent_signing_key(n1))  # the key of the node the save was taken on
    proc = _restore(plugin, evil, namespace, "locked2", n2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "grant more than the container's spec" in proc.stderr, proc.stderr
    assert "capabilities" in proc.stderr and "CAP_SYS_ADMIN" in proc.stderr, proc.stderr
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=locked2").stdout
    assert "grant more than the container's spec" in events, events
    assert K.EVENT_RESTORE_REFUSED in events, events  # told apart from a failure
    obj = _never_ran_privileged(cluster, namespace, "locked2")
    status = obj["metadata"]["annotations"][K.ANN_RESTORE_STATUS]
    assert "refusing to restore" in status and "CAP_SYS_ADMIN" in status, status
