"""Workload-aware resume (autosave): what the API server does so that a protected workload's new pods
resume from their predecessor's last save, without anyone editing the workload (GitOps keeps working).

- ``kubectl-snapshot-resume`` (MutatingAdmissionPolicy, admissionregistration.k8s.io/v1, paramKind
  SnapshotPolicy, bound to every SnapshotPolicy of the pod's namespace): a Pod CREATE whose controller
  is a StatefulSet, ReplicaSet or Job, selected by a policy with ``resume: true`` (matchLabels, and
  its workload when set), with no restore annotation and no init containers of its own, gets
  ``runtimeClassName: kubectl-snapshot`` and ``kubectl-snapshot.io/resume-policy: <policy>``; no
  gate init container (the runtime wrapper holds the pod's containers at their create until the
  node's agent has staged the save: shim/engine/staging.py, "pod gates"), except for a pod with
  ``restartPolicy: Never``, which also gets the gate volume and init container exactly as
  ``core/podspec.restore_pod`` builds them: the wrapper can hold a create only within the kubelet's
  runtime request timeout, and a refused create (a save that stages longer, an agent not up yet) is
  a StartError that fails a pod which is never restarted; a gate init container waits as long as the
  staging takes.
  failurePolicy Ignore and parameterNotFoundAction Allow: a broken or missing policy never blocks a
  pod, and pods no policy selects are never touched.
- ``kubectl-snapshot-resume-pods`` (ValidatingAdmissionPolicy): the resume-policy annotation is set at
  creation only, and only on pods a controller of kube-system creates (the mutation above) or by
  someone with the ``restore`` verb; it cannot be added or changed later.
- ``kubectl-snapshot-resume-selected`` (ValidatingAdmissionPolicy, paramKind SnapshotPolicy): the
  policy the annotation names selects the pod (a Deployment's template can carry the annotation, and
  its pods come from a kube-system controller).
- ``kubectl-snapshot-resume-replicasets`` (ValidatingAdmissionPolicy, paramKind SnapshotPolicy): in a
  namespace where a policy selects a ReplicaSet's pods, only a kube-system controller (the deployment
  controller) or someone with the ``restore`` verb gives that ReplicaSet a Deployment as its controller:
  the agent takes a Deployment's saves for the pods of the ReplicaSets it owns, so a ReplicaSet made by
  hand with a forged owner would get them (docs/security.md, D15).
- ``kubectl-snapshot-agent-podsnapshots`` (ValidatingAdmissionPolicy): the agent, which may patch
  PodSnapshots for the provenance labels and the resume claim, changes nothing else of them.
- ``kubectl-snapshot-agent-resume`` (ClusterRole + binding): what the agent needs for this on top of
  its base role (docs/security.md says why each).
"""

from __future__ import annotations

import json
from typing import Any

from kubectl_snapshot.core import finalsave as F
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.podspec import gate_container
from kubectl_snapshot.deploy.admission import API, _binding, _can, _deny, _match, _policy, _quote

MUTATING_POLICY = "kubectl-snapshot-resume"
RESUME_PODS_POLICY = "kubectl-snapshot-resume-pods"
RESUME_SELECTED_POLICY = "kubectl-snapshot-resume-selected"
RESUME_REPLICASETS_POLICY = "kubectl-snapshot-resume-replicasets"
AGENT_RESUME_ROLE = "kubectl-snapshot-agent-resume"
RESUMABLE_OWNERS = ("StatefulSet", "ReplicaSet", "Job")
# What the agent may change on a PodSnapshot (everything else, spec included, stays as it was).
# Who creates a controller's pods (kube-controller-manager with --use-service-account-credentials, or without).
CONTROLLER_USERS = (
    "request.userInfo.username.startsWith('system:serviceaccount:kube-system:')"
    " || request.userInfo.username == 'system:kube-controller-manager'"
)


def _cel(text: str) -> str:
    """A CEL double-quoted string literal (JSON's escapes are CEL's)."""
    return json.dumps(text)


def _labels_has(key: str) -> str:
    return f"has(object.metadata.labels) && {_quote(key)} in object.metadata.labels"


_CONTROLLER = "has(r.controller) && r.controller"
# The SnapshotPolicy `params` selects the pod `object`: its matchLabels are among the pod's labels, and
# its workload (when it names one) is the pod's controller, a Deployment through its ReplicaSet's name.
# The agent decides again from the real owner chain (core/autosave.why_not_selected).
POLICY_SELECTS_CEL = (
    "has(params.spec.selector) && has(params.spec.selector.matchLabels)"
    " && params.spec.selector.matchLabels.all(k, has(object.metadata.labels) && k in object.metadata.labels"
    " && object.metadata.labels[k] == params.spec.selector.matchLabels[k])"
)
POLICY_WORKLOAD_CEL = (
    "!has(params.spec.workload) || has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
    f"{_CONTROLLER} && ((r.kind == params.spec.workload.kind && r.name == params.spec.workload.name)"
    " || (params.spec.workload.kind == 'Deployment' && r.kind == 'ReplicaSet'"
    f" && {_labels_has('pod-template-hash')}"
    " && r.name == params.spec.workload.name + '-' + object.metadata.labels['pod-template-hash'])))"
)
_MATCH_CONDITIONS = [
    {
        "name": "owned-by-a-resumable-controller",
        "expression": "has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
        f"{_CONTROLLER} && r.kind in {json.dumps(list(RESUMABLE_OWNERS))})",
    },
    {"name": "policy-resumes", "expression": "!has(params.spec.resume) || params.spec.resume"},
    {"name": "policy-selects-the-pod", "expression": POLICY_SELECTS_CEL},
    {"name": "policy-workload-owns-the-pod", "expression": POLICY_WORKLOAD_CEL},
    {
        "name": "not-restoring-already",
        "expression": "!has(object.metadata.annotations) || !("
        f"{_quote(K.ANN_RESTORE_FROM)} in object.metadata.annotations"
        f" || {_quote(K.ANN_RESUME_POLICY)} in object.metadata.annotations)",
    },
    {
        # a resumed pod's init containers would run again from scratch before its restored app containers
        "name": "no-init-containers",
        "expression": "!has(object.spec.initContainers) || size(object.spec.initContainers) == 0",
    },
    {
        "name": "no-other-runtime-class",
        "expression": "!has(object.spec.runtimeClassName)"
        f" || object.spec.runtimeClassName == {_quote(K.RUNTIME_CLASS)}",
    },
]


def _no_helm_delimiters(expr: str) -> str:
    """No "{{" or "}}" (Helm's delimiters; the chart is generated from this text): CEL ignores the space."""
    while "}}" in expr or "{{" in expr:
        expr = expr.replace("}}", "} }").replace("{{", "{ {")
    return expr


def _apply_configuration() -> str:
    """Mutation 1 (ApplyConfiguration, merged like server-side apply): the runtime class and the
    annotation. No gate init container here: the runtime wrapper holds each container of a resuming pod
    at its create until the node's agent has staged the save or said to start fresh (containerd passes
    the annotation to the wrapper: the runtime handler's ``pod_annotations``, node_install.dropin_toml)."""
    return _no_helm_delimiters(
        "Object{"
        f"metadata: Object.metadata{{annotations: {{{_cel(K.ANN_RESUME_POLICY)}: params.metadata.name}}}}, "
        f"spec: Object.spec{{runtimeClassName: {_cel(K.RUNTIME_CLASS)}}}"
        "}"
    )


# Pods the kubelet never restarts wait in a gate init container (the module's docstring says why).
NEVER_RESTARTED_CEL = "has(object.spec.restartPolicy) && object.spec.restartPolicy == 'Never'"


def _gate_configuration(gate_image: str) -> str:
    """Mutation 2 (ApplyConfiguration), pods never restarted only: the gate volume and the gate init
    container without its command (an atomic list, which an ApplyConfiguration may not set; mutation
    3 adds it)."""
    gate = gate_container(gate_image)
    mounts = ", ".join(
        f"Object.spec.initContainers.volumeMounts{{name: {_cel(m['name'])}, mountPath: {_cel(m['mountPath'])}}}"
        for m in gate["volumeMounts"]
    )
    requests = ", ".join(f"{_cel(k)}: {_cel(v)}" for k, v in gate["resources"]["requests"].items())
    init = (
        "Object.spec.initContainers{"
        f"name: {_cel(gate['name'])}, image: {_cel(gate['image'])}, "
        f"volumeMounts: [{mounts}], "
        f"terminationMessagePolicy: {_cel(gate['terminationMessagePolicy'])}, "
        f"resources: Object.spec.initContainers.resources{{requests: {{{requests}}}}}"
        "}"
    )
    return _no_helm_delimiters(
        f"{NEVER_RESTARTED_CEL} ? Object{{spec: Object.spec{{"
        f"volumes: [Object.spec.volumes{{name: {_cel(K.GATE_VOLUME)}, emptyDir: Object.spec.volumes.emptyDir{{}}}}], "
        f"initContainers: [{init}]"
        "}} : Object{}"
    )


def _gate_command_patch(gate_image: str) -> str:
    """Mutation 3 (JSONPatch), pods never restarted only: the gate's command. The gate is init container
    0: the pod had none (a match condition). (A list of strings: this API server panics on a JSONPatch
    value holding objects, "reflect.Set: *structpb.Struct is not assignable to *structpb.Value".) The
    list is filtered, not a conditional, so that its type stays a list of JSONPatch either way."""
    command = ", ".join(map(_cel, gate_container(gate_image)["command"]))
    return _no_helm_delimiters(
        f'[JSONPatch{{op: "add", path: "/spec/initContainers/0/command", value: [{command}]}}]'
        f".filter(p, {NEVER_RESTARTED_CEL})"
    )


_VARIABLES = [
    {
        "name": "grace",
        "expression": "has(object.spec.terminationGracePeriodSeconds) ? object.spec.terminationGracePeriodSeconds"
        f" : {F.DEFAULT_GRACE_S}",
    },
    # core/finalsave.hook_sleep_s in CEL: the grace period less a fifth of it (1 s to 10 s)
    {
        "name": "hookSleep",
        "expression": f"variables.grace - (variables.grace / 5 < 1 ? 1 : (variables.grace / 5 > {F.MAX_MARGIN_S}"
        f" ? {F.MAX_MARGIN_S} : variables.grace / 5))",
    },
]
# a hook only where no container has a preStop of its own, and the grace period leaves time for a save
_NO_OWN_PRESTOP = "object.spec.containers.all(c, !has(c.lifecycle) || !has(c.lifecycle.preStop))"
HOOK_CONDITION_CEL = f"variables.grace >= {F.MIN_GRACE_S} && {_NO_OWN_PRESTOP}"


def _final_save_hook() -> str:
    """Mutation 4 (ApplyConfiguration, merged by container name): the final save's preStop sleep on
    every app container (core/finalsave.py); nothing when a container has a preStop of its own or the
    grace period is too short for a save."""
    hook = (
        "Object.spec.containers.lifecycle{preStop: Object.spec.containers.lifecycle.preStop{"
        "sleep: Object.spec.containers.lifecycle.preStop.sleep{seconds: variables.hookSleep}}}"
    )
    containers = f"object.spec.containers.map(c, Object.spec.containers{{name: c.name, lifecycle: {hook}}})"
    return _no_helm_delimiters(
        f"{HOOK_CONDITION_CEL} ? Object{{spec: Object.spec{{containers: {containers}}}}} : Object{{}}"
    )


def mutating_policy(labels: dict[str, str], gate_image: str) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": MUTATING_POLICY, "labels": dict(labels)},
        "spec": {
            "paramKind": {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND},
            "matchConstraints": _match([""], ["v1"], ["CREATE"], ["pods"]),
            "matchConditions": [dict(c) for c in _MATCH_CONDITIONS],
            "variables": [dict(v) for v in _VARIABLES],
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "Never",
            "mutations": [
                {
                    "patchType": "ApplyConfiguration",
                    "applyConfiguration": {"expression": _apply_configuration()},
                },
                {
                    "patchType": "ApplyConfiguration",
                    "applyConfiguration": {"expression": _gate_configuration(gate_image)},
                },
                {"patchType": "JSONPatch", "jsonPatch": {"expression": _gate_command_patch(gate_image)}},
                {"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": _final_save_hook()}},
            ],
        },
    }


def mutating_binding(labels: dict[str, str]) -> dict[str, Any]:
    """Every SnapshotPolicy of the pod's own namespace is a param (none: the pod is left alone)."""
    return {
        "apiVersion": API,
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": MUTATING_POLICY, "labels": dict(labels)},
        "spec": {
            "policyName": MUTATING_POLICY,
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
        },
    }


def _ann(obj: str, key: str) -> str:
    k = _quote(key)
    return (
        f"(has({obj}.metadata.annotations) && {k} in {obj}.metadata.annotations ? {obj}.metadata.annotations[{k}] : '')"
    )


def resume_pods_policy(labels: dict[str, str]) -> dict[str, Any]:
    key = _quote(K.ANN_RESUME_POLICY)
    carries = "has({o}.metadata.annotations) && " + key + " in {o}.metadata.annotations"
    return _policy(
        RESUME_PODS_POLICY,
        labels,
        {
            "matchConstraints": _match([""], ["v1"], ["CREATE", "UPDATE"], ["pods", "pods/status"]),
            "matchConditions": [
                {
                    "name": "carries-resume-annotation",
                    "expression": f"({carries.format(o='object')})"
                    f" || (request.operation == 'UPDATE' && {carries.format(o='oldObject')})",
                }
            ],
            "validations": [
                _deny(
                    f"request.operation != 'UPDATE' || {_ann('object', K.ANN_RESUME_POLICY)}"
                    f" == {_ann('oldObject', K.ANN_RESUME_POLICY)}",
                    f"'the annotation {K.ANN_RESUME_POLICY} is set when a pod is created"
                    " and cannot be added or changed'",
                ),
                _deny(
                    f"request.operation != 'CREATE' || {CONTROLLER_USERS} || "
                    + _can(K.RESTORE_VERB, K.PLURAL, group=K.GROUP),
                    f"'{K.ANN_RESUME_POLICY} is set by admission on pods a workload controller creates; setting it"
                    f" yourself needs the {K.RESTORE_VERB} verb on {K.PLURAL}.{K.GROUP} in namespace '"
                    " + request.namespace",
                ),
            ],
        },
    )


def resume_selected_policy(labels: dict[str, str]) -> dict[str, Any]:
    """A pod created with the resume annotation is one the named SnapshotPolicy selects.

    A template can carry the annotation, and the pods of a Deployment come from a kube-system
    controller, which resume_pods_policy lets through: this is what keeps the annotation to pods the
    policy protects. Evaluated once per SnapshotPolicy of the pod's namespace (the binding's paramRef
    selects them all; every evaluation must pass): the one the annotation names must select the pod,
    the others have nothing to say. No SnapshotPolicy in the namespace: let through here
    (parameterNotFoundAction Allow: the API server looks the params up before it evaluates the
    matchConditions, so Deny would refuse every pod of every namespace without a policy, the agent's own
    included). Such an annotation, and one naming a policy that does not exist (CEL sees one param at a
    time, never the whole list), passes here; the agent starts such a pod fresh (shim/controller/resume_source.py)."""
    named = f"{_ann('object', K.ANN_RESUME_POLICY)} == params.metadata.name"
    return _policy(
        RESUME_SELECTED_POLICY,
        labels,
        {
            "paramKind": {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND},
            "matchConstraints": _match([""], ["v1"], ["CREATE"], ["pods"]),
            "matchConditions": [
                {
                    "name": "carries-resume-annotation",
                    "expression": f"has(object.metadata.annotations) && {_quote(K.ANN_RESUME_POLICY)}"
                    " in object.metadata.annotations",
                }
            ],
            "validations": [
                _deny(
                    f"!({named}) || (({POLICY_SELECTS_CEL}) && ({POLICY_WORKLOAD_CEL}))",
                    "'SnapshotPolicy ' + params.metadata.name + ' does not select this pod (its matchLabels, and its"
                    f" workload when it names one): only pods a policy selects may carry {K.ANN_RESUME_POLICY}'",
                ),
            ],
        },
    )


def resume_selected_binding(labels: dict[str, str]) -> dict[str, Any]:
    binding = _binding(RESUME_SELECTED_POLICY, labels)
    binding["spec"]["paramRef"] = {"selector": {}, "parameterNotFoundAction": "Allow"}
    return binding


def _deployment_controller(obj: str, uid: str | None = None) -> str:
    same = f" && r.uid == {uid}" if uid else ""
    return (
        f"has({obj}.metadata.ownerReferences) && {obj}.metadata.ownerReferences.exists(r, "
        f"{_CONTROLLER} && r.kind == 'Deployment'{same})"
    )


# The SnapshotPolicy `params` selects the pods of the ReplicaSet `object` (its template's labels).
POLICY_SELECTS_TEMPLATE_CEL = (
    "has(params.spec.selector) && has(params.spec.selector.matchLabels)"
    " && has(object.spec.template.metadata) && has(object.spec.template.metadata.labels)"
    " && params.spec.selector.matchLabels.all(k, k in object.spec.template.metadata.labels"
    " && object.spec.template.metadata.labels[k] == params.spec.selector.matchLabels[k])"
)


def resume_replicasets_policy(labels: dict[str, str]) -> dict[str, Any]:
    """A ReplicaSet given a Deployment as its controller (created so, or the reference added or changed
    later) by someone who is neither a kube-system controller nor holds the restore verb, in a namespace
    where a SnapshotPolicy selects its pods: refused. The agent names a pod's workload from the owner
    chain (core/workload.workload_of), and the Deployment controller is who makes those ReplicaSets; one
    made by hand with a forged reference (the Deployment's uid is readable by anyone who may get it)
    would have its pods final-saved as that Deployment's and resume its saves. The legitimate cases pass:
    the deployment controller's ReplicaSets (and its adoptions), ReplicaSets without a Deployment owner,
    changes that keep the owner as it was, and any namespace where no policy selects the pods
    (parameterNotFoundAction Allow)."""
    unchanged = (
        f"request.operation == 'UPDATE' && has(oldObject.metadata.ownerReferences) && "
        "oldObject.metadata.ownerReferences.exists(o, has(o.controller) && o.controller && o.kind == 'Deployment'"
        f" && ({_deployment_controller('object', 'o.uid')}))"
    )
    binding_params = {"paramKind": {"apiVersion": K.API_VERSION, "kind": K.POLICY_KIND}}
    return _policy(
        RESUME_REPLICASETS_POLICY,
        labels,
        {
            **binding_params,
            "matchConstraints": _match(["apps"], ["v1"], ["CREATE", "UPDATE"], ["replicasets"]),
            "matchConditions": [
                {"name": "owned-by-a-deployment", "expression": _deployment_controller("object")},
                {"name": "owner-set-by-this-request", "expression": f"!({unchanged})"},
                {"name": "not-a-controller", "expression": f"!({CONTROLLER_USERS})"},
            ],
            "validations": [
                _deny(
                    f"!({POLICY_SELECTS_TEMPLATE_CEL}) || " + _can(K.RESTORE_VERB, K.PLURAL, group=K.GROUP),
                    "'SnapshotPolicy ' + params.metadata.name + ' protects the pods of this ReplicaSet, and a"
                    " ReplicaSet owned by a Deployment is made by the deployment controller: create or change"
                    f" the Deployment instead (giving it a Deployment owner yourself needs the {K.RESTORE_VERB}"
                    f" verb on {K.PLURAL}.{K.GROUP})'",
                ),
            ],
        },
    )


def resume_replicasets_binding(labels: dict[str, str]) -> dict[str, Any]:
    binding = _binding(RESUME_REPLICASETS_POLICY, labels)
    binding["spec"]["paramRef"] = {"selector": {}, "parameterNotFoundAction": "Allow"}
    return binding


def agent_resume_role(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": AGENT_RESUME_ROLE, "labels": dict(labels)},
        "rules": [
            # provenance labels and the resume claim (admission: nothing else of a PodSnapshot)
            {"apiGroups": [K.GROUP], "resources": [K.PLURAL], "verbs": ["patch"]},
            # a resuming pod's policy: its workload, registry Secret, insecure
            {"apiGroups": [K.GROUP], "resources": [K.POLICY_PLURAL], "verbs": ["get"]},
            # a Deployment's pods are found through their ReplicaSet's owner
            {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["get"]},
        ],
    }


def agent_resume_role_binding(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": AGENT_RESUME_ROLE, "labels": dict(labels)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_RESUME_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}],
    }


VALIDATING_POLICIES = (RESUME_PODS_POLICY, RESUME_SELECTED_POLICY, RESUME_REPLICASETS_POLICY)


def roles(labels: dict[str, str]) -> list[dict[str, Any]]:
    """The agent's resume role and its binding (applied with the other roles)."""
    return [agent_resume_role(labels), agent_resume_role_binding(labels)]


def policies(labels: dict[str, str], gate_image: str) -> list[dict[str, Any]]:
    """The resume admission policies (after the CRDs: the mutating policy's paramKind is SnapshotPolicy)."""
    validating = [resume_pods_policy(labels)]
    return [
        *validating,
        *(_binding(p["metadata"]["name"], labels) for p in validating),
        resume_selected_policy(labels),  # paramKind SnapshotPolicy: after the CRDs, like the mutation
        resume_selected_binding(labels),
        resume_replicasets_policy(labels),
        resume_replicasets_binding(labels),
        mutating_policy(labels, gate_image),
        mutating_binding(labels),
    ]
