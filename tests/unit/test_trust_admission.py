"""What the agent may write to the trust ConfigMap: the rendered policy's CEL, run in-process (tests/support/cel.py).

Each refusal beside the write it must let through: an agent adds its own node's key. The same requests on
the real API server: tests/e2e/test_tenant_admission.py::test_an_agent_token_adds_only_its_own_nodes_key.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.provenance import SigningKey, node_key_entries
from kubectl_snapshot.deploy import admission, rbac, render, trust
from tests.support.cel import Decision, admit

CLUSTER_KEY = SigningKey.generate()
NODE_B_KEY = SigningKey.generate()


def live() -> dict[str, Any]:
    """After install (the old cluster key still trusted) and node n2's agent registering its key."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": K.TRUST_CONFIG_MAP, "namespace": K.AGENT_NAMESPACE, "labels": {"a": "b"}},
        "data": {
            "cluster-id": "c-uid",
            "allow-unverified-snapshots": "false",
            f"{CLUSTER_KEY.public.id}.pub": CLUSTER_KEY.public.to_pem().decode(),
            **node_key_entries(NODE_B_KEY.public, "n2"),
        },
    }


def update(
    edit: dict[str, str | None],
    *,
    node: str | None = "n1",
    user: str = K.AGENT_USER,
    name: str = K.TRUST_CONFIG_MAP,
    base: dict[str, Any] | None = None,
) -> Decision:
    """The agent's merge patch of `edit` (None removes an entry), as admission sees it."""
    old = base or live()
    old["metadata"]["name"] = name
    new = copy.deepcopy(old)
    for k, v in edit.items():
        if v is None:
            new["data"].pop(k, None)
        else:
            new["data"][k] = v
    extra = {K.NODE_NAME_EXTRA: [node]} if node is not None else {}
    return admit(
        policy(), operation="UPDATE", name=name, namespace=K.AGENT_NAMESPACE, username=user, extra=extra,
        obj=new, old=old,
    )  # fmt: skip


def policy() -> dict[str, Any]:
    [p] = [
        o
        for o in render("img")
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == admission.AGENT_TRUST_POLICY
    ]
    return p


def own_key(node: str = "n1") -> dict[str, str | None]:
    return dict(node_key_entries(SigningKey.generate().public, node))


def test_an_agent_adds_its_own_nodes_key() -> None:
    d = update(own_key("n1"))
    assert d.applies and d.allowed, d.denied


def test_an_agent_cannot_register_a_key_for_another_node() -> None:
    d = update(own_key("n2"))
    assert d.denied == (
        "the agent registers keys of its own node only (its token is bound to node n1), not of node n2",
    )


@pytest.mark.parametrize(
    "what",
    ["another node's key replaced", "another node's key rebound", "a key removed", "the policy changed"],
)
def test_an_agent_cannot_change_or_remove_what_is_there(what: str) -> None:
    mine = SigningKey.generate().public
    b = NODE_B_KEY.public.id
    edits: dict[str, dict[str, str | None]] = {
        "another node's key replaced": {f"{b}.pub": mine.to_pem().decode()},
        "another node's key rebound": {f"{b}.node": "n1"},
        "a key removed": {f"{CLUSTER_KEY.public.id}.pub": None},
        "the policy changed": {"allow-unverified-snapshots": "true"},
    }
    edit = edits[what]
    d = update({**own_key("n1"), **edit})
    [changed] = edit
    assert any(m.endswith(f"it may not change or remove {changed}") for m in d.denied), d.denied


def test_an_agent_cannot_add_a_key_bound_to_no_node_or_bind_one_that_is_there() -> None:
    mine = SigningKey.generate().public
    unbound = update({f"{mine.id}.pub": mine.to_pem().decode()})
    assert any("as two entries, <key id>.pub and <key id>.node" in m for m in unbound.denied), unbound.denied
    # the cluster key is unbound (vouches for any node); binding it would refuse every old snapshot
    rebind = update({f"{CLUSTER_KEY.public.id}.node": "n1"})
    assert any("as two entries" in m for m in rebind.denied), rebind.denied
    policy_entry = update({**own_key("n1"), "allow-unverified-snapshots.node": "n1"})
    assert not policy_entry.allowed


def test_nothing_but_data_changes() -> None:
    old = live()
    new = copy.deepcopy(old)
    new["data"].update({k: v for k, v in own_key("n1").items() if v is not None})
    relabelled = copy.deepcopy(new)
    relabelled["metadata"]["labels"] = {}
    frozen = copy.deepcopy(new)
    frozen["immutable"] = True  # would keep install and every other node from writing it
    for obj in (relabelled, frozen):
        d = admit(
            policy(), operation="UPDATE", name=K.TRUST_CONFIG_MAP, namespace=K.AGENT_NAMESPACE,
            username=K.AGENT_USER, extra={K.NODE_NAME_EXTRA: ["n1"]}, obj=obj, old=old,
        )  # fmt: skip
        assert d.denied == (
            "the agent only adds keys of its node to the trust ConfigMap; it may not change or remove anything else",
        )


def test_a_token_bound_to_no_node_adds_nothing() -> None:
    d = update(own_key("n1"), node=None)
    assert any("this token is bound to no node" in m for m in d.denied), d.denied


@pytest.mark.parametrize("operation", ["CREATE", "DELETE"])
def test_the_agent_neither_creates_nor_deletes_it(operation: str) -> None:
    obj = live() if operation == "CREATE" else None
    old = live() if operation == "DELETE" else None
    d = admit(
        policy(), operation=operation, name=K.TRUST_CONFIG_MAP, namespace=K.AGENT_NAMESPACE, username=K.AGENT_USER,
        extra={K.NODE_NAME_EXTRA: ["n1"]}, obj=obj, old=old,
    )  # fmt: skip
    assert f"the agent adds keys of its node to the trust ConfigMap; it does not {operation} it" in d.denied


def test_a_node_has_a_bounded_number_of_keys() -> None:
    base = live()
    for _ in range(admission.MAX_KEYS_PER_NODE - 1):
        base["data"].update(node_key_entries(SigningKey.generate().public, "n1"))
    assert update(own_key("n1"), base=copy.deepcopy(base)).allowed  # the 16th
    base["data"].update(node_key_entries(SigningKey.generate().public, "n1"))
    d = update(own_key("n1"), base=base)
    assert d.denied == (
        f"node n1 has more than {admission.MAX_KEYS_PER_NODE} signing keys in the trust ConfigMap; "
        "an administrator removes the entries of its old keys",
    )


def test_administrators_and_other_configmaps_are_not_its_business() -> None:
    assert not update({"allow-unverified-snapshots": "true"}, user="kubernetes-admin", node=None).applies
    assert not update({"x": "y"}, name="another-configmap").applies


def test_the_agent_may_get_and_patch_the_trust_configmap_by_name_only() -> None:
    role = trust.trust_role({})
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [K.TRUST_CONFIG_MAP],
            "verbs": ["get", "patch"],
        }
    ]
    objs = {(o["kind"], o["metadata"]["name"]) for o in render("img")}
    assert ("Role", trust.ROLE) in objs and ("RoleBinding", trust.ROLE) in objs
    assert all("configmaps" not in r["resources"] for r in rbac.agent_rules())  # nothing cluster-wide


def test_an_agent_cannot_lift_or_move_a_keys_retirement() -> None:
    """An administrator's `<id>.not-after` (docs/security.md, "Retiring a key") stays as it is: no agent
    removes or changes it, nor writes one; the same ConfigMap lets the agent add its own key beside it."""
    retired = live()
    retired["data"][f"{NODE_B_KEY.public.id}.not-after"] = "2026-11-30T12:00:00Z"
    entry = f"{NODE_B_KEY.public.id}.not-after"
    assert not update({entry: None}, node="n2", base=copy.deepcopy(retired)).allowed
    assert not update({entry: "2099-01-01T00:00:00Z"}, node="n2", base=copy.deepcopy(retired)).allowed
    key = own_key("n1")
    [pub] = [k for k in key if k.endswith(".pub")]
    assert not update(
        {**key, pub.replace(".pub", ".not-after"): "2099-01-01T00:00:00Z"}, base=copy.deepcopy(retired)
    ).allowed
    d = update(key, base=copy.deepcopy(retired))
    assert d.applies and d.allowed, d.denied
