"""A cluster's snapshot exported as podman's checkpoint archive by an administrator: `ks-agent export
--from-cluster` opens the snapshot the agent sealed with the namespace's key from the agents' Secret,
verifies its signature with the trust ConfigMap; checkpointctl reads the file and podman restores the
pod's container on the host, its process carrying on (the bind mounts' sources are the node's, on this
same machine; the pod's network namespace is replaced by one of podman's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import cluster, namespace
from tests.support.podman import checkpointctl_bin, podman, podman_read, require_podman, restore_flags

pytestmark = pytest.mark.e2e
KS_AGENT = str(Path(sys.executable).with_name("ks-agent"))


def test_an_administrator_exports_a_sealed_cluster_snapshot_that_podman_restores_and_checkpointctl_reads(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, tmp_path
):
    n1 = cluster.nodes[0]
    cluster.apply(pod("exported", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "exported")
    cluster.wait_for("the counter to reach 3", lambda: counter_value(cluster, namespace, "exported")[1] >= 3)
    out = plugin("snapshot", "pod/exported", "-n", namespace, "--to", f"{cluster.registry}/e2e/exported", "-o", "json")
    ref = json.loads(out.stdout)["status"]["reference"]
    node = ["-a", str(cluster.containerd_socket(n1)), "-n", "k8s.io"]  # the image's id, from the node's containerd

    def export(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECTL_SNAPSHOT_")}
        env["KUBECONFIG"] = str(cluster.kubeconfig)
        return subprocess.run(
            [KS_AGENT, "export", *node, ref, *args], capture_output=True, text=True, timeout=300, env=env
        )

    archive = tmp_path / "exported.tar"
    require_podman()
    name = f"ks-{namespace}"  # podman's name for the restored container: this test's own
    # sealed with the namespace's key: without the agents' keys it is refused, and nothing is written
    empty = tmp_path / "no-keys"
    empty.mkdir()
    refused = export("-o", str(archive), "--key-dir", str(empty), "--trusted-key", str(empty))
    assert refused.returncode != 0 and "error:" in refused.stderr, refused.stderr
    assert not archive.exists()
    # the administrator's export: the agents' keys and trust from the cluster
    done = export("-o", str(archive), "--from-cluster", "--name", name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(archive)
    assert "unencrypted" in done.stderr
    # what a pod's container cannot take along is said
    assert "joined its pod's" in done.stderr and "bind-mounts host paths" in done.stderr, done.stderr
    assert archive.stat().st_mode & 0o777 == 0o600

    show = subprocess.run([checkpointctl_bin(), "show", str(archive)], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stderr
    assert name in show.stdout and cluster.busybox_image in show.stdout, show.stdout  # the --name given
    inspect = subprocess.run(
        [checkpointctl_bin(), "inspect", str(archive), "--ps-tree", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert '"sh"' in json.dumps(json.loads(inspect.stdout))

    # podman restores the pod's container on the host: the same process (its token), counting on
    tok, _ = counter_value(cluster, namespace, "exported")
    podman("pull", "--tls-verify=false", cluster.busybox_image, timeout=300)  # the image the pod ran
    podman("rm", "-f", name, check=False)
    try:
        podman("container", "restore", "--import", str(archive), *restore_flags(done.stderr), timeout=300)
        tok_after, restored = podman_read(name)
        assert tok_after == tok, "podman's container started fresh instead of resuming the pod's process"
        assert restored >= 1
        deadline = time.monotonic() + 30
        while podman_read(name)[1] <= restored:
            assert time.monotonic() < deadline, "the restored counter does not count on"
            time.sleep(0.5)
    finally:
        podman("rm", "-f", name, check=False)
