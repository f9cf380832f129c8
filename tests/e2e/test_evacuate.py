"""Evacuating a node within its notice on the real two-node cluster (issue 43).

A StatefulSet of PODS protected pods counts in memory on ks-n1 (one SnapshotPolicy, interval 10
minutes: one periodic save per pod when it starts, none during the test). ``kubectl drain ks-n1
--grace-period=GRACE_S`` evicts them all at once, the way a node's preemption notice does: the agent
of ks-n1 saves them in parallel (its save queue's workers, final saves first, earliest deadline
first, one freeze at a time; shim/controller/workqueue.py, kubectl_snapshot/core/saveorder.py), and
every replacement on ks-n2 carries on from the value its counter had just before the drain, which
only its final save explains. No pod may lose work: no final save failed, none was thawed at its
``thaw_by`` deadline.

The drain is limited to this test's pods (``--pod-selector``); ks-n1 is always uncordoned afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from tests.e2e.test_autosave_resume import assert_resumed
from tests.e2e.test_final_save import diagnose, phase, policy, saves, workload
from tests.e2e.test_snapshot_flows import counter_value, running
from tests.support.agent import agent
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace"]

PODS = 6
GRACE_S = 20  # the drain's grace period, shorter than the pods' 30 s: the hooks are cut short
APP = "evac"
MARK = "e2e-drain"


def replacement(cluster: Cluster, ns: str, name: str, old_uid: str) -> dict[str, Any]:
    def new() -> bool:
        got = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
        return got.returncode == 0 and json.loads(got.stdout)["metadata"]["uid"] != old_uid

    cluster.wait_for(f"the replacement of {name}", new, timeout=180)
    return running(cluster, ns, name)


def test_drain_of_many_protected_pods_resumes_every_one_whole(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    ns = namespace
    n1, n2 = cluster.nodes[:2]
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={cluster.registry}/e2e/{ns}")
    cluster.apply(policy(ns, APP, "StatefulSet", cluster.registry))
    sts = workload("StatefulSet", APP, ns, cluster.busybox_image, n1)
    sts["spec"]["replicas"] = PODS
    sts["spec"]["podManagementPolicy"] = "Parallel"  # all at once, and their replacements too
    sts["spec"]["template"]["metadata"]["labels"][MARK] = ns
    cluster.apply(sts)
    names = [f"{APP}-{i}" for i in range(PODS)]
    old = {n: running(cluster, ns, n, timeout=300) for n in names}
    for n, p in old.items():
        assert p["spec"]["nodeName"] == n1, f"{n} was scheduled to {p['spec']['nodeName']}, not {n1}"

    # each pod's first periodic save (due when it starts), then the counters run on well past it
    def all_saved() -> bool:
        good = {
            (s["metadata"].get("labels") or {}).get(K.LABEL_POD_UID)
            for s in saves(cluster, ns, K.LABEL_POLICY)
            if phase(s) == K.PHASE_SUCCEEDED
        }
        return all(p["metadata"]["uid"] in good for p in old.values())

    try:
        cluster.wait_for(f"the first periodic save of all {PODS} pods", all_saved, timeout=300)
    except AssertionError:
        raise AssertionError(diagnose(cluster, ns)) from None
    periodic_upper = {n: counter_value(cluster, ns, n)[1] for n in names}  # >= each saved value
    for n in names:
        cluster.wait_for(
            f"{n}'s counter past its periodic save",
            lambda n=n: counter_value(cluster, ns, n)[1] > periodic_upper[n] + 25,
        )
    before = {n: counter_value(cluster, ns, n) for n in names}

    try:
        drain = cluster.kubectl(
            "drain", n1, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s",
            f"--grace-period={GRACE_S}", f"--pod-selector={MARK}={ns}",
            timeout=200,
        )  # fmt: skip
        print(f"$ kubectl drain {n1} --grace-period={GRACE_S} ...\n{drain.stdout}{drain.stderr}")
        finals = []
        for n in names:
            uid = old[n]["metadata"]["uid"]
            found = saves(cluster, ns, f"{K.LABEL_FINAL_SAVE}=true,{K.LABEL_POD_UID}={uid}")
            assert len(found) == 1, (n, [s["metadata"]["name"] for s in found], diagnose(cluster, ns))
            new = replacement(cluster, ns, n, uid)
            assert new["spec"]["nodeName"] == n2, (n, new["spec"]["nodeName"])
            tok, value = before[n]
            assert value > periodic_upper[n] + 25  # what a resume from the periodic save could not reach
            assert_resumed(cluster, ns, new, tok, value)  # same token, counter >= its value before the drain
            final = cluster.get_json(K.PLURAL, found[0]["metadata"]["name"], "-n", ns)
            assert phase(final) == K.PHASE_SUCCEEDED, (n, final.get("status"))
            finals.append(final)
        failed = cluster.get_json("events", "-n", ns, "--field-selector", f"reason={K.EVENT_FINAL_SAVE_FAILED}")
        assert not failed["items"], [e["message"] for e in failed["items"]]
        starts = [T.seconds(f["status"].get("startTime")) or 0.0 for f in finals]
        ends = [T.seconds(f["status"].get("completionTime")) or 0.0 for f in finals]
        print(
            f"{PODS} final saves: first start to last completion {max(ends) - min(starts):.1f}s"
            f" (grace period {GRACE_S}s)"
        )
    finally:
        cluster.kubectl("uncordon", n1, check=False)
    assert not cluster.get_json("node", n1)["spec"].get("unschedulable")
