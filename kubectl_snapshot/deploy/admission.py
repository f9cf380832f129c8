"""Who may snapshot and restore what, decided by the API server: ValidatingAdmissionPolicies.

The node agent is root on every node and acts on what tenants write (PodSnapshots, restore
annotations). So the decisions that matter are taken at admission, in-tree, with the requester's own
identity (CEL ``authorizer``), before the agent ever sees the object:

- ``kubectl-snapshot-podsnapshots`` (PodSnapshot CREATE): the destination is an explicit
  ``REGISTRY/REPOSITORY[:TAG]`` on the namespace's allow-list; ``insecure`` only to a registry the
  namespace's insecure list names; the requester can ``get`` the registrySecret it names (so the
  agent never reads a Secret for someone who cannot), can ``create`` pods in the namespace, and, for
  ``stop``, can ``delete`` that pod (the agent deletes it for them). Nobody but the agent sets the
  provenance labels and claim annotations that resume selects saves by.
- ``kubectl-snapshot-restore`` (Pod CREATE/UPDATE carrying the restore annotations): restoring needs
  the ``restore`` verb on podsnapshots in that namespace (its own permission, not implied by create
  pods), the source must be on the allow-list and pinned by digest, the requester can ``get`` the
  Secret it names; the annotations are set at creation and cannot be added or changed later.
- ``kubectl-snapshot-agent-nodes`` / ``kubectl-snapshot-agent-pods`` /
  ``kubectl-snapshot-agent-podsnapshots``: the agent's ServiceAccount writes only to its own node,
  its own node's pods and the PodSnapshots it claims for its node. Its tokens are bound to its pod,
  so they carry ``authentication.kubernetes.io/node-name`` (user extra); a token from another node,
  or one without a node, is refused. On Nodes it may change only the host-facts annotation; on pods
  only the restore-status annotation (through ``pods/status``), and delete only pods of its node
  (``stop``); on PodSnapshots only the status, whose ``node`` must be its own, of objects no other
  node has claimed (CEL cannot look up the pod, so whether the pod runs there is the agent's check).
- ``kubectl-snapshot-agent-trust``: the agent only adds its own node's signing key to the trust
  ConfigMap (``<key id>.pub`` with ``<key id>.node`` naming its token's node, both at once, at most
  ``MAX_KEYS_PER_NODE`` per node) and changes or removes nothing that is there; so it can neither
  trust a key for another node nor unbind, replace or untrust any key, nor touch the cluster's policy.

The allow-lists are annotations on the Namespace (``kubectl-snapshot.io/allowed-destinations``,
``kubectl-snapshot.io/insecure-registries``). Why there: a Namespace object is cluster-scoped, so
only cluster admins can write it (the ``admin`` role of a namespace cannot), it needs no extra
object or CRD, and CEL reads it as ``namespaceObject`` without a paramKind lookup. A ConfigMap in the
namespace would not do: tenants with ``edit`` write ConfigMaps. Whoever may ``update`` the Namespace
could change the list anyway, so the list does not bind them (cluster admins keep working without
annotating every namespace); everyone else is held to it. An absent annotation allows nothing.

Every validation answers 403 (reason Forbidden) with a message saying what to ask for; the plugin
adds a hint (adapters/kube.py).
"""

from __future__ import annotations

import json
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.provenance import TRUST_KEY_SUFFIX, TRUST_NODE_SUFFIX

API = "admissionregistration.k8s.io/v1"
SNAPSHOT_POLICY = "kubectl-snapshot-podsnapshots"
RESTORE_POLICY = "kubectl-snapshot-restore"
AGENT_NODES_POLICY = "kubectl-snapshot-agent-nodes"
AGENT_PODS_POLICY = "kubectl-snapshot-agent-pods"
AGENT_SNAPSHOTS_POLICY = "kubectl-snapshot-agent-podsnapshots"
AUTOSAVE_POLICY = "kubectl-snapshot-snapshotpolicies"
AGENT_TRUST_POLICY = "kubectl-snapshot-agent-trust"
# a re-imaged node adds a key each time; the bound keeps a stolen token from filling the ConfigMap
MAX_KEYS_PER_NODE = 16
# What the agent may change of a PodSnapshot itself (not its status): the provenance it records at claim
# time and a resuming pod's claim (docs/kubernetes.md, "Resume protocol").
AGENT_SNAPSHOT_LABELS = (
    K.LABEL_POD,
    K.LABEL_POD_UID,
    K.LABEL_WORKLOAD_KIND,
    K.LABEL_WORKLOAD_NAME,
    K.LABEL_COMPLETION_INDEX,
    K.LABEL_POLICY,
)
AGENT_SNAPSHOT_ANNOTATIONS = (K.ANN_CLAIMED_BY, K.ANN_POD_IMAGES)
# ... and which of them nobody else may set when creating one (the plugin sets only the pod label)
RESERVED_SNAPSHOT_KEYS = tuple(k for k in (*AGENT_SNAPSHOT_LABELS, *AGENT_SNAPSHOT_ANNOTATIONS) if k != K.LABEL_POD)
POLICIES = (
    SNAPSHOT_POLICY,
    RESTORE_POLICY,
    AGENT_NODES_POLICY,
    AGENT_PODS_POLICY,
    AGENT_SNAPSHOTS_POLICY,
    AUTOSAVE_POLICY,
    AGENT_TRUST_POLICY,
)

# Reference grammar (core/reference.py), in RE2 for CEL's matches(). The registry must be explicit
# (a dot, a port or localhost), lowercase, so that the allow-list compares what the agent contacts.
_LABEL = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?"
REGISTRY_RE = rf"(localhost|{_LABEL}(\.{_LABEL})+|{_LABEL}(\.{_LABEL})*:[0-9]{{1,5}}|\[[0-9a-f:.]+\](:[0-9]{{1,5}})?)"
_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
REPOSITORY_RE = rf"{REGISTRY_RE}(/{_COMPONENT})+"
DESTINATION_RE = rf"^{REPOSITORY_RE}(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?$"
SOURCE_RE = rf"^{REPOSITORY_RE}@sha256:[a-f0-9]{{64}}$"


def _quote(text: str) -> str:
    """A CEL single-quoted string literal (our constants: no quote or backslash in them)."""
    assert "'" not in text and "\\" not in text, text
    return f"'{text}'"


def _ann(obj: str, key: str) -> str:
    """The annotation's value on `obj` (``object``/``oldObject``/``namespaceObject``), '' when absent."""
    k = _quote(key)
    anns = f"{obj}.metadata.annotations"
    return f"has({anns}) && {k} in {anns} ? {anns}[{k}] : ''"


def _ns_list(key: str) -> str:
    """A comma-separated Namespace annotation as a list of trimmed, non-empty entries."""
    return f"({_ann('namespaceObject', key)}).split(',').map(e, e.trim()).filter(e, e != '')"


def _raw(text: str) -> str:
    """A CEL raw string literal (backslashes kept as they are: regular expressions)."""
    assert "'" not in text, text
    return f"r'{text}'"


def _can(verb: str, resource: str, *, group: str = "", name: str | None = None, namespaced: bool = True) -> str:
    """CEL asking the authorizer whether the requester may `verb` `resource` (in the request's namespace)."""
    expr = f"authorizer.group({_quote(group)}).resource({_quote(resource)})"
    if namespaced:
        expr += ".namespace(request.namespace)"
    if name is not None:
        expr += f".name({name})"
    return f"{expr}.check({_quote(verb)}).allowed()"


def _deny(expression: str, message_expression: str) -> dict[str, Any]:
    return {"expression": expression, "messageExpression": message_expression, "reason": "Forbidden"}


# Variables shared by the two tenant policies; `ref` and `repo` are defined by each.
_NS_VARIABLES = [
    {"name": "registry", "expression": "variables.repo.split('/')[0]"},
    {"name": "allowed", "expression": _ns_list(K.ANN_ALLOWED_DESTINATIONS)},
    {"name": "insecureRegistries", "expression": _ns_list(K.ANN_INSECURE_REGISTRIES)},
    # whoever may edit the Namespace may edit its lists: they are not bound by them
    {"name": "nsAdmin", "expression": _can("update", "namespaces", name="request.namespace", namespaced=False)},
    {
        "name": "listed",
        "expression": "variables.allowed.exists(e, variables.repo == e || variables.repo.startsWith(e + '/'))",
    },
]

_NOT_LISTED = (
    "' is not allowed in namespace ' + request.namespace + ': its annotation "
    + K.ANN_ALLOWED_DESTINATIONS
    + " lists ' + (size(variables.allowed) == 0 ? 'nothing' : variables.allowed.join(', '))"
    + " + '; ask a cluster admin to add it'"
)


def _listed(what: str, unless: str = "") -> dict[str, Any]:
    """The repository is on the namespace's allowed list (or the user may edit that list)."""
    return _deny(unless + "variables.nsAdmin || variables.listed", f"'{what} ' + variables.repo + " + _NOT_LISTED)


def _insecure_listed() -> dict[str, Any]:
    """Plain HTTP only to a registry the namespace's insecure list names (or for who may edit it)."""
    return _deny(
        "!has(object.spec.insecure) || !object.spec.insecure || variables.nsAdmin"
        " || variables.registry in variables.insecureRegistries",
        "'insecure (plain HTTP) to ' + variables.registry + ' is not allowed in namespace ' + "
        f"request.namespace + ': its annotation {K.ANN_INSECURE_REGISTRIES} lists ' + "
        "(size(variables.insecureRegistries) == 0 ? 'nothing' : variables.insecureRegistries.join(', '))",
    )


def _secret_readable(secret: str, unless: str = "") -> dict[str, Any]:
    """The agent uses a registry Secret only for a user who may read it (CEL `secret`: its name)."""
    return _deny(
        unless + _can("get", "secrets", name=secret),
        f"'you cannot get secret ' + {secret} + ' in namespace ' + request.namespace"
        " + ', so the agent will not use it for you'",
    )


def _match(groups: list[str], versions: list[str], operations: list[str], resources: list[str]) -> dict[str, Any]:
    """matchConstraints for one resource rule."""
    return {
        "resourceRules": [
            {"apiGroups": groups, "apiVersions": versions, "operations": operations, "resources": resources}
        ]
    }


def _policy(name: str, labels: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"failurePolicy": "Fail", **spec},
    }


def _binding(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }


# Autosave: the agent creates the saves of a SnapshotPolicy. Whoever created or changed the policy was
# checked then (policy_policy: create podsnapshots and restore, the Secret, the destination); at each
# save the destination and insecure are checked again against the namespace's lists (the agent is no
# namespace admin), and the requester checks (create pods, get the Secret) are the policy creator's.
# A save of the agent is a `stop` only when it is the final save of a protected pod being terminated
# (core/finalsave.py; the agent may delete the pods of its node anyway: agent_pods_policy).
_POLICY_SAVE_VARIABLES = [
    {
        "name": "policySave",
        "expression": f"request.userInfo.username == {_quote(K.AGENT_USER)}"
        f" && has(object.metadata.labels) && {_quote(K.LABEL_POLICY)} in object.metadata.labels"
        " && (!has(object.spec.stop) || !object.spec.stop"
        f" || ({_quote(K.LABEL_FINAL_SAVE)} in object.metadata.labels"
        f" && object.metadata.labels[{_quote(K.LABEL_FINAL_SAVE)}] == 'true'))",
    }
]


def _no_reserved_keys() -> str:
    """CEL: a PodSnapshot being created carries none of the keys the agent records (provenance labels,
    claim and images annotations), and its pod label, if any, names its own pod. The agent overwrites
    them when it completes a save, but resume selects saves by them, so nobody else writes them at all."""
    labels, anns = "object.metadata.labels", "object.metadata.annotations"
    reserved_labels = json.dumps([k for k in AGENT_SNAPSHOT_LABELS if k != K.LABEL_POD])
    reserved_anns = json.dumps(list(AGENT_SNAPSHOT_ANNOTATIONS))
    return (
        f"(!has({labels}) || ({labels}.all(k, !(k in {reserved_labels}))"
        f" && (!({_quote(K.LABEL_POD)} in {labels}) || {labels}[{_quote(K.LABEL_POD)}] == object.spec.podName)))"
        f" && (!has({anns}) || {anns}.all(k, !(k in {reserved_anns})))"
    )


def snapshot_policy(labels: dict[str, str]) -> dict[str, Any]:
    secret = "object.spec.registrySecret"
    return _policy(
        SNAPSHOT_POLICY,
        labels,
        {
            "matchConstraints": _match([K.GROUP], ["*"], ["CREATE"], [K.PLURAL]),
            "variables": [
                {"name": "ref", "expression": "object.spec.destination"},
                {
                    "name": "repo",
                    "expression": "variables.ref.lastIndexOf(':') > variables.ref.lastIndexOf('/')"
                    " ? variables.ref.substring(0, variables.ref.lastIndexOf(':')) : variables.ref",
                },
                *_NS_VARIABLES,
                *_POLICY_SAVE_VARIABLES,
            ],
            "validations": [
                _deny(
                    f"variables.ref.matches({_raw(DESTINATION_RE)})",
                    "'spec.destination ' + variables.ref + ' must be REGISTRY/REPOSITORY[:TAG] with an explicit,"
                    " lowercase registry host (a dot, a port or localhost)'",
                ),
                _deny(
                    "!has(object.spec.podNamespace) || object.spec.podNamespace == ''"
                    " || object.spec.podNamespace == request.namespace",
                    "'spec.podNamespace must be empty or ' + request.namespace",
                ),
                _listed("destination"),
                _insecure_listed(),
                _secret_readable(secret, unless=f"variables.policySave || !has({secret}) || {secret} == '' || "),
                _deny(
                    "variables.policySave || " + _can("create", "pods"),
                    "'snapshotting needs permission to create pods in namespace ' + request.namespace",
                ),
                _deny(
                    f"request.userInfo.username == {_quote(K.AGENT_USER)} || " + _no_reserved_keys(),
                    "'the labels and annotations "
                    + ", ".join(RESERVED_SNAPSHOT_KEYS)
                    + f" are written by the node agent only, and {K.LABEL_POD} must name spec.podName'",
                ),
                _deny(
                    "!has(object.spec.stop) || !object.spec.stop || "
                    + _can("delete", "pods", name="object.spec.podName"),
                    "'stop deletes pod ' + object.spec.podName + ': you need permission to delete it'",
                ),
            ],
        },
    )


def restore_policy(labels: dict[str, str]) -> dict[str, Any]:
    keys = f"[{_quote(K.ANN_RESTORE_FROM)}, {_quote(K.ANN_REGISTRY_SECRET)}]"
    carries = "has({o}.metadata.annotations) && " + keys + ".exists(k, k in {o}.metadata.annotations)"
    create = "request.operation != 'CREATE' || "
    return _policy(
        RESTORE_POLICY,
        labels,
        {
            "matchConstraints": _match([""], ["v1"], ["CREATE", "UPDATE"], ["pods", "pods/status"]),
            "matchConditions": [
                {
                    "name": "carries-restore-annotations",
                    "expression": f"({carries.format(o='object')})"
                    f" || (request.operation == 'UPDATE' && {carries.format(o='oldObject')})",
                }
            ],
            "variables": [
                {"name": "ref", "expression": _ann("object", K.ANN_RESTORE_FROM)},
                {"name": "secret", "expression": _ann("object", K.ANN_REGISTRY_SECRET)},
                {"name": "repo", "expression": "variables.ref.split('@')[0]"},
                *_NS_VARIABLES,
            ],
            "validations": [
                _deny(
                    "request.operation != 'UPDATE' || ("
                    f"variables.ref == ({_ann('oldObject', K.ANN_RESTORE_FROM)}) && "
                    f"variables.secret == ({_ann('oldObject', K.ANN_REGISTRY_SECRET)}))",
                    f"'the annotations {K.ANN_RESTORE_FROM} and {K.ANN_REGISTRY_SECRET} are set when a pod is"
                    " created and cannot be added or changed later'",
                ),
                _deny(
                    create + f"variables.ref == '' || variables.ref.matches({_raw(SOURCE_RE)})",
                    f"'{K.ANN_RESTORE_FROM} ' + variables.ref + ' must be REGISTRY/REPOSITORY@sha256:DIGEST"
                    " with an explicit, lowercase registry host'",
                ),
                _deny(
                    create + "variables.ref == '' || " + _can(K.RESTORE_VERB, K.PLURAL, group=K.GROUP),
                    f"'restoring into a pod needs the {K.RESTORE_VERB} verb on {K.PLURAL}.{K.GROUP} in namespace '"
                    " + request.namespace + ' (ClusterRole kubectl-snapshot-restore, aggregated to edit and admin)'",
                ),
                _listed("restore source", unless=create + "variables.ref == '' || "),
                _secret_readable("variables.secret", unless=create + "variables.secret == '' || "),
            ],
        },
    )


_AGENT_VARIABLES = [
    # request.subResource is absent (not '') on a request for the object itself
    {"name": "sub", "expression": "has(request.subResource) ? request.subResource : ''"},
    {
        "name": "nodes",
        "expression": f"has(request.userInfo.extra) && {_quote(K.NODE_NAME_EXTRA)} in request.userInfo.extra"
        f" ? request.userInfo.extra[{_quote(K.NODE_NAME_EXTRA)}] : []",
    },
    {"name": "node", "expression": "size(variables.nodes) == 1 ? variables.nodes[0] : ''"},
]
_AGENT_ONLY = [{"name": "the-agent", "expression": f"request.userInfo.username == {_quote(K.AGENT_USER)}"}]
_NOT_BOUND = (
    "'the agent writes only to its own node; this token is bound to ' "
    "+ (variables.node == '' ? 'no node' : 'node ' + variables.node)"
)


def _only_annotation_changes(*keys: str) -> str:
    """CEL: labels equal, and every annotation but `keys` kept with the same value (none added/removed)."""
    k = _quote(keys[0]) if len(keys) == 1 else "[" + ", ".join(_quote(x) for x in keys) + "]"
    is_key = "a == " + k if len(keys) == 1 else "a in " + k
    new, old = "object.metadata", "oldObject.metadata"
    return (
        f"(has({new}.labels) ? {new}.labels : {{}}) == (has({old}.labels) ? {old}.labels : {{}})"
        f" && (!has({new}.annotations) || {new}.annotations.all(a, {is_key} || "
        f"(has({old}.annotations) && a in {old}.annotations && {old}.annotations[a] == {new}.annotations[a])))"
        f" && (!has({old}.annotations) || {old}.annotations.all(a, {is_key} || "
        f"(has({new}.annotations) && a in {new}.annotations)))"
    )


def agent_nodes_policy(labels: dict[str, str]) -> dict[str, Any]:
    return _policy(
        AGENT_NODES_POLICY,
        labels,
        {
            "matchConstraints": _match([""], ["v1"], ["CREATE", "UPDATE", "DELETE"], ["nodes", "nodes/status"]),
            "matchConditions": _AGENT_ONLY,
            "variables": _AGENT_VARIABLES,
            "validations": [
                _deny(
                    "request.operation == 'UPDATE' && variables.node != '' && request.name == variables.node",
                    _NOT_BOUND + " + ', not ' + request.operation + ' node ' + request.name",
                ),
                _deny(
                    "request.operation != 'UPDATE' || (object.spec == oldObject.spec && "
                    + _only_annotation_changes(K.ANN_NODE_FACTS)
                    + ")",
                    f"'the agent may change only the {K.ANN_NODE_FACTS} annotation of its node'",
                ),
            ],
        },
    )


def agent_pods_policy(labels: dict[str, str]) -> dict[str, Any]:
    update = "request.operation != 'UPDATE' || "
    return _policy(
        AGENT_PODS_POLICY,
        labels,
        {
            "matchConstraints": _match([""], ["v1"], ["CREATE", "UPDATE", "DELETE"], ["pods", "pods/status"]),
            "matchConditions": _AGENT_ONLY,
            "variables": _AGENT_VARIABLES,
            "validations": [
                _deny(
                    "request.operation != 'CREATE' && variables.node != ''"
                    " && has(oldObject.spec.nodeName) && oldObject.spec.nodeName == variables.node",
                    _NOT_BOUND + " + ', not to pod ' + request.namespace + '/' + request.name"
                    " + (request.operation == 'CREATE' || !has(oldObject.spec.nodeName) ? ''"
                    " : ' on node ' + oldObject.spec.nodeName)",
                ),
                _deny(
                    update
                    + "(variables.sub == 'status' && "
                    + _only_annotation_changes(K.ANN_RESTORE_STATUS, K.ANN_LAST_SAVE)
                    + ")",
                    f"'the agent may change only the {K.ANN_RESTORE_STATUS} and {K.ANN_LAST_SAVE} annotations of a"
                    " pod (through pods/status)'",
                ),
            ],
        },
    )


def autosave_policy(labels: dict[str, str]) -> dict[str, Any]:
    """SnapshotPolicy CREATE/UPDATE: the agent saves (and new pods of the workload resume) in the name of
    whoever wrote the policy, so that person must hold what a save and a restore need right now: create
    and restore on podsnapshots in the namespace, get on the Secret it names, and a destination (and
    insecure) the namespace's lists allow, exactly as for a PodSnapshot."""
    secret = "object.spec.registrySecret"
    need = f"{K.PLURAL}.{K.GROUP}"
    return _policy(
        AUTOSAVE_POLICY,
        labels,
        {
            "matchConstraints": _match([K.GROUP], ["*"], ["CREATE", "UPDATE"], [K.POLICY_PLURAL]),
            "variables": [
                {"name": "ref", "expression": "object.spec.destination"},
                {"name": "repo", "expression": "variables.ref"},
                *_NS_VARIABLES,
            ],
            "validations": [
                _deny(
                    _can("create", K.PLURAL, group=K.GROUP) + " && " + _can(K.RESTORE_VERB, K.PLURAL, group=K.GROUP),
                    f"'a SnapshotPolicy saves and restores pods in your name: it needs both create and the "
                    f"{K.RESTORE_VERB} verb on {need} in namespace ' + request.namespace + ' (ClusterRoles "
                    "kubectl-snapshot-edit and kubectl-snapshot-restore, aggregated to edit and admin)'",
                ),
                _deny(
                    f"variables.ref.matches({_raw('^' + REPOSITORY_RE + '$')})",
                    "'spec.destination ' + variables.ref + ' must be REGISTRY/REPOSITORY (no tag: each save gets"
                    " its own) with an explicit, lowercase registry host (a dot, a port or localhost)'",
                ),
                _listed("destination"),
                _insecure_listed(),
                _secret_readable(secret, unless=f"!has({secret}) || {secret} == '' || "),
            ],
        },
    )


def _status_node(obj: str) -> str:
    """CEL: `obj`'s status.node, '' when unset (or on a CREATE/DELETE, where one side is null)."""
    return f"request.operation == 'UPDATE' && has({obj}.status) && has({obj}.status.node) ? {obj}.status.node : ''"


def _only_keys_change(field: str, keys: tuple[str, ...]) -> str:
    """CEL: every entry of metadata.`field` except `keys` is kept with the same value, none added or removed."""
    allowed = json.dumps(list(keys))
    new, old = f"object.metadata.{field}", f"oldObject.metadata.{field}"
    return (
        f"(!has({new}) || {new}.all(k, k in {allowed} || (has({old}) && k in {old} && {old}[k] == {new}[k])))"
        f" && (!has({old}) || {old}.all(k, k in {allowed} || (has({new}) && k in {new})))"
    )


def _has_label(obj: str, key: str) -> str:
    """CEL: `obj` (which may be null: CREATE has no oldObject, DELETE no object) carries label `key`."""
    return f"{obj} != null && has({obj}.metadata.labels) && {_quote(key)} in {obj}.metadata.labels"


def agent_snapshots_policy(labels: dict[str, str]) -> dict[str, Any]:
    """The agent writes a PodSnapshot's status only as the node it claims it for (status.node): an
    unclaimed object, or one its own node claimed; the status it leaves names its own node. It creates
    and deletes only the saves of SnapshotPolicies (autosave and retention)."""
    return _policy(
        AGENT_SNAPSHOTS_POLICY,
        labels,
        {
            "matchConstraints": _match(
                [K.GROUP], [K.VERSION], ["CREATE", "UPDATE", "DELETE"], [K.PLURAL, f"{K.PLURAL}/status"]
            ),
            "matchConditions": _AGENT_ONLY,
            "variables": [
                *_AGENT_VARIABLES,
                {"name": "claimedBy", "expression": _status_node("oldObject")},
                {"name": "claims", "expression": _status_node("object")},
                {"name": "policySave", "expression": _has_label("object", K.LABEL_POLICY)},
                {"name": "policySaveOld", "expression": _has_label("oldObject", K.LABEL_POLICY)},
            ],
            "validations": [
                _deny(
                    "request.operation != 'CREATE' || variables.policySave",
                    "'the agent creates only the saves of a SnapshotPolicy (label " + K.LABEL_POLICY + "), not '"
                    " + request.namespace + '/' + request.name",
                ),
                _deny(
                    "request.operation != 'DELETE' || variables.policySaveOld",
                    "'the agent deletes only the saves of a SnapshotPolicy (retention), not '"
                    " + request.namespace + '/' + request.name",
                ),
                _deny(
                    "request.operation != 'UPDATE' || variables.sub == 'status' || "
                    "(object.spec == oldObject.spec && "
                    + _only_keys_change("labels", AGENT_SNAPSHOT_LABELS)
                    + " && "
                    + _only_keys_change("annotations", AGENT_SNAPSHOT_ANNOTATIONS)
                    + ")",
                    "'the agent may change only the status, the provenance labels and the "
                    f"{K.ANN_CLAIMED_BY}/{K.ANN_POD_IMAGES} annotations of a PodSnapshot, not more of ' "
                    "+ request.namespace + '/' + request.name",
                ),
                _deny(
                    "request.operation != 'UPDATE' || variables.sub != 'status' || "
                    "variables.node != '' && variables.claims == variables.node"
                    " && (variables.claimedBy == '' || variables.claimedBy == variables.node)",
                    _NOT_BOUND + " + ', not to PodSnapshot ' + request.namespace + '/' + request.name"
                    " + (variables.claimedBy != '' && variables.claimedBy != variables.node"
                    " ? ' claimed by node ' + variables.claimedBy : '')"
                    " + (variables.claims != variables.node"
                    " ? ' (its status.node would be ' + (variables.claims == '' ? 'unset' : variables.claims) + ')'"
                    " : '')",
                ),
            ],
        },
    )


def agent_trust_policy(labels: dict[str, str]) -> dict[str, Any]:
    """The agent adds its node's signing key to the trust ConfigMap and nothing else (shim/controller/signing.py).

    CEL cannot hash a PEM, so the key id in an entry's name is not checked here: the trust loader
    (adapters/signatures.trust_from_data) ignores a `.pub` whose name is not its key's id, and one that
    does not parse if it is bound to a node. What is checked: every entry there stays as it is (so no
    key is unbound, rebound, replaced or removed, and `cluster-id` and `allow-unverified-snapshots` stay);
    entries are added in pairs `<16 hex>.pub` + `<16 hex>.node`; each `.node` names the token's node."""
    pub, node = TRUST_KEY_SUFFIX, TRUST_NODE_SUFFIX
    entry_re = r"^[0-9a-f]{16}[.](pub|node)$"
    return _policy(
        AGENT_TRUST_POLICY,
        labels,
        {
            "matchConstraints": _match([""], ["v1"], ["CREATE", "UPDATE", "DELETE"], ["configmaps"]),
            "matchConditions": [
                *_AGENT_ONLY,
                {
                    "name": "the-trust-configmap",
                    "expression": f"request.namespace == {_quote(K.AGENT_NAMESPACE)}"
                    f" && request.name == {_quote(K.TRUST_CONFIG_MAP)}",
                },
            ],
            "variables": [
                *_AGENT_VARIABLES,
                {"name": "old", "expression": "oldObject != null && has(oldObject.data) ? oldObject.data : {}"},
                {"name": "new", "expression": "object != null && has(object.data) ? object.data : {}"},
                {"name": "added", "expression": "variables.new.filter(k, !(k in variables.old))"},
                {
                    "name": "changed",
                    "expression": "variables.old.filter(k, !(k in variables.new)"
                    " || variables.new[k] != variables.old[k])",
                },
            ],
            "validations": [
                _deny(
                    "request.operation == 'UPDATE'",
                    "'the agent adds keys of its node to the trust ConfigMap; it does not '"
                    " + request.operation + ' it'",
                ),
                _deny(
                    "request.operation != 'UPDATE' || variables.node != ''",
                    _NOT_BOUND + " + ', so it may not add a key to the trust ConfigMap'",
                ),
                _deny(
                    "request.operation != 'UPDATE' || size(variables.changed) == 0"
                    " && (has(object.binaryData) ? object.binaryData : {})"
                    " == (has(oldObject.binaryData) ? oldObject.binaryData : {})"
                    " && (has(object.immutable) ? object.immutable : false)"
                    " == (has(oldObject.immutable) ? oldObject.immutable : false)"
                    " && (has(object.metadata.labels) ? object.metadata.labels : {})"
                    " == (has(oldObject.metadata.labels) ? oldObject.metadata.labels : {})"
                    " && (has(object.metadata.annotations) ? object.metadata.annotations : {})"
                    " == (has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {})",
                    "'the agent only adds keys of its node to the trust ConfigMap; it may not change or remove '"
                    " + (size(variables.changed) == 0 ? 'anything else' : variables.changed.join(', '))",
                ),
                _deny(
                    f"request.operation != 'UPDATE' || variables.added.all(k, k.matches({_raw(entry_re)})"
                    f" && (k.substring(0, 16) + {_quote(pub)}) in variables.added"
                    f" && (k.substring(0, 16) + {_quote(node)}) in variables.added)",
                    "'the agent adds a key to the trust ConfigMap as two entries, <key id>.pub and <key id>.node,"
                    " not ' + variables.added.join(', ')",
                ),
                _deny(
                    "request.operation != 'UPDATE' || variables.added.all(k, "
                    f"!k.endsWith({_quote(node)}) || variables.new[k] == variables.node)",
                    "'the agent registers keys of its own node only (its token is bound to node ' + variables.node"
                    f" + '), not of node ' + variables.added.filter(k, k.endsWith({_quote(node)})"
                    " && variables.new[k] != variables.node).map(k, variables.new[k]).join(', ')",
                ),
                _deny(
                    f"size(variables.added) == 0 || size(variables.new.filter(k, k.endsWith({_quote(node)})"
                    f" && variables.new[k] == variables.node)) <= {MAX_KEYS_PER_NODE}",
                    f"'node ' + variables.node + ' has more than {MAX_KEYS_PER_NODE} signing keys in the trust"
                    " ConfigMap; an administrator removes the entries of its old keys'",
                ),
            ],
        },
    )


def render(labels: dict[str, str]) -> list[dict[str, Any]]:
    """The policies and their bindings (apply after the CRD: the podsnapshot policies name its group)."""
    policies = [
        snapshot_policy(labels),
        restore_policy(labels),
        agent_nodes_policy(labels),
        agent_pods_policy(labels),
        agent_snapshots_policy(labels),
    ]
    policies.append(autosave_policy(labels))
    policies.append(agent_trust_policy(labels))
    return [*policies, *(_binding(p["metadata"]["name"], labels) for p in policies)]
