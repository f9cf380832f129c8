"""Kubernetes names shared by the plugin and the agent (docs/kubernetes.md is the contract)."""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the runtime wrapper's start-up
if TYPE_CHECKING:
    from typing import Final

GROUP: Final = "kubectl-snapshot.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "PodSnapshot"
PLURAL: Final = "podsnapshots"
SINGULAR: Final = "podsnapshot"
SHORT_NAME: Final = "psnap"

# PodSnapshot status.phase
PHASE_PENDING: Final = "Pending"
PHASE_RUNNING: Final = "Running"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
TERMINAL_PHASES: Final = (PHASE_SUCCEEDED, PHASE_FAILED)
# The CRD's selectable field agents watch by: the node whose agent claimed a PodSnapshot ("" = nobody yet).
SNAPSHOT_NODE_FIELD: Final = "status.node"

# SnapshotPolicy (autosave): saves of the selected pods every interval, retention, resume (docs/kubernetes.md)
POLICY_KIND: Final = "SnapshotPolicy"
POLICY_PLURAL: Final = "snapshotpolicies"
POLICY_SINGULAR: Final = "snapshotpolicy"
POLICY_SHORT_NAME: Final = "spol"
POLICY_MIN_INTERVAL_S: Final = 10
# The workload kinds a policy may name (spec.workload.kind); "Pod" is a bare pod.
WORKLOAD_KINDS: Final = ("StatefulSet", "Deployment", "ReplicaSet", "Job", "Pod")
# Labels on every PodSnapshot, written by the agent from the pod it snapshots (a tenant's own labels
# with these keys are overwritten at claim time): which pod, which workload, which policy made it.
LABEL_POD_UID: Final = f"{GROUP}/pod-uid"
LABEL_POLICY: Final = f"{GROUP}/policy"  # only on saves a SnapshotPolicy made
LABEL_WORKLOAD_KIND: Final = f"{GROUP}/workload-kind"  # StatefulSet | Deployment | ReplicaSet | Job | Pod
LABEL_WORKLOAD_NAME: Final = f"{GROUP}/workload-name"
LABEL_COMPLETION_INDEX: Final = f"{GROUP}/completion-index"  # indexed Jobs: the pod's completion index
# On a PodSnapshot the agent took, with stop, when its protected pod was being terminated (core/finalsave.py).
LABEL_FINAL_SAVE: Final = f"{GROUP}/final-save"
# On a PodSnapshot: the uid of the pod that resumed from it (claimed atomically, resourceVersion-checked).
ANN_CLAIMED_BY: Final = f"{GROUP}/claimed-by"
# On a pod: the SnapshotPolicy under which it resumes from its predecessor's last save (set at admission).
ANN_RESUME_POLICY: Final = f"{GROUP}/resume-policy"
# On a pod: RFC 3339 time of its last good save (schedulers and preemption may prefer fresh saves).
ANN_LAST_SAVE: Final = f"{GROUP}/last-save"
# On a PodSnapshot, written by the agent at claim time from the real pod: JSON list of
# {"name", "image" (as the pod spec says), "imageID" (the digest the kubelet ran)} per app container;
# a resuming pod whose images differ starts fresh instead (docs/kubernetes.md, "Resume protocol").
ANN_POD_IMAGES: Final = f"{GROUP}/pod-images"
# restore-status of a resuming pod that starts fresh (no save, images differ): "Skipped: <reason>"
RESTORE_SKIPPED_PREFIX: Final = "Skipped: "

# restore
RUNTIME_CLASS: Final = "kubectl-snapshot"
ANN_RESTORE_FROM: Final = f"{GROUP}/restore-from"  # REGISTRY/REPO@sha256:...
ANN_RESTORE_STATUS: Final = f"{GROUP}/restore-status"  # Staged | Failed: <reason>
ANN_REGISTRY_SECRET: Final = f"{GROUP}/registry-secret"
# "lazy": the pod's processes come back before their memory does, pages served from the registry as they
# are touched (docs/lazy-restore.md); absent or "eager": every page is staged before the restore
ANN_RESTORE_MODE: Final = f"{GROUP}/restore-mode"
RESTORE_MODE_LAZY: Final = "lazy"
RESTORE_MODE_EAGER: Final = "eager"
RESTORE_MODES: Final = (RESTORE_MODE_EAGER, RESTORE_MODE_LAZY)  # a SnapshotPolicy's spec.restoreMode
LABEL_RESTORED_FROM: Final = f"{GROUP}/restored-from"
LABEL_POD: Final = f"{GROUP}/pod"  # on a PodSnapshot: its pod's name (`kubectl snapshot list -l ...`)
# Who may restore: a verb of its own on podsnapshots, checked at admission (deploy/admission.py).
RESTORE_VERB: Final = "restore"
# On Namespaces, written by cluster admins (tenants cannot edit their Namespace object):
# comma-separated REGISTRY[/REPOSITORY-PREFIX] entries snapshots may be pushed to and restored from,
# and the registries (host[:port]) that may be reached with `insecure` (plain HTTP).
ANN_ALLOWED_DESTINATIONS: Final = f"{GROUP}/allowed-destinations"
ANN_INSECURE_REGISTRIES: Final = f"{GROUP}/insecure-registries"
GATE_VOLUME: Final = "kubectl-snapshot-gate"
GATE_CONTAINER: Final = "kubectl-snapshot-gate"
GATE_MOUNT: Final = "/gate"
GATE_STAGED_FILE: Final = "staged"
GATE_FAILED_FILE: Final = "failed"
RESTORE_STAGED: Final = "Staged"
RESTORE_FAILED_PREFIX: Final = "Failed: "
DROPPED_LABELS: Final = ("pod-template-hash", "controller-revision-hash")
SA_TOKEN_VOLUME_PREFIX: Final = "kube-api-access-"

# provenance (docs/security.md): what the cluster trusts (the nodes' keys among it), namespace grants
GRANT_KIND: Final = "SnapshotGrant"
GRANT_PLURAL: Final = "snapshotgrants"
GRANT_SINGULAR: Final = "snapshotgrant"
# in AGENT_NAMESPACE; signing.key (PEM): the cluster-wide key agents signed with before they had their own
# (its public key stays trusted, for the snapshots it signed); nothing mounts or makes it any more
SIGNING_KEY_SECRET: Final = "kubectl-snapshot-signing-key"
KEY_SECRET: Final = "kubectl-snapshot-keys"  # in AGENT_NAMESPACE; the namespace keys (adapters/keystore.py)
TRUST_CONFIG_MAP: Final = "kubectl-snapshot-trust"  # in AGENT_NAMESPACE; *.pub, *.node, cluster-id, policy
TRUST_DIR: Final = "/etc/kubectl-snapshot/trust"  # where the agent mounts the ConfigMap

# the agent
AGENT_NAMESPACE: Final = "kubectl-snapshot-system"
AGENT_NAME: Final = "kubectl-snapshot-agent"
AGENT_LABEL: Final = {"app.kubernetes.io/name": AGENT_NAME}
AGENT_USER: Final = f"system:serviceaccount:{AGENT_NAMESPACE}:{AGENT_NAME}"
# The namespace-key broker (install's default, on host-network when asked; shim/service/keybroker.py): its
# name (Deployment, Service, ServiceAccount, roles), port, TLS Secret (made by install), the agents' copy
# of its certificate.
KEY_BROKER_NAME: Final = "kubectl-snapshot-key-broker"
KEY_BROKER_PORT: Final = 9643
KEY_BROKER_TLS_SECRET: Final = "kubectl-snapshot-key-broker-tls"
KEY_BROKER_CA_CONFIG_MAP: Final = "kubectl-snapshot-key-broker-ca"
KEY_BROKER_TLS_DIR: Final = "/etc/kubectl-snapshot/key-broker-tls"  # in the broker: tls.crt, tls.key
KEY_BROKER_CA_DIR: Final = "/etc/kubectl-snapshot/key-broker"  # in the agent: ca.crt
KEY_BROKER_TOKEN_DIR: Final = "/var/run/secrets/kubectl-snapshot/keys"  # in the agent: token (audience below)
KEY_BROKER_AUDIENCE: Final = "kubectl-snapshot-keys"
ENV_KEY_BROKER: Final = "KUBECTL_SNAPSHOT_KEY_BROKER"  # the agent's broker URL; unset: it reads the key Secret
# Bound into a namespace (RoleBinding) by its admin where snapshots use registry Secrets.
AGENT_SECRETS_ROLE: Final = "kubectl-snapshot-agent-registry-secrets"
# What a pod-bound ServiceAccount token says about the node its pod runs on (user extra).
NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"
ANN_NODE_FACTS: Final = f"{GROUP}/node-facts"  # JSON the agent publishes on its Node (doctor reads it)
READY_FILE: Final = "/tmp/kubectl-snapshot-agent.ready"
EMPTY_DIR_PLUGIN_DIR: Final = "kubernetes.io~empty-dir"
CONTAINERD_K8S_NAMESPACE: Final = "k8s.io"

# Events on the pod
EVENT_SNAPSHOT_STARTED: Final = "SnapshotStarted"
EVENT_SNAPSHOT_SUCCEEDED: Final = "SnapshotSucceeded"
EVENT_SNAPSHOT_FAILED: Final = "SnapshotFailed"
EVENT_SOURCE_POD_REPLACED: Final = "SourcePodReplaced"  # the PodSnapshot's pod (spec.podUID) was replaced
EVENT_RESTORE_STAGED: Final = "RestoreStaged"
# Warning beside RestoreStaged: the restored processes may hold the old pod's bound token (core/tokenclone.py)
EVENT_CLONED_TOKEN: Final = "ClonedServiceAccountToken"
EVENT_RESTORE_FAILED: Final = "RestoreFailed"
# a lazy restore: every page in (Normal), or a page that could not be fetched ended the container (Warning)
EVENT_LAZY_RESTORE_COMPLETE: Final = "LazyRestoreComplete"
EVENT_LAZY_RESTORE_FAILED: Final = "LazyRestoreFailed"
EVENT_RESTORE_REFUSED: Final = "RestoreRefused"  # the runtime wrapper refused the images: they grant more than the pod
EVENT_RESUME_SKIPPED: Final = "ResumeSkipped"  # a resuming pod starts fresh, and why
EVENT_FINAL_SAVE: Final = "FinalSave"  # a terminating protected pod is saved before SIGTERM
EVENT_FINAL_SAVE_FAILED: Final = "FinalSaveFailed"  # ... not in time (or not at all): the last periodic save stands
