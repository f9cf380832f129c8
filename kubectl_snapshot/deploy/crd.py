"""The PodSnapshot CustomResourceDefinition (docs/kubernetes.md is the contract).

Why a structural schema with every field spelled out: the API server then prunes unknown fields,
rejects typos (``podname:``) at create time instead of leaving a PodSnapshot that no agent acts on,
and ``kubectl explain podsnapshot.spec`` documents the resource. The spec is immutable (a CEL rule):
an agent that already froze the pod must not see its destination change under it.
"""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import status as S

CRD_NAME = f"{K.PLURAL}.{K.GROUP}"

_STRING: dict[str, Any] = {"type": "string"}
_TIME: dict[str, Any] = {"type": "string", "format": "date-time"}
_BYTES: dict[str, Any] = {"type": "integer", "format": "int64", "minimum": 0}
_MS: dict[str, Any] = {"type": "number", "minimum": 0}


def _spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "What to snapshot and where to push it. Immutable once created.",
        "required": ["podName", "destination"],
        "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "spec is immutable"}],
        "properties": {
            "podName": {
                "type": "string",
                "minLength": 1,
                "maxLength": 253,
                "description": "A pod in this PodSnapshot's namespace.",
            },
            "podNamespace": {
                "type": "string",
                "maxLength": 63,
                "description": "Optional; must equal metadata.namespace (the agent refuses otherwise).",
            },
            "podUID": {
                "type": "string",
                "maxLength": 128,
                "description": "Optional; the uid of the pod the snapshot was requested for (set by the plugin). "
                "The agent refuses a pod of that name with another uid (SourcePodReplaced).",
            },
            "destination": {
                "type": "string",
                "minLength": 1,
                "maxLength": 1024,
                "description": "REGISTRY/REPO[:TAG] to push the snapshot to.",
            },
            "registrySecret": {
                "type": "string",
                "maxLength": 253,
                "description": "A kubernetes.io/dockerconfigjson Secret in this namespace with push credentials.",
            },
            "insecure": {
                "type": "boolean",
                "default": False,
                "description": "Plain HTTP to a non-loopback registry.",
            },
            "stop": {
                "type": "boolean",
                "default": False,
                "description": "Stop the pod's containers once the snapshot is pushed.",
            },
            "includeVolumes": {
                "type": "boolean",
                "default": True,
                "description": "Capture the pod's emptyDir volumes.",
            },
            "ignoreLiveness": {
                "type": "boolean",
                "default": False,
                "description": "Snapshot even if the pod would stay frozen longer than a liveness probe allows "
                "(the kubelet may then restart a container).",
            },
        },
    }


def _status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": _STRING,
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": _STRING,
            "message": _STRING,
            "lastTransitionTime": _TIME,
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
    }
    return {
        "type": "object",
        "description": "Written by the node agent that took the snapshot.",
        "properties": {
            "phase": {"type": "string", "enum": [K.PHASE_PENDING, K.PHASE_RUNNING, K.PHASE_SUCCEEDED, K.PHASE_FAILED]},
            "node": _STRING,
            "stage": {"type": "string", "enum": list(S.STAGES), "description": "Where the snapshot is."},
            "bytesDone": _BYTES,
            "bytesTotal": _BYTES,
            "timings": {"type": "object", "properties": {k: _MS for k in S.TIMING_KEYS}},
            "expectedFreezeSeconds": {
                "type": "number",
                "description": "How long the pod was expected to stay frozen (its memory at a slow dump rate).",
            },
            "freezeDeadlineSeconds": {
                "type": "number",
                "description": "The freeze guard thaws the pod and fails the snapshot if it is still frozen then.",
            },
            "frozenBy": {
                "type": "string",
                "description": "How the containers were paused: cgroup freezer (written by the agent) or containerd.",
            },
            "reference": {"type": "string", "description": "REGISTRY/REPO@sha256:... of the pushed snapshot."},
            "tag": _STRING,
            "size": _BYTES,
            "sizeHuman": {"type": "string", "description": "size for people, e.g. 40.0 KiB."},
            "reason": {"type": "string", "description": "Why it ended, CamelCase (e.g. Pushed, NotFound, CriuFailed)."},
            "message": {"type": "string", "description": "What happened (on failure: what failed and why)."},
            "hint": {"type": "string", "description": "On failure: what to do about it."},
            "details": {"type": "string", "description": "On failure: more detail, e.g. the tail of CRIU's log."},
            "observedGeneration": {"type": "integer", "format": "int64"},
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "startTime": _TIME,
            "completionTime": _TIME,
        },
    }


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Pod", "type": "string", "jsonPath": ".spec.podName"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Node", "type": "string", "jsonPath": ".status.node"},
        {"name": "Size", "type": "string", "jsonPath": ".status.sizeHuman"},
        {"name": "Reference", "type": "string", "jsonPath": ".status.reference"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Stage", "type": "string", "jsonPath": ".status.stage", "priority": 1},
        {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
    ]


def _crd(
    name: str,
    labels: dict[str, str],
    names: dict[str, Any],
    version: dict[str, Any],
    description: str,
    properties: dict[str, Any],
) -> dict[str, Any]:
    """A namespaced apiextensions.k8s.io/v1 CRD of the project's group with one served, stored version:
    `version` holds that version's extras (subresources, selectable fields, printer columns)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "group": K.GROUP,
            "scope": "Namespaced",
            "names": names,
            "versions": [
                {
                    "name": K.VERSION,
                    "served": True,
                    "storage": True,
                    **version,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": description,
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": _STRING,
                                "kind": _STRING,
                                "metadata": {"type": "object"},
                                **properties,
                            },
                        }
                    },
                }
            ],
        },
    }


def _names(kind: str, plural: str, singular: str, short: str | None = None) -> dict[str, Any]:
    names: dict[str, Any] = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": singular}
    if short:
        names["shortNames"] = [short]
    names["categories"] = ["kubectl-snapshot"]
    return names


def podsnapshot_crd(labels: dict[str, str]) -> dict[str, Any]:
    """The CRD object, apiextensions.k8s.io/v1."""
    return _crd(
        CRD_NAME,
        labels,
        _names(K.KIND, K.PLURAL, K.SINGULAR, K.SHORT_NAME),
        {
            "subresources": {"status": {}},
            # Agents watch only what concerns their node: field selectors on status.node.
            "selectableFields": [{"jsonPath": f".{K.SNAPSHOT_NODE_FIELD}"}],
            "additionalPrinterColumns": _printer_columns(),
        },
        "A request to snapshot a running pod into an OCI artifact.",
        {"spec": _spec_schema(), "status": _status_schema()},
    )


GRANT_CRD_NAME = f"{K.GRANT_PLURAL}.{K.GROUP}"


def snapshotgrant_crd(labels: dict[str, str]) -> dict[str, Any]:
    """SnapshotGrant: in a source namespace, lets its snapshots be restored into other namespaces.

    Namespaced, so only those allowed to write it in the source namespace (the aggregated `admin`
    role) can give that namespace's snapshots away; the agent reads it before staging a restore
    whose target namespace is not the snapshot's own (docs/security.md, Provenance)."""
    spec_schema = {
        "type": "object",
        "required": ["targetNamespaces"],
        "properties": {
            "targetNamespaces": {
                "type": "array",
                "description": "Namespaces this namespace's snapshots may be restored into.",
                "items": {"type": "string", "maxLength": 63},
                "maxItems": 256,
            },
            "repositories": {
                "type": "array",
                "description": "Only snapshots from these REGISTRY/REPO (prefixes); empty: any.",
                "items": {"type": "string", "maxLength": 512},
                "maxItems": 64,
            },
        },
    }
    return _crd(
        GRANT_CRD_NAME,
        labels,
        _names(K.GRANT_KIND, K.GRANT_PLURAL, K.GRANT_SINGULAR),
        {"additionalPrinterColumns": [{"name": "Targets", "type": "string", "jsonPath": ".spec.targetNamespaces"}]},
        "Lets this namespace's snapshots be restored into other namespaces.",
        {"spec": spec_schema},
    )


POLICY_CRD_NAME = f"{K.POLICY_PLURAL}.{K.GROUP}"
_DURATION: dict[str, Any] = {
    "type": "string",
    "maxLength": 32,
    "pattern": r"^([0-9]+(h|m|s))+$",
}


def _policy_spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Which pods to save, how often, where, how many saves to keep, and whether new pods of "
        "the workload resume from them.",
        "required": ["selector", "interval", "destination"],
        "properties": {
            "selector": {
                "type": "object",
                "description": "Pods in this namespace whose labels include all of matchLabels.",
                "required": ["matchLabels"],
                "properties": {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 32,
                        "additionalProperties": {"type": "string", "maxLength": 63},
                    }
                },
            },
            "workload": {
                "type": "object",
                "description": "Optional: only pods owned by this workload (a Deployment's pods through its "
                "ReplicaSets).",
                "required": ["kind", "name"],
                "properties": {
                    "kind": {"type": "string", "enum": list(K.WORKLOAD_KINDS)},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                },
            },
            "interval": {
                **_DURATION,
                "description": f"How often each selected pod is saved (Go-style duration: 30s, 5m, 1h30m; at "
                f"least {K.POLICY_MIN_INTERVAL_S}s).",
                "x-kubernetes-validations": [
                    {
                        "rule": f"duration(self) >= duration('{K.POLICY_MIN_INTERVAL_S}s')",
                        "message": f"interval must be at least {K.POLICY_MIN_INTERVAL_S}s",
                    }
                ],
            },
            "destination": {
                "type": "string",
                "minLength": 1,
                "maxLength": 1024,
                "description": "REGISTRY/REPO the saves are pushed to (tags are made per save).",
            },
            "registrySecret": {
                "type": "string",
                "maxLength": 253,
                "description": "A kubernetes.io/dockerconfigjson Secret in this namespace with push and pull "
                "credentials.",
            },
            "insecure": {"type": "boolean", "default": False, "description": "Plain HTTP to the registry."},
            "includeVolumes": {"type": "boolean", "default": True, "description": "Save emptyDir volumes."},
            "retention": {
                "type": "object",
                "description": "Saves beyond these (per pod) are deleted with their registry manifests.",
                "properties": {
                    "keepLast": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": 1000,
                        "default": 3,
                        "description": "Keep the last N good saves of each pod.",
                    },
                    "maxAge": {**_DURATION, "description": "Also delete saves older than this (except the last)."},
                },
            },
            "resume": {
                "type": "boolean",
                "default": True,
                "description": "New pods of the workload resume from their predecessor's last good save.",
            },
            "restoreMode": {
                "type": "string",
                "enum": list(K.RESTORE_MODES),
                "default": K.RESTORE_MODE_EAGER,
                "description": "How a resuming pod's memory comes back. eager: all of it before the pod runs. "
                "lazy: the pod runs first, pages fetched from the registry as they are touched; a page that "
                "cannot be fetched then kills the container (a LazyRestoreFailed Event), which starts afresh "
                "without the resumed state. Workloads that must not be killed mid-run stay eager.",
            },
            "suspend": {"type": "boolean", "default": False, "description": "Pause the schedule."},
        },
    }


def _policy_status_schema() -> dict[str, Any]:
    pod = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": _STRING,
            "uid": _STRING,
            "node": _STRING,
            "lastSaveTime": _TIME,
            "lastSnapshot": {"type": "string", "description": "The PodSnapshot of the last good save."},
            "lastReference": _STRING,
            "lastSize": _BYTES,
            "lastResult": {"type": "string", "enum": [K.PHASE_SUCCEEDED, K.PHASE_FAILED]},
            "lastMessage": _STRING,
            "consecutiveFailures": {"type": "integer", "minimum": 0},
            "nextSaveTime": _TIME,
        },
    }
    return {
        "type": "object",
        # Nullable: when the last agent that owned entries applies none, server-side apply leaves the
        # status with no field, which the API server writes as null; without this the apply is refused
        # ("status: Invalid value: null") and the entries of pods gone from the node stay forever.
        "nullable": True,
        "description": "Written by the agents (each its own pods' entries, by server-side apply).",
        "properties": {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "pods": {
                "type": "array",
                "items": pod,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
            "conditions": _status_schema()["properties"]["conditions"],
        },
    }


def snapshotpolicy_crd(labels: dict[str, str]) -> dict[str, Any]:
    """SnapshotPolicy: autosave of the selected pods, with retention and resume (docs/kubernetes.md)."""
    columns = [
        {"name": "Interval", "type": "string", "jsonPath": ".spec.interval"},
        {"name": "Keep", "type": "integer", "jsonPath": ".spec.retention.keepLast"},
        {"name": "Destination", "type": "string", "jsonPath": ".spec.destination"},
        {"name": "Suspend", "type": "boolean", "jsonPath": ".spec.suspend"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Selector", "type": "string", "jsonPath": ".spec.selector.matchLabels", "priority": 1},
        {"name": "RestoreMode", "type": "string", "jsonPath": ".spec.restoreMode", "priority": 1},
    ]
    return _crd(
        POLICY_CRD_NAME,
        labels,
        _names(K.POLICY_KIND, K.POLICY_PLURAL, K.POLICY_SINGULAR, K.POLICY_SHORT_NAME),
        {"subresources": {"status": {}}, "additionalPrinterColumns": columns},
        "Saves the selected pods every interval; keeps the last N per pod; "
        "new pods of the workload resume from the last good save.",
        {"spec": _policy_spec_schema(), "status": _policy_status_schema()},
    )
