"""deploy/resume.py renders the resume admission objects the issue asks for (the CEL itself runs on
the real API server in tests/e2e/test_autosave_resume.py; nothing here evaluates CEL)."""

from __future__ import annotations

import json
import re
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import podspec
from kubectl_snapshot.deploy import admission, render
from kubectl_snapshot.deploy import resume_admission as resume

IMAGE = "reg.example/ks/agent@sha256:" + "c" * 64


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(IMAGE)}


def test_the_mutating_policy_never_blocks_and_takes_every_policy_of_the_namespace() -> None:
    objs = objects()
    p = objs[("MutatingAdmissionPolicy", resume.MUTATING_POLICY)]["spec"]
    b = objs[("MutatingAdmissionPolicyBinding", resume.MUTATING_POLICY)]["spec"]
    assert p["failurePolicy"] == "Ignore" and p["reinvocationPolicy"] == "Never"
    assert p["paramKind"] == {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND}
    [rule] = p["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
    assert b == {"policyName": resume.MUTATING_POLICY, "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"}}
    conditions = {c["name"]: c["expression"] for c in p["matchConditions"]}
    assert "['StatefulSet', 'ReplicaSet', 'Job']" in conditions["owned-by-a-resumable-controller"].replace('"', "'")
    assert "params.spec.resume" in conditions["policy-resumes"]
    assert "params.spec.selector.matchLabels.all(" in conditions["policy-selects-the-pod"]
    assert "pod-template-hash" in conditions["policy-workload-owns-the-pod"]
    assert K.ANN_RESTORE_FROM in conditions["not-restoring-already"]
    assert "initContainers" in conditions["no-init-containers"]


def test_the_mutation_adds_the_runtime_class_and_the_annotation_and_no_gate() -> None:
    apply, _gate, _command, _hook = objects()[("MutatingAdmissionPolicy", resume.MUTATING_POLICY)]["spec"]["mutations"]
    assert apply["patchType"] == "ApplyConfiguration"
    expr = apply["applyConfiguration"]["expression"]
    assert "{{" not in expr and "}}" not in expr  # Helm's delimiters (the chart is generated)
    strings = [json.loads(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', expr)]
    assert strings == [K.ANN_RESUME_POLICY, K.RUNTIME_CLASS]
    assert f"{json.dumps(K.ANN_RESUME_POLICY)}: params.metadata.name" in expr
    # the runtime wrapper holds the containers until the agent answers: no gate init container, no volume
    assert "initContainers" not in expr and "volumes" not in expr and IMAGE not in expr


def test_only_pods_never_restarted_get_the_gate_init_container_of_a_restore_pod() -> None:
    _apply, gate, command, _hook = objects()[("MutatingAdmissionPolicy", resume.MUTATING_POLICY)]["spec"]["mutations"]
    never = "has(object.spec.restartPolicy) && object.spec.restartPolicy == 'Never'"
    g = gate["applyConfiguration"]["expression"]
    # a refused create fails a pod the kubelet never restarts: those wait in a gate init container instead
    assert g.startswith(f"{never} ? Object{{spec: ") and g.endswith(" : Object{}")
    assert "{{" not in g and "}}" not in g
    strings = [json.loads(s) for s in re.findall(r'"(?:[^"\\]|\\.)*"', g)]
    want = podspec.gate_container(IMAGE)
    assert strings[:2] == [K.GATE_VOLUME, K.GATE_CONTAINER] and IMAGE in strings
    assert want["terminationMessagePolicy"] in strings and K.GATE_MOUNT in strings
    c = command["jsonPatch"]["expression"]
    assert command["patchType"] == "JSONPatch" and c.endswith(f".filter(p, {never})")
    [value] = re.findall(r"value: (\[.*\])\}\]\.filter", c, re.S)
    assert json.loads(value) == want["command"]  # CEL's string literals here are JSON's
    assert '"/spec/initContainers/0/command"' in c


def test_the_agent_may_change_only_provenance_on_podsnapshots_and_resume_annotations_are_guarded() -> None:
    objs = objects()
    p = objs[("ValidatingAdmissionPolicy", admission.AGENT_SNAPSHOTS_POLICY)]["spec"]
    assert p["failurePolicy"] == "Fail" and p["matchConditions"][0]["expression"].endswith(f"'{K.AGENT_USER}'")
    [v] = [v for v in p["validations"] if "object.spec == oldObject.spec" in v["expression"]]
    for key in (*admission.AGENT_SNAPSHOT_LABELS, *admission.AGENT_SNAPSHOT_ANNOTATIONS):
        assert key in v["expression"]
    pods = objs[("ValidatingAdmissionPolicy", resume.RESUME_PODS_POLICY)]["spec"]
    text = "\n".join(v["expression"] for v in pods["validations"])
    assert "check('restore')" in text and "system:serviceaccount:kube-system:" in text
    assert objs[("ValidatingAdmissionPolicyBinding", resume.RESUME_PODS_POLICY)]["spec"]["validationActions"] == [
        "Deny"
    ]


def test_a_pod_created_with_the_resume_annotation_must_be_selected_by_the_policy_it_names() -> None:
    """Rendering only (the real CEL runs in tests/e2e/test_autosave_resume.py::
    test_a_forged_resume_annotation_in_a_template_is_refused_and_the_pod_runs_fresh): every SnapshotPolicy
    of the namespace is a param, each evaluation must pass, and the one the annotation names must select
    the pod with the very expressions the mutation selects by, so every pod the mutation annotates passes."""
    objs = objects()
    p = objs[("ValidatingAdmissionPolicy", resume.RESUME_SELECTED_POLICY)]["spec"]
    b = objs[("ValidatingAdmissionPolicyBinding", resume.RESUME_SELECTED_POLICY)]["spec"]
    assert p["failurePolicy"] == "Fail" and p["paramKind"] == {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND}
    [rule] = p["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE"] and rule["resources"] == ["pods"]
    # Allow: params are looked up before the matchConditions, so Deny refused every pod of a namespace
    # without a policy (the agent's uninstall DaemonSet's among them, on the real API server)
    assert b["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"} and b["validationActions"] == ["Deny"]
    [v] = p["validations"]
    mutation = objs[("MutatingAdmissionPolicy", resume.MUTATING_POLICY)]["spec"]["matchConditions"]
    selects = {c["name"]: c["expression"] for c in mutation}
    assert selects["policy-selects-the-pod"] in v["expression"]
    assert selects["policy-workload-owns-the-pod"] in v["expression"]
    assert v["expression"].startswith(f"!((has(object.metadata.annotations) && '{K.ANN_RESUME_POLICY}'")
    assert "== params.metadata.name" in v["expression"] and "does not select this pod" in v["messageExpression"]
    # the other policy on the annotation keeps its no-params checks (a missing SnapshotPolicy skips nothing there)
    assert "paramKind" not in objs[("ValidatingAdmissionPolicy", resume.RESUME_PODS_POLICY)]["spec"]
