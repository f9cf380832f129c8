"""Provenance on the real cluster: a snapshot is signed by the agent that took it, restored into
another namespace only once a SnapshotGrant in its own namespace allows it, and `inspect` shows
who signed it and where it came from."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.signatures import sign_snapshot, verify_snapshot
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.provenance import TrustPolicy
from kubectl_snapshot.core.reference import Reference
from shim.controller.signing import RETIREMENT_CHECK_S
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.tamper import agent_signing_key

pytestmark = pytest.mark.e2e


def grant(cluster: Cluster, source: str, target: str) -> None:
    """A SnapshotGrant `to-other` in `source`: its snapshots may be restored into `target`."""
    cluster.apply(
        {
            "apiVersion": K.API_VERSION,
            "kind": K.GRANT_KIND,
            "metadata": {"name": "to-other", "namespace": source},
            "spec": {"targetNamespaces": [target]},
        }
    )


def test_cross_namespace_restore_is_refused_until_granted(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    other = f"e2e-other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", other)
    cluster.wait_for(
        f"serviceaccount default in {other}",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", other, check=False).returncode == 0,
        timeout=60,
    )
    try:
        cluster.apply(pod("secretive", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
        running(cluster, namespace, "secretive")
        tok, _ = counter_value(cluster, namespace, "secretive")
        out = plugin("snapshot", "pod/secretive", "-n", namespace, "--to", f"{cluster.registry}/e2e/prov", "-o", "json")
        ref = json.loads(out.stdout)["status"]["reference"]

        # signed by the cluster's key, with its origin
        info = json.loads(plugin("inspect", ref, "-o", "json").stdout)["provenance"]
        assert info["verified"], info
        assert info["origin"]["namespace"] == namespace and info["origin"]["pod"] == "secretive"
        assert info["origin"]["node"] == n1 and info["origin"]["cluster"]

        # another namespace with only read access to the repository: refused by the agent, nothing runs
        proc = plugin("restore", ref, "-n", other, "--name", "thief", "--node", n2, "--timeout", "120s", check=False)
        assert proc.returncode == 1
        assert f"no SnapshotGrant in '{namespace}' grants '{other}'" in proc.stderr, proc.stderr
        thief = cluster.get_json("pod", "thief", "-n", other)
        assert thief["metadata"]["annotations"][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)

        # the source namespace grants it: the same restore works, with the same process memory
        grant(cluster, namespace, other)
        plugin("restore", ref, "-n", other, "--name", "granted", "--node", n2)
        running(cluster, other, "granted")
        assert counter_value(cluster, other, "granted")[0] == tok
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_a_nodes_stolen_key_cannot_vouch_for_a_save_of_another_node(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    """Threat D14: root on n1 reads n1's own signing key (it never leaves the node, but root there has it)
    and signs a snapshot as taken on n2. Restores check a node's key against the node its signed origin
    names, so the forgery is refused before any byte is staged; the same snapshot with the signature n1's
    agent made (its origin n1) restores on n2, where the legitimate migration goes."""
    ns, (n1, n2) = namespace, cluster.nodes[:2]
    cluster.apply(pod("origin", ns, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, ns, "origin")
    tok, _ = counter_value(cluster, ns, "origin")
    out = plugin("snapshot", "pod/origin", "-n", ns, "--to", f"{cluster.registry}/e2e/d14-{ns}", "-o", "json")
    ref = Reference.parse(json.loads(out.stdout)["status"]["reference"])

    # the legitimate case: n1's save, signed by n1's key naming n1, restores on n2
    plugin("restore", str(ref), "-n", ns, "--name", "moved", "--node", n2)
    running(cluster, ns, "moved")
    assert counter_value(cluster, ns, "moved")[0] == tok

    # the forgery: the same snapshot, its signature replaced by one of n1's key claiming node n2
    stolen = agent_signing_key(n1)
    reg = RegistryClient()
    verdict = verify_snapshot(reg, ref, TrustPolicy((stolen.public,)))
    assert verdict.verified and verdict.claim is not None and verdict.claim.origin.node == n1, verdict.reason
    sign_snapshot(reg, ref, dataclasses.replace(verdict.claim.origin, node=n2), stolen)
    proc = plugin("restore", str(ref), "-n", ns, "--name", "forged", "--node", n2, "--timeout", "120s", check=False)
    assert proc.returncode == 1, proc.stdout
    assert f"signed by the key of node {n1}" in proc.stderr and f"origin names node {n2}" in proc.stderr, proc.stderr
    forged = cluster.get_json("pod", "forged", "-n", ns)
    assert forged["metadata"]["annotations"][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)


def test_retiring_a_nodes_key_rotates_it_and_every_save_still_restores(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    """Threat C10's legitimate case on the real cluster: an administrator retires n1's key (its `not-after`
    a minute away). n1's agent makes, registers and signs with a new key before it saves again, so the
    save after the retirement restores, and so does the one before it (signed while the key served)."""
    ns, (n1, n2) = namespace, cluster.nodes[:2]
    cluster.apply(pod("rotor", ns, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, ns, "rotor")
    repo = f"{cluster.registry}/e2e/rotate-{ns}"

    def save() -> Reference:
        out = plugin("snapshot", "pod/rotor", "-n", ns, "--to", repo, "-o", "json")
        return Reference.parse(json.loads(out.stdout)["status"]["reference"])

    def signer(ref: Reference) -> str:
        info = json.loads(plugin("inspect", str(ref), "-o", "json").stdout)["provenance"]
        assert info["verified"], info
        return str(info["keyId"])

    before = save()
    old = agent_signing_key(n1).public.id
    assert signer(before) == old
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))
    patch = json.dumps({"data": {f"{old}.not-after": when}})
    # the old key's retirement stays (an administrator's entry): later tests' saves use n1's new key
    cluster.kubectl("patch", "configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE, "--type", "merge", "-p", patch)
    # the agent reads the ConfigMap for its key's retirement at most every RETIREMENT_CHECK_S: a save sooner
    # than that after the patch may still be signed by the old key, which vouches for it (not-after is ahead)
    time.sleep(RETIREMENT_CHECK_S + 1)
    after = save()
    new = agent_signing_key(n1).public.id
    assert new != old and signer(after) == new
    trust = cluster.get_json("configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE)["data"]
    assert trust[f"{new}.node"] == n1 and trust[f"{old}.not-after"] == when
    for name, ref in (("from-before", before), ("from-after", after)):
        plugin("restore", str(ref), "-n", ns, "--name", name, "--node", n2)
        running(cluster, ns, name)
