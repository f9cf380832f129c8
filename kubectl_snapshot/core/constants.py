"""Every media type, annotation key and archive member name the project writes or reads.

Chosen once (format v1, docs/format.md); change them only with a new format version.
Upstream vocabulary is reused where it exists: checkpointctl's archive names and its
``org.criu.checkpoint.*`` annotation keys.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import Final

# v2 = v1 + memory pages as content-addressed chunks; v3 = v2 + a cosign signature beside it and no
# process.env in the recorded runtime specs; v4 = v3 + page deltas (a chunk = a base chunk + the pages
# that changed since; docs/format.md). Writers write FORMAT_VERSION, or DELTA_FORMAT_VERSION when a
# chunk has a delta (so that a reader that does not know deltas refuses instead of restoring the base).
FORMAT_VERSION: Final = 3
DELTA_FORMAT_VERSION: Final = 4
SUPPORTED_FORMAT_VERSIONS: Final = (1, 2, 3, 4)  # readers accept all

# --- OCI media types --------------------------------------------------------------------------
OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX: Final = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_V2: Final = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST: Final = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_EMPTY: Final = "application/vnd.oci.empty.v1+json"

ARTIFACT_TYPE: Final = "application/vnd.kubectl-snapshot.pod.v1+json"
CONFIG_MEDIA_TYPE: Final = "application/vnd.kubectl-snapshot.config.v1+json"
# One layer per container: a tar in the checkpointctl archive layout, zstd-compressed.
CHECKPOINT_LAYER_MEDIA_TYPE: Final = "application/vnd.kubectl-snapshot.checkpoint.v1.tar+zstd"
# One layer with the contents of the pod's emptyDir volumes (a tar with one top dir per volume).
VOLUMES_LAYER_MEDIA_TYPE: Final = "application/vnd.kubectl-snapshot.volumes.v1.tar+zstd"
# Format v2: one zstd frame holding a byte range of a CRIU pages-N.img (content-addressed chunk).
CHUNK_MEDIA_TYPE: Final = "application/vnd.kubectl-snapshot.chunk.v1+zstd"
# Format v4: one zstd frame holding pages of a chunk that changed since its base chunk (core/pagedelta.py).
DELTA_MEDIA_TYPE: Final = "application/vnd.kubectl-snapshot.pagedelta.v1+zstd"
# Encryption at rest (core/sealing.py): a sealed layer or chunk has its clear media type + this suffix
# (ocicrypt's convention), and the manifest says the scheme in ANN_ENCRYPTION.
ENCRYPTED_SUFFIX: Final = "+encrypted"

# --- annotations ------------------------------------------------------------------------------
ANN_CREATED: Final = "org.opencontainers.image.created"
ANN_TITLE: Final = "org.opencontainers.image.title"
ANN_REF_NAME: Final = "org.opencontainers.image.ref.name"

# checkpointctl (lib/annotations.go)
CRIU_PREFIX: Final = "org.criu.checkpoint."
ANN_CRIU_ENGINE_NAME: Final = CRIU_PREFIX + "engine.name"
ANN_CRIU_ENGINE_VERSION: Final = CRIU_PREFIX + "engine.version"
ANN_CRIU_CONTAINER_NAME: Final = CRIU_PREFIX + "container.name"
ANN_CRIU_POD_NAME: Final = CRIU_PREFIX + "pod.name"
ANN_CRIU_POD_NAMESPACE: Final = CRIU_PREFIX + "pod.namespace"
ANN_CRIU_POD_UID: Final = CRIU_PREFIX + "pod.uid"
ANN_CRIU_ROOTFS_IMAGE_NAME: Final = CRIU_PREFIX + "rootfsImageName"
ANN_CRIU_ROOTFS_IMAGE_SHA: Final = CRIU_PREFIX + "rootfsImageSha"
ANN_CRIU_RUNTIME_NAME: Final = CRIU_PREFIX + "runtime.name"
ANN_CRIU_RUNTIME_VERSION: Final = CRIU_PREFIX + "runtime.version"
ANN_CRIU_VERSION: Final = CRIU_PREFIX + "criu.version"
ANN_CRIU_HOST_ARCH: Final = CRIU_PREFIX + "host.arch"
ANN_CRIU_HOST_KERNEL: Final = CRIU_PREFIX + "host.kernel"
ANN_CRIU_CGROUP_VERSION: Final = CRIU_PREFIX + "cgroup.version"

# the project's own keys
PROJECT_PREFIX: Final = "io.github.kubectl-snapshot."
ANN_FORMAT_VERSION: Final = PROJECT_PREFIX + "format.version"
ANN_GROUP_NAME: Final = PROJECT_PREFIX + "group.name"
ANN_CONTAINER_COUNT: Final = PROJECT_PREFIX + "containers"
ANN_ENCRYPTION: Final = PROJECT_PREFIX + "encryption"  # the sealing scheme; absent: stored in clear
ANN_ENCRYPTION_NAMESPACE: Final = PROJECT_PREFIX + "encryption.namespace"  # whose key seals it
ENGINE_NAME: Final = "kubectl-snapshot"

# --- checkpoint archive layout (checkpointctl lib/metadata.go) ---------------------------------
CHECKPOINT_DIRECTORY: Final = "checkpoint"
CONFIG_DUMP_FILE: Final = "config.dump"
SPEC_DUMP_FILE: Final = "spec.dump"
ROOTFS_DIFF_TAR: Final = "rootfs-diff.tar"
DELETED_FILES_FILE: Final = "deleted.files"
STATS_DUMP_FILE: Final = "stats-dump"
DUMP_LOG_FILE: Final = "dump.log"
RESTORE_LOG_FILE: Final = "restore.log"
# CRIU's lazy-pages daemon listens on this in a lazy restore's work dir (the staged dir), and logs there
LAZY_PAGES_SOCKET: Final = "lazy-pages.socket"
LAZY_PAGES_LOG: Final = "lazy-pages.log"
# the project's own member: options the dump was made with (tcp, file locks, ...), JSON
DUMP_OPTIONS_FILE: Final = "kubectl-snapshot.options.json"
HOT_PAGES_FILE: Final = "kubectl-snapshot.hotpages.json"  # in the container layer: core/hotpages.py

# --- containerd -------------------------------------------------------------------------------
CONTAINERD_NAMESPACE_HEADER: Final = "containerd-namespace"
CONTAINERD_LEASE_HEADER: Final = "containerd-lease"
RUNC_RUNTIME: Final = "io.containerd.runc.v2"
RUNC_OPTIONS_TYPE: Final = "containerd.runc.v1.Options"
RUNC_CHECKPOINT_OPTIONS_TYPE: Final = "containerd.runc.v1.CheckpointOptions"
WRAPPER_BINARY_NAME: Final = "ks-runc"

# --- node paths (overridable by flags/env) ---------------------------------------------------
DEFAULT_STATE_DIR: Final = "/var/lib/kubectl-snapshot"
STAGING_SUBDIR: Final = "staged"
ENV_STATE_DIR: Final = "KUBECTL_SNAPSHOT_STATE_DIR"
# "0": store every changed chunk whole (no page deltas, no page hashing; bench/run.py compares both)
ENV_PAGE_DELTAS: Final = "KUBECTL_SNAPSHOT_PAGE_DELTAS"
# "0": a node-level restore creates its containers only after their data is staged (no staging gate)
ENV_EARLY_CREATE: Final = "KUBECTL_SNAPSHOT_EARLY_CREATE"
# "0": the hook of such a container waits for all of its data, page files included, before `runc restore`
# (one-phase staging gate; bench/run.py compares both)
ENV_EARLY_RESTORE: Final = "KUBECTL_SNAPSHOT_EARLY_RESTORE"
# dumps that clearly fit go to a tmpfs (shim/host/memwork.py); the DaemonSet mounts the host's directory there
DEFAULT_MEMORY_WORK_DIR: Final = "/dev/shm/kubectl-snapshot"
