"""Final save before termination on the real two-node cluster (issue 13, items 1 and 3).

A protected StatefulSet pod and a protected Deployment pod count in memory on ks-n1, beside an
unprotected Deployment's pod; the policies' interval is 10 minutes, so after the first periodic
save (taken when a pod starts) no other periodic save happens during the test. ``kubectl drain
ks-n1`` evicts them: the protected pods' preStop sleep hooks (added at admission) hold SIGTERM back
while their agent takes a final save with stop, and the replacements on ks-n2 carry on from the
value the counters had just before the drain: only the final save can explain that. The unprotected
pod gets no hook, no annotation and no save.

The drain is limited to this test's pods (``--pod-selector``): the cluster is shared with other
tests, whose pods must not be evicted by this one. ks-n1 is always uncordoned afterwards.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubectl_snapshot.core import finalsave as F
from kubectl_snapshot.core import kubenames as K
from tests.e2e.test_autosave_resume import assert_resumed, live_pod, pod_annotations, pods
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, running
from tests.support.agent import agent
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace"]

GRACE_S = 30
MARK = "e2e-drain"


def policy(ns: str, app: str, kind: str, registry: str) -> dict[str, Any]:
    return {
        "apiVersion": K.API_VERSION,
        "kind": K.POLICY_KIND,
        "metadata": {"name": app, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "workload": {"kind": kind, "name": app},
            "interval": "10m",  # one periodic save at start, then none within the test
            "destination": f"{registry}/e2e/{ns}/{app}",
        },
    }


def workload(kind: str, name: str, ns: str, image: str, node: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 1,
        "selector": {"matchLabels": {"app": name}},
        "template": {
            "metadata": {"labels": {"app": name, MARK: ns}},
            "spec": {
                "containers": [{"name": "counter", "image": image, "command": ["sh", "-c", COUNTER]}],
                "terminationGracePeriodSeconds": GRACE_S,
                # on ks-n1 while it is schedulable; the replacements go to ks-n2 once it is cordoned
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 100,
                                "preference": {
                                    "matchExpressions": [
                                        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                                    ]
                                },
                            }
                        ]
                    }
                },
            },
        },
    }
    if kind == "StatefulSet":
        spec["serviceName"] = name
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": ns}, "spec": spec}


def saves(cluster: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(cluster.get_json(K.PLURAL, "-n", ns, "-l", selector)["items"])


def phase(s: dict[str, Any]) -> str:
    return str((s.get("status") or {}).get("phase") or "")


def diagnose(cluster: Cluster, ns: str) -> str:
    got = [(s["metadata"]["name"], s.get("status")) for s in saves(cluster, ns, K.LABEL_POLICY)]
    pols = [(p["metadata"]["name"], p.get("status")) for p in cluster.get_json(K.POLICY_PLURAL, "-n", ns)["items"]]
    events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
    return f"saves: {json.dumps(got)[:4000]}\npolicies: {json.dumps(pols)[:2000]}\n{events[-4000:]}"


def test_drain_protected_pods_carry_on_from_their_final_save(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    ns = namespace
    n1, n2 = cluster.nodes[:2]
    apps = {"sts": "StatefulSet", "dep": "Deployment"}
    # the agent pushes the policies' saves where the namespace's cluster admin allows (docs/security.md)
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={cluster.registry}/e2e/{ns}")
    for app, kind in apps.items():
        cluster.apply(policy(ns, app, kind, cluster.registry))
    for app, kind in {**apps, "plain": "Deployment"}.items():
        cluster.apply(workload(kind, app, ns, cluster.busybox_image, n1))
    old = {app: live_pod(cluster, ns, app) for app in (*apps, "plain")}
    for app, p in old.items():
        assert p["spec"]["nodeName"] == n1, f"{app} was scheduled to {p['spec']['nodeName']}, not {n1}"

    # admission: the protected pods' containers got the preStop sleep hook, the unprotected one nothing
    for app in apps:
        [c] = old[app]["spec"]["containers"]
        assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": F.hook_sleep_s(GRACE_S)}}, c.get("lifecycle")
    plain = old["plain"]
    assert "lifecycle" not in plain["spec"]["containers"][0] and "runtimeClassName" not in plain["spec"]
    assert not any(k.startswith(K.GROUP) for k in pod_annotations(plain))

    # the first periodic save of each protected pod (due when it starts), then the counters run on
    periodic_upper: dict[str, int] = {}
    for app in apps:
        uid = old[app]["metadata"]["uid"]

        def saved(uid: str = uid) -> bool:
            return any(phase(s) == K.PHASE_SUCCEEDED for s in saves(cluster, ns, f"{K.LABEL_POD_UID}={uid}"))

        try:
            cluster.wait_for(f"the first periodic save of {app}", saved, timeout=180)
        except AssertionError:
            raise AssertionError(diagnose(cluster, ns)) from None
        periodic_upper[app] = counter_value(cluster, ns, old[app]["metadata"]["name"])[1]  # >= the saved value
    for app in apps:
        name = old[app]["metadata"]["name"]
        cluster.wait_for(
            f"{app}'s counter well past its periodic save",
            lambda n=name, a=app: counter_value(cluster, ns, n)[1] > periodic_upper[a] + 25,
        )
    before = {app: counter_value(cluster, ns, old[app]["metadata"]["name"]) for app in apps}

    try:
        drain = cluster.kubectl(
            "drain", n1, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s",
            f"--pod-selector={MARK}={ns}",
            timeout=200,
        )  # fmt: skip
        print(f"$ kubectl drain {n1} ...\n{drain.stdout}{drain.stderr}")

        for app in apps:
            uid = old[app]["metadata"]["uid"]
            finals = saves(cluster, ns, f"{K.LABEL_FINAL_SAVE}=true,{K.LABEL_POD_UID}={uid}")
            assert len(finals) == 1, [s["metadata"]["name"] for s in finals]
            final = finals[0]
            assert final["spec"]["stop"] is True

            new = live_pod(cluster, ns, app, not_uids={uid})
            assert new["spec"]["nodeName"] == n2
            tok, value = before[app]
            assert value > periodic_upper[app] + 25  # what a resume from the periodic save could not reach
            assert_resumed(cluster, ns, new, tok, value)  # same token, counter >= its value before the drain
            final = cluster.get_json(K.PLURAL, final["metadata"]["name"], "-n", ns)
            assert phase(final) == K.PHASE_SUCCEEDED, final.get("status")
            st = final["status"]
            print(
                f"{app}: final save {final['metadata']['name']} ({st.get('sizeHuman')}), timings ms {st.get('timings')}"
            )
            if apps[app] == "Deployment":
                assert final["metadata"]["annotations"][K.ANN_CLAIMED_BY] == new["metadata"]["uid"]
            print(f"{app}: counter {value} before the drain, {counter_value(cluster, ns, new['metadata']['name'])[1]}"
                  f" on {n2} after it; periodic save at <= {periodic_upper[app]}")  # fmt: skip

        events = cluster.get_json("events", "-n", ns, "--field-selector", f"reason={K.EVENT_FINAL_SAVE}")["items"]
        told = {e["involvedObject"]["uid"] for e in events}
        assert {old[a]["metadata"]["uid"] for a in apps} <= told, [e["message"] for e in events]
        assert not cluster.get_json("events", "-n", ns, "--field-selector", f"reason={K.EVENT_FINAL_SAVE_FAILED}")[
            "items"
        ]

        # the unprotected pod: replaced as Kubernetes does it, nothing of the project on it or its successor
        moved = live_pod(cluster, ns, "plain", not_uids={plain["metadata"]["uid"]})
        assert "lifecycle" not in moved["spec"]["containers"][0]
        assert not any(k.startswith(K.GROUP) for k in pod_annotations(moved))
        touched = saves(cluster, ns, f"{K.LABEL_WORKLOAD_NAME}=plain") + saves(
            cluster, ns, f"{K.LABEL_POD}={plain['metadata']['name']}"
        )
        assert not touched, [s["metadata"]["name"] for s in touched]
        assert len(pods(cluster, ns, "sts")) == 1 and len(pods(cluster, ns, "dep")) == 1
    finally:
        cluster.kubectl("uncordon", n1, check=False)
    assert not cluster.get_json("node", n1)["spec"].get("unschedulable")
    print(json.dumps({a: before[a][1] for a in apps}))
