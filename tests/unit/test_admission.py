"""deploy/admission.py renders what docs/security.md promises (the CEL itself runs on the real API
server in tests/e2e/test_tenant_admission.py; nothing here evaluates CEL).

What is checked without a cluster: every policy has a Deny binding and fails closed, every validation
answers Forbidden, each policy asks the authorizer the questions the issue lists, the reference
regular expressions accept exactly what core/reference.py parses with an explicit registry, the
agent's RBAC and the agent policies fit together, and the plugin turns a denial into a hint.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kubectl_snapshot.adapters.kube import map_api_error
from kubectl_snapshot.adapters.kubeconn import ApiError
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument, PermissionDenied
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.deploy import admission, render
from kubectl_snapshot.deploy import resume_admission as resume

DIGEST = "sha256:" + "ab" * 32


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render("img")}


def policy(name: str) -> dict[str, Any]:
    return objects()[("ValidatingAdmissionPolicy", name)]


def expressions(p: dict[str, Any]) -> str:
    spec = p["spec"]
    parts = [v["expression"] for v in spec.get("variables", [])]
    parts += [v["expression"] for v in spec["validations"]]
    parts += [c["expression"] for c in spec.get("matchConditions", [])]
    return "\n".join(parts)


def test_every_policy_is_bound_to_deny_and_fails_closed() -> None:
    objs = objects()
    names = {n for (kind, n) in objs if kind == "ValidatingAdmissionPolicy"}
    assert names == set(admission.POLICIES) | set(resume.VALIDATING_POLICIES)
    for name in names:
        p, b = objs[("ValidatingAdmissionPolicy", name)], objs[("ValidatingAdmissionPolicyBinding", name)]
        assert p["apiVersion"] == b["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert p["spec"]["failurePolicy"] == "Fail"
        # the resume-selected policy's params are the namespace's SnapshotPolicies: with none there it lets
        # pods through (the API server looks params up before the matchConditions, so Deny would refuse
        # every pod of such a namespace); the agent starts a pod whose policy is missing fresh
        params = {"paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"}} if "paramKind" in p["spec"] else {}
        assert b["spec"] == {"policyName": name, "validationActions": ["Deny"], **params}
        for v in p["spec"]["validations"]:
            assert v["reason"] == "Forbidden" and v["messageExpression"], v


def test_apply_order_policies_after_the_crd_and_roles() -> None:
    kinds = [o["kind"] for o in render("img")]
    first_policy = kinds.index("ValidatingAdmissionPolicy")
    assert kinds.index("CustomResourceDefinition") < first_policy
    assert max(i for i, k in enumerate(kinds) if k == "ClusterRole") < first_policy
    assert kinds.index("ValidatingAdmissionPolicyBinding") > first_policy


def test_snapshot_policy_asks_the_authorizer_and_the_namespace() -> None:
    p = policy(admission.SNAPSHOT_POLICY)
    [rule] = p["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [K.GROUP] and rule["resources"] == [K.PLURAL] and rule["operations"] == ["CREATE"]
    text = expressions(p)
    secret_get = (
        "authorizer.group('').resource('secrets').namespace(request.namespace)"
        ".name(object.spec.registrySecret).check('get').allowed()"
    )
    assert secret_get in text
    assert "authorizer.group('').resource('pods').namespace(request.namespace).check('create').allowed()" in text
    assert ".name(object.spec.podName).check('delete').allowed()" in text  # stop deletes the pod
    assert f"namespaceObject.metadata.annotations['{K.ANN_ALLOWED_DESTINATIONS}']" in text
    assert f"namespaceObject.metadata.annotations['{K.ANN_INSECURE_REGISTRIES}']" in text
    # the lists bind everyone who could not rewrite them
    assert "authorizer.group('').resource('namespaces').name(request.namespace).check('update')" in text


def test_snapshot_policy_reserves_the_agents_keys_for_the_agent() -> None:
    p = policy(admission.SNAPSHOT_POLICY)
    [v] = [v for v in p["spec"]["validations"] if "written by the node agent only" in v["messageExpression"]]
    assert v["expression"].startswith(f"request.userInfo.username == '{K.AGENT_USER}' || ")
    for key in (*admission.AGENT_SNAPSHOT_LABELS, *admission.AGENT_SNAPSHOT_ANNOTATIONS):
        assert key in v["expression"], key
    assert f"['{K.LABEL_POD}'] == object.spec.podName" in v["expression"]
    assert K.LABEL_POD not in admission.RESERVED_SNAPSHOT_KEYS  # the plugin labels its saves with their pod


def test_restore_policy_needs_its_own_verb_and_freezes_the_annotations() -> None:
    p = policy(admission.RESTORE_POLICY)
    [rule] = p["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/status"] and rule["operations"] == ["CREATE", "UPDATE"]
    text = expressions(p)
    assert (
        f"authorizer.group('{K.GROUP}').resource('{K.PLURAL}').namespace(request.namespace)"
        f".check('{K.RESTORE_VERB}').allowed()"
    ) in text
    assert ".name(variables.secret).check('get').allowed()" in text
    assert K.ANN_RESTORE_FROM in p["spec"]["matchConditions"][0]["expression"]
    assert K.ANN_REGISTRY_SECRET in p["spec"]["matchConditions"][0]["expression"]
    [frozen] = [v for v in p["spec"]["validations"] if "cannot be added or changed" in v["messageExpression"]]
    assert "oldObject" in frozen["expression"] and frozen["expression"].startswith("request.operation != 'UPDATE'")


@pytest.mark.parametrize(
    "name", [admission.AGENT_NODES_POLICY, admission.AGENT_PODS_POLICY, admission.AGENT_SNAPSHOTS_POLICY]
)
def test_agent_policies_bind_writes_to_the_tokens_node(name: str) -> None:
    p = policy(name)
    [cond] = p["spec"]["matchConditions"]
    assert cond["expression"] == f"request.userInfo.username == '{K.AGENT_USER}'"
    assert f"system:serviceaccount:{K.AGENT_NAMESPACE}:{K.AGENT_NAME}" == K.AGENT_USER
    text = expressions(p)
    assert f"request.userInfo.extra['{K.NODE_NAME_EXTRA}']" in text
    ops = p["spec"]["matchConstraints"]["resourceRules"][0]["operations"]
    assert ops == ["CREATE", "UPDATE", "DELETE"]  # everything the agent could do there is looked at


def test_agent_rbac_and_policies_fit() -> None:
    """What RBAC still grants on pods and nodes is narrowed by a policy; the rest is not granted at all."""
    role = objects()[("ClusterRole", K.AGENT_NAME)]
    grants = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert ("pods", "patch") not in grants and ("pods", "update") not in grants
    assert not any(r == "secrets" for r, _ in grants)
    assert ("pods/status", "patch") in grants and ("pods", "delete") in grants and ("nodes", "patch") in grants
    pods = policy(admission.AGENT_PODS_POLICY)["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    nodes = policy(admission.AGENT_NODES_POLICY)["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert {"pods", "pods/status"} <= set(pods) and "nodes" in nodes
    assert K.ANN_RESTORE_STATUS in expressions(policy(admission.AGENT_PODS_POLICY))
    assert K.ANN_NODE_FACTS in expressions(policy(admission.AGENT_NODES_POLICY))
    # PodSnapshots: RBAC grants only the status; the policy binds those writes to the token's node
    assert (f"{K.PLURAL}/status", "patch") in grants and (K.PLURAL, "patch") not in grants
    assert (K.PLURAL, "update") not in grants
    snaps = policy(admission.AGENT_SNAPSHOTS_POLICY)["spec"]
    assert {K.PLURAL, f"{K.PLURAL}/status"} <= set(snaps["matchConstraints"]["resourceRules"][0]["resources"])
    assert snaps["matchConstraints"]["resourceRules"][0]["apiGroups"] == [K.GROUP]


def test_agent_snapshots_policy_binds_the_status_node_both_sides() -> None:
    """The claim's old and new status.node are compared with the token's node (the CEL itself runs in
    tests/e2e/test_tenant_admission.py::test_agent_writes_only_to_its_own_node)."""
    p = policy(admission.AGENT_SNAPSHOTS_POLICY)
    variables = {v["name"]: v["expression"] for v in p["spec"]["variables"]}
    assert "oldObject.status.node" in variables["claimedBy"] and "object.status.node" in variables["claims"]
    assert not variables["claims"].count("oldObject")
    [bound] = [v for v in p["spec"]["validations"] if "variables.claims" in v["expression"]]
    assert "variables.claims == variables.node" in bound["expression"]
    assert "variables.claimedBy == '' || variables.claimedBy == variables.node" in bound["expression"]
    assert "variables.node != ''" in bound["expression"]  # a token bound to no node writes nothing


def test_autosave_policy_needs_create_and_restore_and_the_namespace_lists() -> None:
    p = policy(admission.AUTOSAVE_POLICY)
    [rule] = p["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == [K.POLICY_PLURAL] and rule["operations"] == ["CREATE", "UPDATE"]
    text = expressions(p)
    for verb in ("create", K.RESTORE_VERB):
        assert (
            f"authorizer.group('{K.GROUP}').resource('{K.PLURAL}').namespace(request.namespace)"
            f".check('{verb}').allowed()"
        ) in text
    assert ".name(object.spec.registrySecret).check('get').allowed()" in text
    assert f"namespaceObject.metadata.annotations['{K.ANN_ALLOWED_DESTINATIONS}']" in text
    assert f"namespaceObject.metadata.annotations['{K.ANN_INSECURE_REGISTRIES}']" in text
    [verbs] = [v for v in p["spec"]["validations"] if K.RESTORE_VERB in v["messageExpression"]]
    assert "create and the restore verb" in verbs["messageExpression"]


def test_the_agents_policy_saves_skip_only_the_requester_checks() -> None:
    """The agent creates a policy's saves: the destination is checked again against the namespace's lists,
    the requester checks were the policy creator's (at policy admission); it may set last-save on pods."""
    p = policy(admission.SNAPSHOT_POLICY)
    [save] = [v for v in p["spec"]["variables"] if v["name"] == "policySave"]
    assert K.AGENT_USER in save["expression"] and K.LABEL_POLICY in save["expression"]
    assert "object.spec.stop" in save["expression"]
    skipping = [v for v in p["spec"]["validations"] if "variables.policySave" in v["expression"]]
    assert len(skipping) == 2  # create pods, get the Secret; never the destination lists
    assert all("secrets" in v["expression"] or "'pods'" in v["expression"] for v in skipping)
    assert K.ANN_LAST_SAVE in expressions(policy(admission.AGENT_PODS_POLICY))


def re2(pattern: str, text: str) -> bool:
    """RE2's `$` (CEL matches()) is the end of the text; Python's also matches before a final newline."""
    assert pattern.endswith("$")
    return re.search(pattern[:-1] + r"\Z", text) is not None


DESTINATIONS_OK = [
    "127.0.0.1:5005/team-a/app",
    "127.0.0.1:5005/team-a/app:v1.2_3",
    "registry.example.com/a/b/c:latest",
    "localhost/x",
    "localhost:5000/x__y",
    "[::1]:5000/snapshots/web",
    "reg:5000/x",
]
DESTINATIONS_BAD = [
    "ubuntu",  # docker hub implied: the registry must be explicit
    "team-a/app",  # the first component is not a registry
    "Registry.example.com/app",
    "127.0.0.1:5005/Team/app",
    "127.0.0.1:5005/a/../b",
    "127.0.0.1:5005/a//b",
    "127.0.0.1:5005",
    f"127.0.0.1:5005/app@{DIGEST}",  # a destination has no digest yet
    "127.0.0.1:5005/app:",
    "127.0.0.1:5005/app\n",
]


@pytest.mark.parametrize("ref", DESTINATIONS_OK)
def test_destination_regex_accepts_what_reference_parses_the_same_way(ref: str) -> None:
    assert re2(admission.DESTINATION_RE, ref)
    parsed = Reference.parse(ref)
    repo = ref.rsplit(":", 1)[0] if ref.rfind(":") > ref.rfind("/") else ref
    assert f"{parsed.registry}/{parsed.repository}" == repo  # what the allow-list compares is what is contacted


@pytest.mark.parametrize("ref", DESTINATIONS_BAD)
def test_destination_regex_refuses(ref: str) -> None:
    assert not re2(admission.DESTINATION_RE, ref)


def test_source_regex_needs_a_digest() -> None:
    good = f"127.0.0.1:5005/team-a/app@{DIGEST}"
    assert re2(admission.SOURCE_RE, good)
    for bad in ("127.0.0.1:5005/team-a/app:v1", f"app@{DIGEST}", good + "0", good.replace("ab", "AB", 1)):
        assert not re2(admission.SOURCE_RE, bad), bad


def test_no_cel_string_literal_is_broken() -> None:
    """Every constant lands in single-quoted CEL literals: none may contain a quote."""
    for name in admission.POLICIES:
        for v in policy(name)["spec"]["validations"]:
            assert v["messageExpression"].count("'") % 2 == 0, v["messageExpression"]
    with pytest.raises(AssertionError):
        admission._quote("it's")


def _denied(message: str, status: int = 403) -> ApiError:
    return ApiError(status, "Forbidden", json.dumps({"kind": "Status", "message": message}).encode())


def test_plugin_turns_a_denial_into_a_hint() -> None:
    prefix = (
        "pods \"web-restored\" is forbidden: ValidatingAdmissionPolicy 'kubectl-snapshot-restore' with binding "
        "'kubectl-snapshot-restore' denied request: "
    )
    err = map_api_error(_denied(prefix + "restoring into a pod needs the restore verb on ..."), "create pod", "s")
    assert isinstance(err, PermissionDenied) and "kubectl-snapshot-restore role" in (err.hint or "")
    err = map_api_error(_denied(prefix + f"... its annotation {K.ANN_ALLOWED_DESTINATIONS} lists nothing"), "x", "s")
    assert K.ANN_ALLOWED_DESTINATIONS in (err.hint or "") and "cluster admin" in (err.hint or "")
    err = map_api_error(_denied(prefix + "you cannot get secret creds in namespace a"), "x", "s")
    assert "can-i get secret" in (err.hint or "")
    plain = map_api_error(_denied('pods is forbidden: User "u" cannot create resource "pods"'), "x", "s")
    assert "RBAC" in (plain.hint or "")
    other = map_api_error(
        _denied(
            "pods \"x\" is forbidden: policy 'drop-all' with binding 'drop-all' denied request: error applying patch"
        ),
        "x",
        "s",
    )
    assert "admission policy or webhook" in (other.hint or "") and "RBAC" not in (other.hint or "")
    hook = map_api_error(_denied('admission webhook "v.example.com" denied the request: no'), "x", "s")
    assert "admission policy or webhook" in (hook.hint or "")
    assert isinstance(map_api_error(_denied("bad", 422), "x", "s"), InvalidArgument)
