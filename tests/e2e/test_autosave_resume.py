"""Workload-aware resume on the real two-node cluster (issue 12, items 3-5).

Protected workloads (a SnapshotPolicy selecting their pods, ``suspend: true`` so that no schedule
runs: the saves are made by hand with the plugin) count in memory; their pods are deleted, and the
controllers' replacements must carry on from the save: the in-memory token is the old one (a fresh
start draws a new one) and the counter never goes back. A Deployment's two replacements resume two
distinct saves; an unprotected Deployment's pods are not touched; migrate of a StatefulSet pod makes
no duplicate.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy import resume_admission
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, running
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]


def policy(ns: str, name: str, app: str, registry: str, workload: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app": app}},
        "interval": "1m",
        "destination": f"{registry}/e2e/{ns}/{name}",
        "suspend": True,  # no schedule: this test makes its saves by hand
    }
    if workload:
        spec["workload"] = workload
    return {
        "apiVersion": K.API_VERSION,
        "kind": K.POLICY_KIND,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def template(app: str, image: str, restart: str = "Always") -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app": app}},
        "spec": {
            "containers": [{"name": "counter", "image": image, "command": ["sh", "-c", COUNTER]}],
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": restart,
        },
    }


def workload(kind: str, name: str, ns: str, image: str, **spec: Any) -> dict[str, Any]:
    api = "batch/v1" if kind == "Job" else "apps/v1"
    body: dict[str, Any] = {"template": template(name, image, "Never" if kind == "Job" else "Always"), **spec}
    if kind != "Job":
        body["selector"] = {"matchLabels": {"app": name}}
    return {"apiVersion": api, "kind": kind, "metadata": {"name": name, "namespace": ns}, "spec": body}


def pods(cluster: Cluster, ns: str, app: str) -> list[dict[str, Any]]:
    items = cluster.get_json("pods", "-n", ns, "-l", f"app={app}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def live_pod(cluster: Cluster, ns: str, app: str, *, not_uids: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    found: list[dict[str, Any]] = []

    def one() -> bool:
        found[:] = [p for p in pods(cluster, ns, app) if p["metadata"]["uid"] not in not_uids]
        return len(found) == 1

    cluster.wait_for(f"one new pod of {app}", one, timeout=120)
    return running(cluster, ns, found[0]["metadata"]["name"])


def save(plugin: Callable[..., Any], cluster: Cluster, ns: str, pod: str, app: str) -> dict[str, Any]:
    out = plugin("snapshot", f"pod/{pod}", "-n", ns, "--to", f"{cluster.registry}/e2e/{ns}/{app}", "-o", "json")
    return dict(json.loads(out.stdout))


def pod_annotations(p: dict[str, Any]) -> dict[str, str]:
    return dict(p["metadata"].get("annotations") or {})


def assert_resumed(cluster: Cluster, ns: str, p: dict[str, Any], tok: str, value: int) -> None:
    name = p["metadata"]["name"]

    def staged() -> bool:
        pod = cluster.get_json("pod", name, "-n", ns)
        return pod_annotations(pod).get(K.ANN_RESTORE_STATUS) == K.RESTORE_STAGED

    cluster.wait_for(f"{name} staged from the save (not started fresh)", staged, timeout=30)
    tok2, after = counter_value(cluster, ns, name)
    assert tok2 == tok, "the replacement started fresh instead of resuming"
    assert after >= value, (after, value)
    cluster.wait_for("the resumed counter to go on", lambda: counter_value(cluster, ns, name)[1] > after)


def test_statefulset_pod_resumes_by_name_and_migrates_without_a_duplicate(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns = namespace
    cluster.apply(policy(ns, "sts", "sts", cluster.registry, {"kind": "StatefulSet", "name": "sts"}))
    cluster.apply(workload("StatefulSet", "sts", ns, cluster.busybox_image, replicas=1, serviceName="sts"))
    first = running(cluster, ns, "sts-0")
    # admission gave it what a resume needs (nobody edited the StatefulSet)
    assert first["spec"]["runtimeClassName"] == K.RUNTIME_CLASS
    # and no gate init container: the runtime wrapper held its container until the agent said "fresh"
    assert not first["spec"].get("initContainers") and not any(
        v["name"] == K.GATE_VOLUME for v in first["spec"].get("volumes") or []
    )
    assert pod_annotations(first)[K.ANN_RESUME_POLICY] == "sts"
    assert pod_annotations(first)[K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX)  # nothing saved yet
    cluster.wait_for("the counter", lambda: counter_value(cluster, ns, "sts-0")[1] >= 5)
    tok, before = counter_value(cluster, ns, "sts-0")
    psnap = save(plugin, cluster, ns, "sts-0", "sts")
    labels = psnap["metadata"]["labels"]
    assert labels[K.LABEL_WORKLOAD_KIND] == "StatefulSet" and labels[K.LABEL_WORKLOAD_NAME] == "sts"
    assert labels[K.LABEL_POD] == "sts-0" and labels[K.LABEL_POD_UID] == first["metadata"]["uid"]
    assert json.loads(psnap["metadata"]["annotations"][K.ANN_POD_IMAGES])[0]["imageID"].startswith("sha256:")

    cluster.kubectl("delete", "pod", "sts-0", "-n", ns, "--wait=true")
    second = live_pod(cluster, ns, "sts", not_uids={first["metadata"]["uid"]})
    assert_resumed(cluster, ns, second, tok, before)

    # migrate: a save with stop, the StatefulSet's replacement resumes from it; never two pods at once
    _, before = counter_value(cluster, ns, "sts-0")
    out = plugin("migrate", "pod/sts-0", "-n", ns, "--to", f"{cluster.registry}/e2e/{ns}/sts", "-o", "json")
    moved = json.loads(out.stdout)
    assert moved["snapshot"]["spec"]["stop"] is True
    third = live_pod(cluster, ns, "sts", not_uids={second["metadata"]["uid"]})
    assert len(pods(cluster, ns, "sts")) == 1
    assert_resumed(cluster, ns, third, tok, before)

    # uninstall refuses while a pod runs under the runtime class (containerd stops it through the hook)
    out = plugin("uninstall", check=False)
    assert out.returncode != 0 and f"{ns}/sts-0" in out.stderr and "--force" in out.stderr, out.stderr
    assert cluster.kubectl("get", "runtimeclass", K.RUNTIME_CLASS, check=False).returncode == 0  # nothing removed
    cluster.kubectl("delete", "pod", "sts-0", "-n", ns, "--wait=true", timeout=120)  # still stopped through the hook


def test_indexed_job_pod_resumes_by_completion_index(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns = namespace
    cluster.apply(policy(ns, "job", "job", cluster.registry))
    cluster.apply(
        workload(
            "Job",
            "job",
            ns,
            cluster.busybox_image,
            completions=1,
            parallelism=1,
            completionMode="Indexed",
            backoffLimit=6,
        )
    )
    first = live_pod(cluster, ns, "job")
    name = first["metadata"]["name"]
    # restartPolicy Never: a create the wrapper held past the kubelet's timeout would fail the pod for
    # good, so this pod waits for the agent in the gate init container instead (deploy/resume.py)
    assert [c["name"] for c in first["spec"]["initContainers"]] == [K.GATE_CONTAINER]
    assert first["spec"]["runtimeClassName"] == K.RUNTIME_CLASS
    assert pod_annotations(first)[K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX)  # nothing saved yet
    cluster.wait_for("the counter", lambda: counter_value(cluster, ns, name)[1] >= 5)
    tok, before = counter_value(cluster, ns, name)
    psnap = save(plugin, cluster, ns, name, "job")
    assert psnap["metadata"]["labels"][K.LABEL_COMPLETION_INDEX] == "0"
    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=true")
    second = live_pod(cluster, ns, "job", not_uids={first["metadata"]["uid"]})
    assert [c["name"] for c in second["spec"]["initContainers"]] == [K.GATE_CONTAINER]
    assert_resumed(cluster, ns, second, tok, before)
    assert second["status"]["phase"] == "Running" and not second["status"]["containerStatuses"][0]["restartCount"]


def test_deployment_replacements_resume_distinct_saves(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns = namespace
    cluster.apply(policy(ns, "dep", "dep", cluster.registry, {"kind": "Deployment", "name": "dep"}))
    cluster.apply(workload("Deployment", "dep", ns, cluster.busybox_image, replicas=2))
    cluster.wait_for("two pods", lambda: len(pods(cluster, ns, "dep")) == 2)
    old = {p["metadata"]["name"]: running(cluster, ns, p["metadata"]["name"]) for p in pods(cluster, ns, "dep")}
    toks, saves = {}, []
    for name in old:
        cluster.wait_for("the counter", lambda n=name: counter_value(cluster, ns, n)[1] >= 5)
        toks[counter_value(cluster, ns, name)[0]] = counter_value(cluster, ns, name)[1]
        saves.append(save(plugin, cluster, ns, name, "dep")["metadata"]["name"])
    cluster.kubectl("delete", "pod", *old, "-n", ns, "--wait=false")
    old_uids = {p["metadata"]["uid"] for p in old.values()}

    def two_new() -> bool:
        return len([p for p in pods(cluster, ns, "dep") if p["metadata"]["uid"] not in old_uids]) == 2

    cluster.wait_for("two replacements", two_new, timeout=120)
    new = [running(cluster, ns, p["metadata"]["name"]) for p in pods(cluster, ns, "dep")]
    resumed = {}
    for p in new:
        tok, value = counter_value(cluster, ns, p["metadata"]["name"])
        assert tok in toks and value >= toks[tok], "a replacement started fresh"
        assert_resumed(cluster, ns, p, tok, toks[tok])
        resumed[tok] = p["metadata"]["uid"]
    assert set(resumed) == set(toks)  # each replacement carries on one predecessor: distinct saves
    claims = {cluster.get_json(K.PLURAL, s, "-n", ns)["metadata"]["annotations"][K.ANN_CLAIMED_BY] for s in saves}
    assert claims == set(resumed.values())


def test_unprotected_deployment_is_not_mutated_and_migrate_refuses_it(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns = namespace
    cluster.apply(policy(ns, "other", "other", cluster.registry))  # a policy that selects something else
    cluster.apply(workload("Deployment", "plain", ns, cluster.busybox_image, replicas=1))
    p = live_pod(cluster, ns, "plain")
    assert "runtimeClassName" not in p["spec"] and not p["spec"].get("initContainers")
    assert not any(k.startswith(K.GROUP) for k in pod_annotations(p))
    r = plugin("migrate", f"pod/{p['metadata']['name']}", "-n", ns, "--to", f"{cluster.registry}/e2e/x", check=False)
    assert r.returncode != 0 and "duplicate" in r.stderr and "SnapshotPolicy" in r.stderr, r.stderr
    assert len(pods(cluster, ns, "plain")) == 1


def test_the_agent_may_patch_only_provenance_of_a_podsnapshot(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    """The agent's `podsnapshots patch` (labels at claim, the resume claim) is narrowed by admission:
    as the agent's ServiceAccount, a provenance label passes (server-side dry run), a spec change or
    another label is refused."""
    ns = namespace
    body = {
        "apiVersion": K.API_VERSION,
        "kind": K.KIND,
        "metadata": {"name": "s", "namespace": ns},
        "spec": {"podName": "nobody", "podNamespace": ns, "destination": f"{cluster.registry}/e2e/x:t"},
    }
    cluster.apply(body)
    as_agent = ("--as", K.AGENT_USER, "--dry-run=server", "--type", "merge")

    def patch(p: dict[str, Any]) -> Any:
        return cluster.kubectl("patch", K.PLURAL, "s", "-n", ns, *as_agent, "-p", json.dumps(p), check=False)

    ok = patch({"metadata": {"labels": {K.LABEL_WORKLOAD_KIND: "StatefulSet"}, "annotations": {K.ANN_CLAIMED_BY: "u"}}})
    assert ok.returncode == 0, ok.stderr
    assert patch({"spec": {"stop": True}}).returncode != 0  # (the CRD's own rule refuses it first: immutable)
    for bad in ({"metadata": {"labels": {"team": "x"}}}, {"metadata": {"annotations": {"other": "x"}}}):
        r = patch(bad)
        assert r.returncode != 0 and "the provenance labels" in r.stderr, (bad, r.stderr)


def test_a_resume_annotation_forged_in_a_template_is_refused_at_admission(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    """Issue 42, item 3. Whoever may create Deployments could write the resume annotation (naming a
    policy of the namespace) and the runtime class into a template: the pods come from a kube-system
    controller, which the resume-pods policy lets through, so they got final saves into that policy's
    repository with its Secret. Now the policy the annotation names must select the pod. The pair: the
    Deployment the policy selects is annotated by the mutation and admitted; the forged template's
    pods are refused with the reason, and so is the same pod written by hand (server-side dry runs)."""
    ns = namespace
    cluster.apply(policy(ns, "web", "web", cluster.registry))  # selects app=web, any workload

    cluster.apply(workload("Deployment", "web", ns, cluster.busybox_image, replicas=1))
    legit = live_pod(cluster, ns, "web")
    assert pod_annotations(legit)[K.ANN_RESUME_POLICY] == "web" and legit["spec"]["runtimeClassName"] == K.RUNTIME_CLASS
    assert pod_annotations(legit)[K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX)  # nothing saved yet

    forged = workload("Deployment", "evil", ns, cluster.busybox_image, replicas=1)
    forged["spec"]["template"]["metadata"]["annotations"] = {K.ANN_RESUME_POLICY: "web"}
    forged["spec"]["template"]["spec"]["runtimeClassName"] = K.RUNTIME_CLASS
    cluster.apply(forged)
    refusals: list[str] = []

    def refused() -> bool:
        for rs in cluster.get_json("replicasets", "-n", ns, "-l", "app=evil")["items"]:
            conditions = (rs.get("status") or {}).get("conditions") or []
            refusals[:] = [c.get("message") or "" for c in conditions if c.get("type") == "ReplicaFailure"]
        return bool(refusals)

    cluster.wait_for("the forged template's ReplicaSet to be refused its pod", refused, timeout=60)
    assert "SnapshotPolicy web does not select this pod" in refusals[0], refusals
    assert pods(cluster, ns, "evil") == []  # no pod of it ever existed: nothing for the agent to save or resume

    def by_hand(labels: dict[str, str]) -> Any:
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "by-hand",
                "namespace": ns,
                "labels": labels,
                "annotations": {K.ANN_RESUME_POLICY: "web"},
            },
            "spec": {
                "runtimeClassName": K.RUNTIME_CLASS,
                "containers": [{"name": "c", "image": cluster.busybox_image, "command": ["sleep", "1"]}],
            },
        }
        return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)

    # the admin holds the restore verb, so only the new policy can refuse these
    ok = by_hand({"app": "web"})
    assert ok.returncode == 0, ok.stderr
    no = by_hand({"app": "evil"})
    assert no.returncode != 0 and "SnapshotPolicy web does not select this pod" in no.stderr, no.stderr


def test_a_replicaset_with_a_forged_deployment_owner_is_refused(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    """Threat D15: the agent takes a Deployment's saves for the pods of the ReplicaSets that Deployment
    owns; a ReplicaSet made by hand with a controller reference to it (its uid is readable) would have
    its pods final-saved and resumed as the Deployment's. Refused at admission for someone without the
    restore verb, where a policy selects the pods; the legitimate neighbours pass: the Deployment's own
    ReplicaSet (the deployment controller's), a ReplicaSet with no Deployment owner, the restore verb's
    holder (server-side dry runs)."""
    ns = namespace
    cluster.apply(policy(ns, "web", "web", cluster.registry))
    cluster.apply(workload("Deployment", "web", ns, cluster.busybox_image, replicas=1))
    live_pod(cluster, ns, "web")  # the deployment controller's ReplicaSet was admitted, and made its pod
    uid = cluster.get_json("deployment", "web", "-n", ns)["metadata"]["uid"]
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "tenant", "namespace": ns},
             "rules": [{"apiGroups": ["apps"], "resources": ["replicasets", "deployments"],
                        "verbs": ["get", "create", "update"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "tenant", "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
             "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]},
        ]
    )  # fmt: skip
    tenant = ("--as", f"system:serviceaccount:{ns}:tenant")

    def replicaset(owned: bool) -> str:
        template = workload("Deployment", "web", ns, cluster.busybox_image, replicas=1)["spec"]["template"]
        meta: dict[str, Any] = {"name": "web-by-hand", "namespace": ns}
        if owned:
            meta["ownerReferences"] = [
                {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": uid, "controller": True}
            ]
        selector = {"matchLabels": template["metadata"]["labels"]}
        spec = {"replicas": 1, "selector": selector, "template": template}
        rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": meta, "spec": spec}
        return json.dumps(rs)

    def create(*who: str, owned: bool) -> Any:
        return cluster.kubectl(*who, "create", "--dry-run=server", "-f", "-", input=replicaset(owned), check=False)

    forged = create(*tenant, owned=True)
    assert forged.returncode != 0, forged.stdout
    assert f"ValidatingAdmissionPolicy '{resume_admission.RESUME_REPLICASETS_POLICY}'" in forged.stderr, forged.stderr
    assert "SnapshotPolicy web protects the pods of this ReplicaSet" in forged.stderr, forged.stderr
    plain = create(*tenant, owned=False)
    assert plain.returncode == 0, plain.stderr  # no Deployment owner: the agent takes it for what it is
    admin = create(owned=True)
    assert admin.returncode == 0, admin.stderr  # the cluster admin holds the restore verb


@pytest.mark.parametrize("refused_by", ["agent", "wrapper"])
def test_a_resume_the_tightened_pod_cannot_take_starts_fresh_with_the_reason(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, refused_by
):
    """Issue 41, items 5 and 7: a save the replacement's spec cannot take is refused, and a resume never
    holds a workload down: the pod starts fresh (a new token), once, with a ResumeSkipped Event naming the
    reason, and runs on (no crash loop). The untightened replacement before it resumes from the same kind
    of save (the legitimate case). Two tightenings of the StatefulSet's template after the save:
    - agent: every capability dropped (the images hold the runtime's default ones): the pod spec alone
      shows it, so the agent refuses while staging (RestoreRefused), before any container is created;
    - wrapper: a configMap volume's mount taken away (the images hold that mount): where runc mounts is
      known only from config.json, so the runtime wrapper's check refuses at create."""
    ns = namespace
    cluster.apply(policy(ns, "tight", "tight", cluster.registry, {"kind": "StatefulSet", "name": "tight"}))
    sts = workload("StatefulSet", "tight", ns, cluster.busybox_image, replicas=1, serviceName="tight")
    if refused_by == "wrapper":
        cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "extra", "namespace": ns},
                "data": {"k": "v"},
            }
        )
        tpl = sts["spec"]["template"]["spec"]
        tpl["volumes"] = [*(tpl.get("volumes") or []), {"name": "extra", "configMap": {"name": "extra"}}]
        mounts = tpl["containers"][0].setdefault("volumeMounts", [])
        mounts.append({"name": "extra", "mountPath": "/etc/extra"})
    cluster.apply(sts)
    first = running(cluster, ns, "tight-0")
    cluster.wait_for("the counter", lambda: counter_value(cluster, ns, "tight-0")[1] >= 5)
    tok, before = counter_value(cluster, ns, "tight-0")
    save(plugin, cluster, ns, "tight-0", "tight")
    cluster.kubectl("delete", "pod", "tight-0", "-n", ns, "--wait=true")
    second = live_pod(cluster, ns, "tight", not_uids={first["metadata"]["uid"]})
    assert_resumed(cluster, ns, second, tok, before)  # the same spec: the save is taken

    _, before = counter_value(cluster, ns, "tight-0")
    save(plugin, cluster, ns, "tight-0", "tight")
    if refused_by == "agent":
        tighten = [{"op": "add", "path": "/spec/template/spec/containers/0/securityContext",
                    "value": {"capabilities": {"drop": ["ALL"]}}}]  # fmt: skip
    else:
        n = len(sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]) - 1
        tighten = [{"op": "remove", "path": f"/spec/template/spec/containers/0/volumeMounts/{n}"}]
    cluster.kubectl("patch", "statefulset", "tight", "-n", ns, "--type", "json", "-p", json.dumps(tighten))
    third = live_pod(cluster, ns, "tight", not_uids={second["metadata"]["uid"]})
    name = third["metadata"]["name"]

    def skipped() -> bool:
        ann = pod_annotations(cluster.get_json("pod", name, "-n", ns)).get(K.ANN_RESTORE_STATUS, "")
        return ann.startswith(K.RESTORE_SKIPPED_PREFIX)

    cluster.wait_for(f"{name} to start fresh, with the reason", skipped, timeout=120)
    events = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.uid={third['metadata']['uid']}")
    reasons = {e["reason"]: e["message"] for e in events["items"]}
    assert K.EVENT_RESUME_SKIPPED in reasons, reasons
    assert "grant more than the container's spec" in reasons[K.EVENT_RESUME_SKIPPED], reasons
    if refused_by == "agent":  # said while staging: no container of the pod was created from the save
        assert "capabilities" in reasons[K.EVENT_RESUME_SKIPPED], reasons
        assert K.EVENT_RESTORE_REFUSED in reasons, reasons
    else:
        assert "/etc/extra" in reasons[K.EVENT_RESUME_SKIPPED], reasons
    tok3, _ = counter_value(cluster, ns, name)
    assert tok3 != tok  # fresh: a new process, not the save
    cluster.wait_for("the fresh counter to go on", lambda: counter_value(cluster, ns, name)[1] >= 5)
    pod = cluster.get_json("pod", name, "-n", ns)
    assert pod["status"]["phase"] == "Running"
    assert all(cs.get("restartCount", 0) == 0 for cs in pod["status"]["containerStatuses"]), pod["status"]
