"""Concurrent requests on one pod and on one snapshot, on the real two-node cluster (threats A7, C14).

- A7: five PodSnapshots of one pod created at once. The node's agent claims each once and runs the
  saves through its dump gate (one freeze at a time on a node: shim/controller/dumpgate.py, unit-tested
  in tests/unit/test_dumpgate.py); here: every one succeeds, each is a valid snapshot of that pod (its
  own digest, restorable), and the pod is never restarted and counts on.
- C14: one snapshot restored twice at once under two names: both run, each its own PID namespace (the
  same process ids inside, no conflict) carrying on from the same token; two restores to the same name
  at once: one runs, the other is refused because the name is taken, and the first is unharmed.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.reference import Reference
from tests.e2e.test_snapshot_flows import COUNTER, _final, _psnap, counter_value, pod, running
from tests.support.agent import _plugin, agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]


def _pid1(cluster: Cluster, ns: str, name: str) -> str:
    """What runs as process 1 of the pod's container (its PID namespace's first process)."""
    out = cluster.kubectl("exec", "-n", ns, name, "-c", "counter", "--", "cat", "/proc/1/cmdline")
    return out.stdout.replace("\0", " ").strip()


def test_five_snapshots_of_one_pod_at_once_are_each_valid_and_the_pod_runs_on(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("busy", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    first = running(cluster, namespace, "busy")
    cluster.wait_for("the counter", lambda: counter_value(cluster, namespace, "busy")[1] >= 5)
    tok, before = counter_value(cluster, namespace, "busy")
    names = [f"at-once-{i}" for i in range(5)]
    repo = f"{cluster.registry}/e2e/at-once"
    cluster.apply([_psnap(namespace, n, "busy", f"{repo}:{n}") for n in names])  # one request, five objects
    finals = {n: _final(cluster, namespace, n, timeout=300) for n in names}
    phases = {n: (f["status"].get("phase"), f["status"].get("message")) for n, f in finals.items()}
    assert all(p == "Succeeded" for p, _ in phases.values()), phases
    refs = {f["status"]["reference"] for f in finals.values()}
    assert len(refs) == 5, refs  # five saves, not one reported five times
    for ref in refs:
        RegistryClient().get_manifest(Reference.parse(ref))  # each digest resolves in the registry
    after = running(cluster, namespace, "busy")
    assert after["metadata"]["uid"] == first["metadata"]["uid"]
    assert [c["restartCount"] for c in after["status"]["containerStatuses"]] == [0]
    tok2, now = counter_value(cluster, namespace, "busy")
    assert tok2 == tok and now > before  # the same process, carrying on
    # the last one is a valid snapshot of the pod: it restores on the other node, from the same memory
    cluster.kubectl("delete", "pod", "busy", "-n", namespace, "--wait=true")
    plugin("restore", names[-1], "-n", namespace, "--name", "busy2", "--node", n2)
    running(cluster, namespace, "busy2")
    assert counter_value(cluster, namespace, "busy2")[0] == tok


def test_one_snapshot_restored_twice_at_once(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("src", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "src")
    cluster.wait_for("the counter", lambda: counter_value(cluster, namespace, "src")[1] >= 5)
    tok, _ = counter_value(cluster, namespace, "src")
    out = plugin("snapshot", "pod/src", "-n", namespace, "--to", f"{cluster.registry}/e2e/twice", "-o", "json")
    snap = json.loads(out.stdout)["metadata"]["name"]

    def restore(name: str, node: str) -> subprocess.CompletedProcess[str]:
        args = ("restore", snap, "-n", namespace, "--name", name, "--node", node, "--timeout", "240s")
        return _plugin(cluster, *args, check=False, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        two = list(pool.map(restore, ["twin-a", "twin-b"], [n2, n2]))
    for r in two:
        assert r.returncode == 0, r.stderr
    for name in ("twin-a", "twin-b"):
        running(cluster, namespace, name)
        assert counter_value(cluster, namespace, name)[0] == tok  # both from the same memory
        # the restored counter is process 1 in each: the same id twice on one node, each in its own PID namespace
        assert "tok=" in _pid1(cluster, namespace, name)
    assert counter_value(cluster, namespace, "src")[0] == tok  # the source runs on, untouched

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        same = list(pool.map(restore, ["twin-c", "twin-c"], [n1, n2]))
    ok = [r for r in same if r.returncode == 0]
    refused = [r for r in same if r.returncode != 0]
    assert len(ok) == 1 and len(refused) == 1, [(r.returncode, r.stderr[-500:]) for r in same]
    assert "already exists" in refused[0].stderr and "hint:" in refused[0].stderr, refused[0].stderr
    running(cluster, namespace, "twin-c")
    assert counter_value(cluster, namespace, "twin-c")[0] == tok  # the one that ran is whole


def test_a_namespace_over_its_backlog_is_refused_at_once_and_another_namespace_is_not(  # type: ignore[no-untyped-def]
    cluster, namespace, agent
):
    """Threat E2 on the real agent: a burst of PodSnapshots from one namespace beyond the node's
    --namespace-backlog (2 here) is refused at once with the reason, never queued; the ones admitted
    succeed, and another namespace's snapshot during the burst is not held back by it."""
    n1 = cluster.nodes[0]
    other = f"{namespace}-b"
    cluster.kubectl("create", "namespace", other)
    try:
        cluster.wait_for(
            f"serviceaccount default in {other}",
            lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", other, check=False).returncode == 0,
            timeout=60,
        )
        for ns in (namespace, other):
            cluster.apply(pod("busy", ns, cluster.busybox_image, {"counter": COUNTER}, node=n1))
            running(cluster, ns, "busy")
        repo = f"{cluster.registry}/e2e/burst"
        names = [f"burst-{i}" for i in range(8)]
        with agent.node_override(n1, namespace_backlog="2", save_concurrency="1"):
            cluster.apply([_psnap(namespace, n, "busy", f"{repo}:{n}") for n in names])  # one request, eight objects
            cluster.apply(_psnap(other, "neighbour", "busy", f"{repo}:neighbour"))
            finals = {n: _final(cluster, namespace, n, timeout=300)["status"] for n in names}
            neighbour = _final(cluster, other, "neighbour", timeout=300)["status"]
        refused = {n: s for n, s in finals.items() if s.get("reason") == "TooManyRequests"}
        done = [n for n, s in finals.items() if s.get("phase") == "Succeeded"]
        assert refused and len(done) >= 2, finals
        assert len(refused) + len(done) == len(names), finals  # nothing failed for another reason
        for s in refused.values():
            assert s.get("phase") == "Failed" and "--namespace-backlog=2" in s.get("message", ""), s
        assert neighbour.get("phase") == "Succeeded", neighbour
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
