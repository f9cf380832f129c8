"""A snapshot pushed to another repository of the same registry mounts the blobs the earlier snapshot's
repository has (`ks-agent checkpoint --mount-from`, what the agent does with the pod's earlier snapshots),
on real containerd, runc, CRIU and the registry; the bytes sent are counted by a loopback proxy."""

from __future__ import annotations

import json
import time

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from tests.integration.test_agent_roundtrip import agent, cleanup, on, unique
from tests.integration.test_incremental import HEAP_MIB, heap_workload
from tests.support.containerd import containerd_a
from tests.support.faulty_proxy import FaultyProxy
from tests.support.registry import registry

pytestmark = pytest.mark.integration


def mounted(proxy: FaultyProxy) -> list[tuple[str, str, int]]:
    return [r for r in proxy.requests if r[0] == "POST" and "mount=" in r[1] and r[2] == 201]


def test_snapshot_to_another_repository_mounts_instead_of_uploading(  # type: ignore[no-untyped-def]
    containerd_a, registry, heap_workload, cleanup
):
    _, cid = heap_workload
    host, port = registry.host.split(":")
    first, second = unique("mount-a"), unique("mount-b")
    with FaultyProxy(host, int(port)) as proxy:
        out1 = json.loads(
            agent("checkpoint", *on(containerd_a), "-o", "json", "--to", f"{proxy.host}/{first}:v1", cid).stdout
        )
        sent1 = proxy.body_bytes
        out2 = json.loads(
            agent(
                "checkpoint", *on(containerd_a), "-o", "json", "--to", f"{proxy.host}/{second}:v1",
                "--mount-from", first, cid,
            ).stdout
        )  # fmt: skip
        sent2 = proxy.body_bytes - sent1
        deadline = time.monotonic() + 5  # the proxy records a request once it relayed the answer
        while len(mounted(proxy)) < out2["mounted"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sent1 >= HEAP_MIB << 20  # the first snapshot sent the (incompressible) heap
    assert out2["mounted"] > 0 and len(mounted(proxy)) == out2["mounted"]
    assert sent2 < 0.25 * sent1, (sent1, sent2)  # the heap's chunks were mounted, not sent again
    # every blob of the second manifest is served by the second repository itself
    reg = RegistryClient()
    ref2 = Reference.parse(out2["reference"].replace(proxy.host, registry.host))
    manifest = parse_manifest(reg.get_manifest(ref2)[0])
    assert all(reg.blob_exists(ref2, d.digest) for d in [manifest.config, *manifest.layers])
    assert out1["size"] > 0
