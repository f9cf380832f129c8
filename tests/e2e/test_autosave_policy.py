"""Autosave on the real cluster: a SnapshotPolicy saves a counting pod every 10 s, keeps the last 2,
deletes the others with their registry manifests; the kept save restores and counts on; the
registry's own garbage collection then frees the deleted saves' blobs and the kept one still restores.

The saves go to a private docker-registry (tests/support/registry.py, same binary as the cluster's)
on another loopback port: garbage collection needs the registry stopped (or read-only), which the
shared registry other tests push to cannot be. The agents run in the cluster's network namespace;
a relay (hack/cluster/forward.py, as up.sh does for the shared registry) gives them the same address.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import autosave as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.reference import Reference
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.registry import RegistryServer

__all__ = ["agent", "cluster", "namespace", "plugin"]  # fixtures

pytestmark = pytest.mark.e2e

POLICY = "autosave"


REPO_ROOT = Path(__file__).resolve().parents[2]
NETNS = "/run/netns/ks-net"  # the cluster's network namespace (hack/cluster/lib.sh: KS_NETNS)


@pytest.fixture
def private_registry(tmp_path: Path) -> Iterator[RegistryServer]:
    """A docker-registry of this test alone, reachable at the same 127.0.0.1:PORT from the cluster's
    network namespace (where the agents run) through the cluster's own relay script (as up.sh does)."""
    server = RegistryServer(tmp_path / "registry")
    server.start()
    try:
        with relayed_into_cluster(server.host, tmp_path / "registry.sock"):
            yield server
    finally:
        server.close()


@contextlib.contextmanager
def relayed_into_cluster(host: str, sock: Path) -> Iterator[None]:
    """HOST (127.0.0.1:PORT of an HTTP server on this machine) reachable at the same address from the
    cluster's network namespace, through the cluster's own relay script over the unix socket `sock`."""
    forward = str(REPO_ROOT / "hack" / "cluster" / "forward.py")
    relays = [
        subprocess.Popen([sys.executable, forward, f"unix:{sock}", f"tcp:{host}"]),
        subprocess.Popen(["nsenter", f"--net={NETNS}", sys.executable, forward, f"tcp:{host}", f"unix:{sock}"]),
    ]
    try:
        deadline = time.monotonic() + 20
        probe = ["nsenter", f"--net={NETNS}", "curl", "-fsS", "-o", "/dev/null", f"http://{host}/v2/"]
        while subprocess.run(probe, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "the relay into the cluster's network namespace did not come up"
            time.sleep(0.2)
        yield
    finally:
        for r in relays:
            r.terminate()
            r.wait(timeout=10)


def blob_bytes(storage: Path) -> int:
    blobs = storage / "docker/registry/v2/blobs"
    return sum(f.stat().st_size for f in blobs.rglob("data") if f.is_file())


def diagnose(cluster: Cluster, ns: str) -> str:
    """What the policy, its saves, the Events and the agents say (for a failure message)."""
    out = []
    for args in (
        ("get", K.POLICY_SINGULAR, POLICY, "-n", ns, "-o", "yaml"),
        ("get", "podsnapshots", "-n", ns, "-o", "yaml"),
        ("get", "events", "-n", ns),
        (
            "logs",
            "-n",
            K.AGENT_NAMESPACE,
            "-l",
            "app.kubernetes.io/name=" + K.AGENT_NAME,
            "--tail",
            "60",
            "-c",
            "agent",
        ),
    ):
        r = cluster.kubectl(*args, check=False)
        out.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-4000:]}{r.stderr[-1000:]}")
    return "\n".join(out)


def saves(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("podsnapshots", "-n", ns, "-l", f"{K.LABEL_POLICY}={POLICY}")[
        "items"
    ]
    return sorted(items, key=lambda o: o["metadata"]["creationTimestamp"] + o["metadata"]["name"])


def test_policy_saves_keeps_last_two_and_the_kept_one_restores(cluster, namespace, agent, plugin, private_registry):  # type: ignore[no-untyped-def]
    reg: RegistryServer = private_registry
    ns, (n1, n2) = namespace, cluster.nodes[:2]
    repo = f"{reg.host}/e2e/autosave-{ns}"
    # the agent creates the saves: the namespace must allow the destination (it is no namespace admin)
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={repo}")
    cluster.apply(pod("counter", ns, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, ns, "counter")
    cluster.wait_for("the counter", lambda: counter_value(cluster, ns, "counter")[1] >= 3)
    tok, _ = counter_value(cluster, ns, "counter")

    out = plugin(
        "policy", "create", POLICY, "-n", ns, "--selector", "app=counter", "--interval", "10s",
        "--to", repo, "--keep", "2",
    )  # fmt: skip
    assert f"snapshotpolicy/{POLICY} created" in out.stdout

    # every save seen (retention deletes the old ones), and the counter sampled meanwhile
    seen: dict[str, dict[str, Any]] = {}
    samples: list[tuple[float, int]] = []

    def four_good() -> bool:
        t = time.time()
        # a save freezes the pod: kubectl exec waits or fails meanwhile
        with contextlib.suppress(AssertionError, ValueError, subprocess.TimeoutExpired):
            samples.append((t, counter_value(cluster, ns, "counter")[1]))
        for o in saves(cluster, ns):
            seen[o["metadata"]["name"]] = o
        return sum(1 for o in seen.values() if (o.get("status") or {}).get("phase") == K.PHASE_SUCCEEDED) >= 4

    try:
        cluster.wait_for("4 good saves of the policy", four_good, timeout=150)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnose(cluster, ns)}") from None
    cluster.kubectl("patch", K.POLICY_SINGULAR, POLICY, "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')

    def phase(o: dict[str, Any]) -> str:
        return str((o.get("status") or {}).get("phase") or "")

    def settled() -> bool:
        now = saves(cluster, ns)
        for o in now:
            seen[o["metadata"]["name"]] = o
        if not all(phase(o) in K.TERMINAL_PHASES for o in now):
            return False
        # a save may fail on a loaded machine (the policy retries it); retention keeps a few of those
        failed = [o for o in now if phase(o) != K.PHASE_SUCCEEDED]
        return len(now) - len(failed) == 2 and len(failed) <= A.KEEP_FAILED

    try:
        cluster.wait_for("retention to leave exactly 2 good saves", settled, timeout=120)
    except AssertionError as e:
        states = [(o["metadata"]["name"], o.get("status") or {}) for o in saves(cluster, ns)]
        listed = "\n".join(f"{name}: {st.get('phase')} {st.get('message', '')}" for name, st in states)
        raise AssertionError(f"{e}\n{listed}\n{diagnose(cluster, ns)}") from None
    remaining = saves(cluster, ns)
    for o in remaining:
        if phase(o) != K.PHASE_SUCCEEDED:
            print(f"a failed save kept by retention: {o['metadata']['name']}: {o['status'].get('message')}")
    kept = [o for o in remaining if phase(o) == K.PHASE_SUCCEEDED]
    kept_names = {o["metadata"]["name"] for o in kept}
    good = [o for o in seen.values() if o["status"].get("phase") == K.PHASE_SUCCEEDED]
    assert len(good) >= 4
    # the saves carry the policy's labels and never overlapped
    for o in good:
        labels = o["metadata"]["labels"]
        assert labels[K.LABEL_POD] == "counter" and labels[K.LABEL_WORKLOAD_KIND] == "Pod", labels
        assert o["spec"]["destination"].startswith(repo + ":counter-")
    ordered = sorted(good, key=lambda o: o["status"]["startTime"])
    for a, b in itertools.pairwise(ordered):
        assert b["status"]["startTime"] >= a["status"]["completionTime"], (a["status"], b["status"])
    # the deleted saves' manifests are gone from the registry; the kept ones are there
    client = RegistryClient(plain_http=True)
    for o in good:
        ref = Reference.parse(o["status"]["reference"])
        if o["metadata"]["name"] in kept_names:
            client.get_manifest(ref)
        else:
            with pytest.raises(NotFound):
                client.get_manifest(ref)
    newest = max(kept, key=lambda o: o["metadata"]["creationTimestamp"] + o["metadata"]["name"])

    # the pod says when its last good save was; the policy's status has its entry
    live = cluster.get_json("pod", "counter", "-n", ns)
    stamp = T.seconds(live["metadata"]["annotations"][K.ANN_LAST_SAVE])
    assert stamp is not None and time.time() - stamp < 120
    entry = next(p for p in cluster.get_json(K.POLICY_SINGULAR, POLICY, "-n", ns)["status"]["pods"])
    last = max(remaining, key=lambda o: o["metadata"]["creationTimestamp"] + o["metadata"]["name"])
    assert entry["name"] == "counter" and entry["node"] == n1 and entry["lastResult"] == phase(last)
    assert entry["lastSnapshot"] == newest["metadata"]["name"] and entry["lastSize"] > 0
    listed = plugin("policy", "list", "-n", ns).stdout
    assert POLICY in listed and "app=counter" in listed
    described = plugin("policy", "describe", POLICY, "-n", ns).stdout
    print(f"$ kubectl snapshot policy list\n{listed}\n$ kubectl snapshot policy describe {POLICY}\n{described}")
    assert f"counter on {n1}: last save" in described and "Suspend:         true" in described

    # the registry's own garbage collection (stopped: nothing may push meanwhile) frees the deleted saves' blobs
    before = blob_bytes(reg.storage)
    reg.stop()
    gc = subprocess.run(
        [reg.binary, "garbage-collect", "--delete-untagged", str(reg.config_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reg.start()
    assert gc.returncode == 0, gc.stderr[-2000:]
    after = blob_bytes(reg.storage)
    assert after < before, (before, after)
    print(f"blob storage before/after garbage-collect: {before}/{after} bytes ({after / before:.2f})")

    # the kept newest save restores on the other node and counts on from at least what it saved
    lower = max((v for t, v in samples if t < T.seconds(newest["status"]["startTime"])), default=0)  # type: ignore[operator]
    cluster.kubectl("delete", "pod", "counter", "-n", ns, "--wait=true")
    plugin("restore", newest["metadata"]["name"], "-n", ns, "--name", "counter-restored", "--node", n2)
    restored = running(cluster, ns, "counter-restored")

    def entry_gone() -> bool:  # n1's agent removes the entry of the pod that left its node
        pods = (cluster.get_json(K.POLICY_SINGULAR, POLICY, "-n", ns).get("status") or {}).get("pods") or []
        return "counter" not in [p["name"] for p in pods]

    cluster.wait_for("the deleted pod's status entry to go", entry_gone, timeout=30)
    assert restored["spec"]["nodeName"] == n2
    tok2, value = counter_value(cluster, ns, "counter-restored")
    assert tok2 == tok and value >= lower, (tok, tok2, lower, value)
    cluster.wait_for("the restored counter to go on", lambda: counter_value(cluster, ns, "counter-restored")[1] > value)

    # delete --prune: the saves and their manifests go with the policy
    pruned = plugin("policy", "delete", POLICY, "-n", ns, "--prune").stdout
    assert f"snapshotpolicy/{POLICY} deleted" in pruned
    assert saves(cluster, ns) == []
    with pytest.raises(NotFound):
        client.get_manifest(Reference.parse(newest["status"]["reference"]))


def test_a_policy_needs_the_restore_verb_too(cluster: Cluster, namespace: str, agent: Any) -> None:
    """A policy saves and restores in its creator's name: create podsnapshots alone is not enough."""
    ns = namespace
    repo = f"{cluster.registry}/tenant-ok"
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={repo}")
    rules = [
        {"apiGroups": [K.GROUP], "resources": [K.PLURAL], "verbs": ["create", "get", "list"]},
        {"apiGroups": [K.GROUP], "resources": [K.POLICY_PLURAL], "verbs": ["create", "get", "list"]},
    ]
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "tenant", "namespace": ns}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "tenant", "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
             "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]},
        ]
    )  # fmt: skip
    user = f"system:serviceaccount:{ns}:tenant"
    body: dict[str, Any] = {
        "apiVersion": K.API_VERSION,
        "kind": K.POLICY_KIND,
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "interval": "1m", "destination": f"{repo}/x"},
    }

    def create(obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(
            "--as", user, "create", "--dry-run=server", "-f", "-", "-o", "name", input=json.dumps(obj), check=False
        )

    refused = create(body)
    assert refused.returncode != 0
    assert "ValidatingAdmissionPolicy 'kubectl-snapshot-snapshotpolicies'" in refused.stderr, refused.stderr
    assert "it needs both create and the restore verb" in refused.stderr, refused.stderr
    # the same user with the restore verb passes; a destination off the namespace's list still does not
    cluster.apply(
        [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "tenant-restore", "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "kubectl-snapshot-restore"},
             "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]},
        ]
    )  # fmt: skip
    admitted = create(body)
    assert admitted.returncode == 0, admitted.stderr
    elsewhere = create({**body, "spec": {**body["spec"], "destination": f"{cluster.registry}/other/x"}})
    assert elsewhere.returncode != 0 and "is not allowed in namespace" in elsewhere.stderr, elsewhere.stderr


def test_the_last_pods_status_entry_goes_with_the_pod(cluster: Cluster, namespace: str, agent: Any, plugin) -> None:  # type: ignore[no-untyped-def]
    """The policy's status.pods is written by server-side apply, one field manager per node: when the
    last entry goes the status has no field left, which the API server refused ("status: Invalid value:
    null") until the CRD let the status be null, so the entry of a deleted pod stayed forever and the
    agent logged the refusal every second. A second pod's entry shows a removal that never was the
    last one still works."""
    ns, n1 = namespace, cluster.nodes[0]
    repo = f"{cluster.registry}/e2e/entries-{ns}"
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={repo}")
    for name in ("one", "two"):
        body = pod(name, ns, cluster.busybox_image, {"counter": COUNTER}, node=n1)
        body["metadata"]["labels"]["tier"] = "entries"
        cluster.apply(body)
    for name in ("one", "two"):
        running(cluster, ns, name)
    # suspended: the entries are written, no save is made (nothing here depends on the registry)
    plugin(
        "policy", "create", POLICY, "-n", ns, "--selector", "tier=entries", "--interval", "10m", "--to", repo,
        "--suspend",
    )  # fmt: skip

    def entries() -> list[str]:
        status = cluster.get_json(K.POLICY_SINGULAR, POLICY, "-n", ns).get("status") or {}
        return sorted(p["name"] for p in status.get("pods") or [])

    cluster.wait_for("both pods' status entries", lambda: entries() == ["one", "two"], timeout=60)
    cluster.kubectl("delete", "pod", "one", "-n", ns, "--wait=true")
    cluster.wait_for("the first deleted pod's entry to go", lambda: entries() == ["two"], timeout=30)
    cluster.kubectl("delete", "pod", "two", "-n", ns, "--wait=true")
    cluster.wait_for("the last deleted pod's entry to go", lambda: entries() == [], timeout=30)
