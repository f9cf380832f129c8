"""Reading a checkpoint archive made by another tool (the kubelet's checkpoint API through containerd's
CRI, or `podman container checkpoint --export`) for an import (docs/formats.md).

Such an archive is untrusted input: its member names are checked before anything is written (no
absolute path, no `..`, no links or devices, only the entries a checkpoint archive has), and the two
JSON documents it carries, `config.dump` (the runtime's own container config: containerd's
`crmetadata.ContainerConfig` or libpod's) and `spec.dump` (the OCI runtime spec), are read only for the
fields an import records. Pure: no I/O.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument

# the files of a checkpoint archive (containerd's CRI and podman write these; others are refused)
TOP_FILES = frozenset(
    {
        C.CONFIG_DUMP_FILE,
        C.SPEC_DUMP_FILE,
        C.ROOTFS_DIFF_TAR,
        C.DELETED_FILES_FILE,
        C.STATS_DUMP_FILE,
        C.DUMP_LOG_FILE,
        "status",  # containerd's CRI: the container's CRI status
        "status.dump",
        "container.log",  # containerd: the container's log so far
        "network.status",  # podman
        "restore.log",
        "bind.mounts",  # podman
        "devshm-checkpoint.tar",  # podman: /dev/shm, which a snapshot of this project does not carry
    }
)
INVENTORY = f"{C.CHECKPOINT_DIRECTORY}/inventory.img"
MAX_DUMP_BYTES = 4 << 20  # config.dump and spec.dump are small JSON documents
_CRIU_IMAGE = re.compile(r"^[A-Za-z0-9._-]+$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a Kubernetes container name (DNS label)
# the CRI annotations containerd writes into a Kubernetes container's spec
ANN_CRI_CONTAINER_NAME = "io.kubernetes.cri.container-name"
ANN_CRI_SANDBOX_NAME = "io.kubernetes.cri.sandbox-name"
ANN_CRI_SANDBOX_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
ANN_CRI_SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"
ANN_CRI_IMAGE_NAME = "io.kubernetes.cri.image-name"
NOT_AN_ARCHIVE_HINT = (
    "import reads the archive the kubelet's checkpoint API writes (/var/lib/kubelet/checkpoints/*.tar) "
    "or `podman container checkpoint --export` writes"
)


def check_member(name: str, kind: str) -> str | None:
    """The normalised path of an archive member to extract, or None for a directory entry.

    `kind` is "file", "dir" or anything else (a link, a device, a fifo): only the first two are taken.
    Refused: absolute paths, `..`, anything outside the entries a checkpoint archive has."""
    if "\0" in name or name.startswith("/") or "\\" in name:
        raise InvalidArgument(f"archive member {name!r} is not a relative path", hint=NOT_AN_ARCHIVE_HINT)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"archive member {name!r} leaves the archive's directory (..)", hint=NOT_AN_ARCHIVE_HINT)
    path = posixpath.join(*parts) if parts else ""
    if kind == "dir":
        if path in ("", C.CHECKPOINT_DIRECTORY):
            return None
        raise InvalidArgument(f"unexpected directory {name!r} in the archive", hint=NOT_AN_ARCHIVE_HINT)
    if kind != "file":
        raise InvalidArgument(
            f"archive member {name!r} is a {kind}, not a regular file: a checkpoint archive holds none",
            hint=NOT_AN_ARCHIVE_HINT,
        )
    if path in TOP_FILES:
        return path
    head, _, leaf = path.partition("/")
    if head == C.CHECKPOINT_DIRECTORY and _CRIU_IMAGE.match(leaf):
        return path
    raise InvalidArgument(f"unexpected file {name!r} in the archive", hint=NOT_AN_ARCHIVE_HINT)


def check_complete(paths: set[str]) -> None:
    """Refuse an archive without what a restore needs: CRIU's images, both dumps."""
    missing = [p for p in (INVENTORY, C.CONFIG_DUMP_FILE, C.SPEC_DUMP_FILE) if p not in paths]
    if missing:
        raise InvalidArgument(f"not a checkpoint archive: it has no {', '.join(missing)}", hint=NOT_AN_ARCHIVE_HINT)


def parse_dump(data: bytes, name: str) -> dict[str, Any]:
    """config.dump or spec.dump: a JSON object."""
    if len(data) > MAX_DUMP_BYTES:
        raise InvalidArgument(f"{name} is larger than {MAX_DUMP_BYTES} bytes", hint=NOT_AN_ARCHIVE_HINT)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{name} is not JSON: {e}", hint=NOT_AN_ARCHIVE_HINT) from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{name} is not a JSON object", hint=NOT_AN_ARCHIVE_HINT)
    return doc


@dataclass(frozen=True)
class ImportedContainer:
    """What an archive says of its container, as an import records it."""

    name: str  # the container's name (in its pod, for a kubelet checkpoint)
    id: str  # its id on the node that checkpointed it
    image: str  # the image name
    image_digest: str  # the image's digest, where the archive names one ("" otherwise)
    pod: str  # the pod's name ("" outside Kubernetes)
    namespace: str  # the pod's namespace ("" outside Kubernetes)
    pod_uid: str
    runtime: str  # "containerd" (the kubelet's, through CRI) or "podman"


def describe(
    config_dump: Mapping[str, Any], spec_dump: Mapping[str, Any], *, name: str | None = None
) -> ImportedContainer:
    """The container of an archive from its two dumps; `name` overrides the container's name."""
    annotations = spec_dump.get("annotations")
    ann: Mapping[str, Any] = annotations if isinstance(annotations, Mapping) else {}

    def s(d: Mapping[str, Any], key: str) -> str:
        v = d.get(key)
        return v if isinstance(v, str) else ""

    process = spec_dump.get("process")
    if not isinstance(process, Mapping) or not isinstance(spec_dump.get("root"), Mapping):
        raise InvalidArgument("spec.dump is not an OCI runtime spec (no process or root)", hint=NOT_AN_ARCHIVE_HINT)
    runtime = "podman" if s(ann, "io.container.manager") == "libpod" else "containerd"
    container = name or s(ann, ANN_CRI_CONTAINER_NAME) or s(config_dump, "name")
    if not container:
        raise InvalidArgument("the archive names no container", hint="pass --name NAME")
    if not _NAME.match(container) or len(container) > 63:
        raise InvalidArgument(
            f"{container!r} is not a container name a pod accepts", hint="pass --name NAME (a DNS label)"
        )
    image = s(ann, ANN_CRI_IMAGE_NAME) or s(config_dump, "rootfsImageName") or s(config_dump, "rootfsImage")
    if not image:
        raise InvalidArgument("the archive names no image (config.dump rootfsImageName)", hint=NOT_AN_ARCHIVE_HINT)
    ref = s(config_dump, "rootfsImageRef")  # containerd: the image's manifest digest (or NAME@DIGEST)
    digest = ref.rpartition("@")[2] if "sha256:" in ref else ""
    return ImportedContainer(
        name=container,
        id=s(config_dump, "id"),
        image=image,
        image_digest=digest,
        pod=s(ann, ANN_CRI_SANDBOX_NAME),
        namespace=s(ann, ANN_CRI_SANDBOX_NAMESPACE),
        pod_uid=s(ann, ANN_CRI_SANDBOX_UID),
        runtime=runtime,
    )
