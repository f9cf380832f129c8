"""Who may give a ReplicaSet a Deployment as its controller where a SnapshotPolicy protects its pods
(threat D15): the rendered policy's CEL, run in-process (tests/support/cel.py), each refusal beside the
request it must let through. The same on the real API server:
tests/e2e/test_autosave_resume.py::test_a_replicaset_with_a_forged_deployment_owner_is_refused."""

from __future__ import annotations

import copy
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy import render
from kubectl_snapshot.deploy import resume_admission as resume
from tests.support.cel import Decision, admit

IMAGE = "reg.example/ks/agent@sha256:" + "c" * 64
DEPLOYMENT_CONTROLLER = "system:serviceaccount:kube-system:deployment-controller"
TENANT = "system:serviceaccount:team:ci"
POLICY = {
    "apiVersion": K.API_VERSION,
    "kind": K.POLICY_KIND,
    "metadata": {"name": "web", "namespace": "team"},
    "spec": {"selector": {"matchLabels": {"app": "web"}}, "interval": "1m", "destination": "r.example/x"},
}


def policy() -> dict[str, Any]:
    [p] = [
        o
        for o in render(IMAGE)
        if o["metadata"]["name"] == resume.RESUME_REPLICASETS_POLICY and "Binding" not in o["kind"]
    ]
    return p


def replicaset(labels: dict[str, str] | None = None, owner_uid: str | None = "dep-uid") -> dict[str, Any]:
    owners = (
        [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": owner_uid, "controller": True}]
        if owner_uid
        else []
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": "web-5d8f", "namespace": "team", "ownerReferences": owners},
        "spec": {
            "selector": {"matchLabels": labels or {"app": "web"}},
            "template": {"metadata": {"labels": labels or {"app": "web"}}, "spec": {"containers": []}},
        },
    }


def request(
    obj: dict[str, Any], *, user: str = TENANT, old: dict[str, Any] | None = None, restore_verb: bool = False
) -> Decision:
    return admit(
        policy(), operation="UPDATE" if old else "CREATE", name="web-5d8f", namespace="team", username=user,
        obj=obj, old=old, params=POLICY, authorized=restore_verb,
    )  # fmt: skip


def test_the_binding_takes_every_policy_of_the_namespace_and_allows_where_there_is_none() -> None:
    [b] = [
        o for o in render(IMAGE) if o["metadata"]["name"] == resume.RESUME_REPLICASETS_POLICY and "Binding" in o["kind"]
    ]
    assert b["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
    assert b["spec"]["validationActions"] == ["Deny"] and policy()["spec"]["failurePolicy"] == "Fail"


def test_the_deployment_controller_makes_and_changes_its_replicasets() -> None:
    made = request(replicaset(), user=DEPLOYMENT_CONTROLLER)
    assert made.allowed and not made.applies
    adopted = request(replicaset(), user="system:kube-controller-manager", old=replicaset(owner_uid=None))
    assert adopted.allowed and not adopted.applies


def test_a_replicaset_made_by_hand_with_a_deployment_owner_is_refused_where_a_policy_protects_its_pods() -> None:
    forged = request(replicaset())
    assert forged.applies and not forged.allowed
    assert "SnapshotPolicy web protects the pods of this ReplicaSet" in forged.denied[0], forged.denied
    assert "restore verb" in forged.denied[0]
    # the legitimate neighbours: no Deployment owner; pods no policy selects; the restore verb
    assert request(replicaset(owner_uid=None)).allowed
    assert request(replicaset(labels={"app": "other"})).allowed
    assert request(replicaset(), restore_verb=True).allowed


def test_an_owner_added_or_changed_by_hand_is_refused_and_other_changes_pass() -> None:
    added = request(replicaset(), old=replicaset(owner_uid=None))
    assert not added.allowed, "a Deployment owner added by hand"
    changed = request(replicaset(), old=replicaset(owner_uid="another-deployment"))
    assert not changed.allowed, "a Deployment owner swapped by hand"
    scaled = replicaset()
    scaled["spec"]["replicas"] = 3
    kept = request(scaled, old=copy.deepcopy(replicaset()))
    assert kept.allowed and not kept.applies, "a change that keeps the owner (kubectl scale, labels)"
