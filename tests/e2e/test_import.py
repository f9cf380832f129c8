"""A checkpoint taken with the real kubelet's checkpoint API (POST .../nodes/NODE/proxy/checkpoint/NS/POD/
CONTAINER: ContainerCheckpoint, on by default in 1.36) imported with `ks-agent import`, signed by the
importer's own key, and restored on the other node by `kubectl snapshot restore` once an administrator
lists that key: the same process carries on counting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kubectl_snapshot.core import kubenames as K
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import cluster, namespace
from tests.support.signing import write_key

pytestmark = pytest.mark.e2e
KS_AGENT = str(Path(sys.executable).with_name("ks-agent"))


def ks_agent(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECTL_SNAPSHOT_")}
    return subprocess.run([KS_AGENT, *args], capture_output=True, text=True, timeout=300, env=env)


def test_a_kubelet_checkpoint_imports_and_restores_on_the_other_node(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, tmp_path
):
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("kubeletckpt", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "kubeletckpt")
    cluster.wait_for("the counter to reach 5", lambda: counter_value(cluster, namespace, "kubeletckpt")[1] >= 5)
    tok, before = counter_value(cluster, namespace, "kubeletckpt")

    # the kubelet's own checkpoint, through the API server's node proxy
    done = cluster.kubectl(
        "create", "--raw", f"/api/v1/nodes/{n1}/proxy/checkpoint/{namespace}/kubeletckpt/counter",
        "-f", "-", input="", timeout=120,
    )  # fmt: skip
    (written,) = json.loads(done.stdout)["items"]
    archive = cluster.checkpoint_dir(n1) / Path(written).name
    assert archive.is_file(), written
    with tarfile.open(archive) as tar:  # what the kubelet wrote, for the messages below
        members = {m.name: m.size for m in tar.getmembers() if not m.name.startswith("checkpoint/")}
        diff = tar.extractfile("rootfs-diff.tar") if "rootfs-diff.tar" in members else None
        diff_head = diff.read(4) if diff is not None else b""
    written_by = f"the kubelet's archive: {members}, rootfs-diff.tar starts {diff_head!r}"
    manifest = tmp_path / "pod.json"
    manifest.write_text(cluster.kubectl("get", "pod", "kubeletckpt", "-n", namespace, "-o", "json").stdout)
    key = write_key(tmp_path / "keys", "importer")
    target = f"{cluster.registry}/e2e/imported:kubelet"

    # not a checkpoint archive: a clear error, and no tag
    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"not a tar" * 1000)
    refused = ks_agent("import", str(bogus), "--to", f"{cluster.registry}/e2e/imported:bogus")
    assert refused.returncode != 0 and "error:" in refused.stderr and "hint:" in refused.stderr, refused.stderr
    assert "not a tar archive" in refused.stderr

    imported = ks_agent(
        "import", str(archive), "--to", target, "--signing-key", str(key.private),
        "--pod-manifest", str(manifest), "--node", n1, "-o", "json",
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    out = json.loads(imported.stdout)
    assert (out["container"], out["pod"], out["namespace"], out["from"]) == (
        "counter",
        "kubeletckpt",
        namespace,
        "containerd",
    )
    ref = out["reference"]
    assert out["signedBy"] == key.key.public.id

    # inspect: verified with the importer's key, its origin marked imported
    info = json.loads(plugin("inspect", ref, "-o", "json").stdout)
    assert [c["name"] for c in info["containers"]] == ["counter"], info

    # untrusted until an administrator lists the importer's key
    cluster.kubectl("delete", "pod", "kubeletckpt", "-n", namespace, "--wait=true")
    denied = plugin(
        "restore", ref, "-n", namespace, "--name", "imported2", "--node", n2, "--timeout", "60s", check=False
    )
    assert denied.returncode != 0, denied.stdout
    cluster.kubectl("delete", "pod", "imported2", "-n", namespace, "--ignore-not-found", "--wait=true")
    entry, scope = f"{key.key.public.id}.pub", f"{key.key.public.id}.namespace"

    def list_key(namespace_of_key: str) -> None:
        patch = json.dumps({"data": {entry: key.public.read_text(), scope: namespace_of_key}})
        cluster.kubectl(
            "patch", "configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE, "--type", "merge", "-p", patch
        )

    try:
        # listed for another namespace (kubectl snapshot install --importer-key NS=PUB.pem): still refused
        list_key("some-other-namespace")
        wrong = plugin(
            "restore", ref, "-n", namespace, "--name", "imported2", "--node", n2, "--timeout", "60s", check=False
        )
        assert wrong.returncode != 0 and "trusted for namespace some-other-namespace only" in wrong.stderr, wrong.stderr
        cluster.kubectl("delete", "pod", "imported2", "-n", namespace, "--ignore-not-found", "--wait=true")
        list_key(namespace)
        done = plugin("restore", ref, "-n", namespace, "--name", "imported3", "--node", n2, check=False)
        assert done.returncode == 0, f"{done.stderr}\n{written_by}"
        restored = running(cluster, namespace, "imported3")
        assert restored["spec"]["nodeName"] == n2
        tok2, after = counter_value(cluster, namespace, "imported3")
        assert tok2 == tok  # the same process memory, not a fresh start
        assert after >= before  # counted on from where the kubelet's checkpoint left it
        cluster.wait_for(
            "the restored counter to go on", lambda: counter_value(cluster, namespace, "imported3")[1] > after
        )
    finally:
        unpatch = json.dumps({"data": {entry: None, scope: None}})
        cluster.kubectl(
            "patch", "configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE, "--type", "merge", "-p", unpatch
        )
        archive.unlink(missing_ok=True)
