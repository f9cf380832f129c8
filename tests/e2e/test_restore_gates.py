"""A restored pod's containers are created while its save downloads (pod staging gates), on the real
cluster: the agent opens the pod's gate once the save is chosen and checked, the kubelet creates the
containers meanwhile, and each create waits in the runtime wrapper for the agent's answer.

The case that is new with it: staging that fails *after* the gate opened (a blob of the save damaged
in the registry, found by its digest during the download). A container the kubelet created by then
must be refused, at every later create too: never run from its image in the snapshot's place. For a
pod this small the download usually fails before the gate container has even started, which then
exits 1 with the reason; either way the pod never runs and says why. (The wrapper's refusal at its
staging gate, deterministically: tests/integration/test_wrapper_pyz.py.) The happy path (created
while downloading, then restored) is every restore of the e2e suite.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry.client import RegistryClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.reference import Reference
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]  # fixtures


def _blob(cluster: Cluster, digest: str) -> Path:
    algo, _, hexa = digest.partition(":")
    return cluster.state_dir / "registry" / "docker/registry/v2/blobs" / algo / hexa[:2] / hexa / "data"


def test_a_restore_that_fails_while_downloading_never_starts_the_container_fresh(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace, agent, plugin
) -> None:
    from tests.e2e.test_snapshot_flows import COUNTER, pod, running

    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("torn", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "torn")
    out = plugin("snapshot", "pod/torn", "-n", namespace, "--to", f"{cluster.registry}/e2e/torn", "-o", "json")
    ref = Reference.parse(json.loads(out.stdout)["status"]["reference"])
    body, _, _ = RegistryClient().get_manifest(ref)
    layers = json.loads(body)["layers"]
    assert layers
    # every blob the download fetches (whichever comes first fails its digest); put back afterwards, as
    # the registry's blob store is shared by every repository (another save may hold the same chunk)
    originals: dict[Path, bytes] = {}
    for layer in layers:
        path = _blob(cluster, layer["digest"])
        if path in originals:
            continue
        originals[path] = data = path.read_bytes()
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0xFF
        path.write_bytes(bytes(damaged))
    try:
        _restore_and_check_refused(cluster, namespace, plugin, ref, n2)
    finally:
        for path, data in originals.items():
            path.write_bytes(data)


def _restore_and_check_refused(cluster: Cluster, namespace: str, plugin: Any, ref: Reference, n2: str) -> None:
    proc = plugin(
        "restore", f"{ref.registry}/{ref.repository}@{ref.digest}", "-n", namespace, "--name", "torn2",
        "--node", n2, "--timeout", "120s", check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "digest" in proc.stderr.lower(), proc.stderr

    def status() -> dict[str, Any]:
        obj: dict[str, Any] = cluster.get_json("pod", "torn2", "-n", namespace)
        return obj

    assert status()["metadata"]["annotations"][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)

    # Whichever came first shows the agent's reason: the gate init container, started after the failure,
    # exits 1 with it (the pod stays in Init); or the gate had exited 0 (the agent opened it before the
    # download), the kubelet created the app container, and the wrapper refused it with that reason.
    def told() -> str:
        st = status()["status"]
        for cs in st.get("containerStatuses") or []:
            message = str(((cs.get("state") or {}).get("waiting") or {}).get("message") or "")
            if "refusing to restore" in message and "staging of this restore failed" in message:
                return "app container refused"
        for cs in st.get("initContainerStatuses") or []:
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                done = state.get("terminated") or {}
                if done.get("exitCode") == 1 and "does not match its digest" in str(done.get("message")):
                    return "gate failed"
        return ""

    deadline = time.monotonic() + 90
    while not told():
        assert time.monotonic() < deadline, f"the pod does not show why its restore failed: {status()['status']}"
        time.sleep(0.5)
    print(f"the failure showed as: {told()}")
    # and it stays so: the app container never runs from its image
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for cs in status()["status"].get("containerStatuses") or []:
            assert "running" not in (cs.get("state") or {}), cs
            assert not cs.get("started"), cs
        time.sleep(1)
