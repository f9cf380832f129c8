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

from kubectl_snapshot.core import kube as K
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

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
    handler = type("Held", (_HeldRegistry,), {"release": threading.Event(), "hits": 0})
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


def _edit_core_images(layer: bytes, edit: Any) -> bytes:
    """A container layer (tar.zst) with `edit(creds)` applied to every core-*.img under checkpoint/."""
    import io
    import tarfile

    import pycriu.images as images
    import zstandard

    raw = zstandard.ZstdDecompressor().decompressobj().decompress(layer)
    out = io.BytesIO()
    edited = 0
    with (
        tarfile.open(fileobj=io.BytesIO(raw)) as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in src:
            data = src.extractfile(m).read() if m.isreg() else None  # type: ignore[union-attr]
            name = m.name.split("/")[-1]
            if data is not None and name.startswith("core-") and name.endswith(".img"):
                img = images.load(io.BytesIO(data))
                for entry in img["entries"]:
                    edit(entry["thread_core"]["creds"])
                buf = io.BytesIO()
                images.dump(img, buf)
                data = buf.getvalue()
                m.size = len(data)
                edited += 1
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    assert edited, "no core image in the layer"
    return zstandard.ZstdCompressor().compress(out.getvalue())


@pytest.mark.xfail(
    strict=False,
    reason="known: snapshots are sealed by default since the encryption merge and this test edits layers in clear; it must reseal with the namespace key (the image check itself is covered by tests/unit/test_criu_guard.py and test_wrapper_pyz.py)",  # noqa: E501
)
def test_edited_criu_images_cannot_restore_more_capabilities_than_the_pod_has(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace, agent, plugin
) -> None:
    """Item 2, the issue's second attack: every capability put into the images of a pod that dropped
    them all (and ran RuntimeDefault seccomp). The real runtime wrapper refuses before runc restore,
    and the reason reaches the user through the restore's status and the pod's Events."""
    import hashlib

    from kubectl_snapshot.adapters.registry import RegistryClient
    from kubectl_snapshot.core.oci import parse_manifest
    from kubectl_snapshot.core.reference import Reference
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

    # the tenant's edit: download, change the credentials in the CRIU images, push as a new artifact
    reg = RegistryClient()
    body, _, _ = reg.get_manifest(ref)
    man = json.loads(body)
    config = json.loads(reg.read_blob(ref, man["config"]["digest"], max_size=16 << 20))
    every = [0xFFFFFFFF, 0x1FF]
    rec = config["containers"][0]
    old_layer = rec["layer"]
    layer_desc = next(x for x in man["layers"] if x["digest"] == old_layer)
    import io

    buf = io.BytesIO()
    reg.fetch_blob(ref, old_layer, buf)

    def grant_all(creds: dict[str, Any]) -> None:
        for key in ("cap_eff", "cap_prm", "cap_bnd", "cap_inh"):
            creds[key] = list(every)

    new_layer = _edit_core_images(buf.getvalue(), grant_all)
    new_digest = "sha256:" + hashlib.sha256(new_layer).hexdigest()
    evil = Reference.parse(f"{cluster.registry}/e2e/locked-evil:v1")
    reg.push_blob(evil, digest=new_digest, size=len(new_layer), data=new_layer)
    rec["layer"] = new_digest
    config_bytes = json.dumps(config).encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    reg.push_blob(evil, digest=config_digest, size=len(config_bytes), data=config_bytes)
    for layer in man["layers"]:
        if layer["digest"] != old_layer:  # chunks and volumes: copied unchanged
            b = io.BytesIO()
            reg.fetch_blob(ref, layer["digest"], b)
            reg.push_blob(evil, digest=layer["digest"], size=layer["size"], data=b.getvalue())
    layer_desc.update(digest=new_digest, size=len(new_layer))
    man["config"].update(digest=config_digest, size=len(config_bytes))
    parse_manifest(json.dumps(man).encode())  # still a valid snapshot manifest
    evil_digest = reg.push_manifest(evil, json.dumps(man).encode(), man["mediaType"])

    proc = plugin(
        "restore", f"{evil.registry}/{evil.repository}@{evil_digest}", "-n", namespace, "--name", "locked2",
        "--node", n2, "--timeout", "120s", check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "grant more than the container's spec" in proc.stderr, proc.stderr
    assert "CAP_SYS_ADMIN" in proc.stderr
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=locked2").stdout
    assert "grant more than the container's spec" in events, events

    # nothing of the edited snapshot runs: the container never started
    def status_failed() -> bool:
        ann = cluster.get_json("pod", "locked2", "-n", namespace)["metadata"].get("annotations") or {}
        return str(ann.get(K.ANN_RESTORE_STATUS, "")).startswith(K.RESTORE_FAILED_PREFIX)

    cluster.wait_for("the agent to mark the restore failed", status_failed, 60)
    obj = cluster.get_json("pod", "locked2", "-n", namespace)
    assert "refusing to restore" in obj["metadata"]["annotations"][K.ANN_RESTORE_STATUS]
    assert not any("running" in (s.get("state") or {}) for s in obj["status"].get("containerStatuses") or [])
