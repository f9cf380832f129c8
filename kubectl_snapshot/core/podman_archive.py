"""The checkpoint archive of podman and checkpointctl, as an export writes it (docs/formats.md).

`podman container checkpoint --export` writes, and `podman container restore --import` and
`checkpointctl show|inspect` read, one tar per container: CRIU's images under `checkpoint/`, the
container's writable layer (`rootfs-diff.tar`), the paths it deleted (`deleted.files`), CRIU's
`stats-dump`, and two JSON documents, `spec.dump` (the OCI runtime spec) and `config.dump` (podman's
own container config, libpod's `ContainerConfig`). A container layer of this project already holds
the first four in the same layout (docs/format.md); this module computes the last two from the
snapshot's config. Pure: no I/O.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument, NotFound
from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig
from kubectl_snapshot.core.oci import canonical_json, sha256_digest

NETWORK_STATUS_FILE = "network.status"
# the layer's files an export copies as they are (the two dumps are written anew)
COPIED_FILES = (C.ROOTFS_DIFF_TAR, C.DELETED_FILES_FILE, C.STATS_DUMP_FILE, C.DUMP_LOG_FILE)
MANAGER_ANNOTATION = "io.container.manager"  # checkpointctl tells podman's archives by it
DEFAULT_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PODMAN_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_IMAGE_ID = re.compile(r"^(sha256:)?[0-9a-f]{64}$")


@dataclass(frozen=True)
class PodmanDumps:
    spec: dict[str, Any]  # spec.dump
    config: dict[str, Any]  # config.dump
    warnings: tuple[str, ...]  # what podman will not restore as it was (joined namespaces, say)
    restore_flags: tuple[str, ...]  # what `podman container restore --import` needs besides the file


def choose_container(config: SnapshotConfig, name: str | None) -> ContainerRecord:
    """The container an export writes: `name`, or the only one."""
    if name is None:
        if len(config.containers) == 1:
            return config.containers[0]
        raise InvalidArgument(
            f"the snapshot has {len(config.containers)} containers "
            f"({', '.join(c.name for c in config.containers)}); a checkpoint archive holds one",
            hint="name one with --container NAME",
        )
    for rec in config.containers:
        if rec.name == name:
            return rec
    raise NotFound(
        f"the snapshot has no container {name!r}",
        hint=f"its containers: {', '.join(c.name for c in config.containers)}",
    )


def image_id(value: str) -> str:
    """podman's image id (the hex of the image config's sha256) from `sha256:HEX` or `HEX`."""
    if not _IMAGE_ID.match(value):
        raise InvalidArgument(
            f"invalid image id {value!r}",
            hint="the image config's digest: podman image inspect --format '{{.Id}}' IMAGE",
        )
    return value.removeprefix("sha256:")


def config_digest_of(manifest: Mapping[str, Any]) -> str:
    """The config digest of an image manifest (OCI or Docker v2), which is podman's image id."""
    cfg = manifest.get("config")
    digest = cfg.get("digest") if isinstance(cfg, Mapping) else None
    if not isinstance(digest, str) or not _IMAGE_ID.match(digest) or not digest.startswith("sha256:"):
        raise InvalidArgument("the image manifest names no sha256 config", hint="check the image")
    return digest


def export_container_id(reference_digest: str, container: str) -> str:
    """A stable 64-hex container id for the exported container (podman's own ids look alike): the same
    snapshot and container give the same id, so a second import without --name is refused as a clash
    rather than silently made a twin."""
    return hashlib.sha256(f"{reference_digest}\0{container}".encode()).hexdigest()


def podman_dumps(
    config: SnapshotConfig,
    rec: ContainerRecord,
    *,
    reference_digest: str,
    rootfs_image_id: str,
    name: str | None = None,
) -> PodmanDumps:
    """spec.dump and config.dump for `rec` of `config`, as podman's import reads them."""
    name = name or rec.name
    if not _PODMAN_NAME.match(name):
        raise InvalidArgument(
            f"{name!r} is not a name podman accepts", hint="pass --name NAME (letters, digits, '_', '.', '-')"
        )
    spec, warnings = _spec(rec)
    if config.volumes:
        warnings.append(
            f"the snapshot's volumes ({', '.join(v.name for v in config.volumes)}) are not in the archive "
            "(ks-agent restore puts them back)"
        )
    annotations = spec.setdefault("annotations", {})
    annotations[MANAGER_ANNOTATION] = "libpod"
    annotations[C.ANN_CRIU_ENGINE_NAME] = C.ENGINE_NAME
    annotations[C.ANN_CRIU_CONTAINER_NAME] = rec.name
    annotations[C.ANN_CRIU_ROOTFS_IMAGE_NAME] = rec.image
    if rec.image_digest:
        annotations[C.ANN_CRIU_ROOTFS_IMAGE_SHA] = rec.image_digest
    if config.pod is not None:
        annotations[C.ANN_CRIU_POD_NAME] = config.pod.name
        annotations[C.ANN_CRIU_POD_NAMESPACE] = config.pod.namespace
    process = spec.get("process") if isinstance(spec.get("process"), dict) else {}
    args = [str(a) for a in (process or {}).get("args") or []]
    dump_config: dict[str, Any] = {
        "id": export_container_id(reference_digest, rec.name),
        "name": name,
        "rootfsImageID": image_id(rootfs_image_id),
        "rootfsImageName": rec.image,
        "RawImageName": rec.image,
        "runtime": "runc",  # CRIU's images were written through runc
        "command": args,
        "createdTime": config.created,
        "checkpointedTime": config.created,
        "stopSignal": 15,
        "createWorkingDir": True,
        "spec": spec,
    }
    if _joined_network(rec):
        # CRIU recorded the pod's network namespace as external (runc's extRootNetNS): the restore must hand
        # it one. podman does when it creates the namespace itself; `none` gives it loopback only.
        dump_config["createNetNS"] = True
        dump_config["networkMode"] = "none"
    flags = []
    if rec.tcp_established:
        flags.append("--tcp-established")
    if rec.file_locks:
        flags.append("--file-locks")
    return PodmanDumps(spec=spec, config=dump_config, warnings=tuple(warnings), restore_flags=tuple(flags))


def _joined_network(rec: ContainerRecord) -> bool:
    """Whether the container joined a network namespace by path (a pod's, the sandbox's) when it was saved."""
    linux = rec.spec.get("linux") if isinstance(rec.spec.get("linux"), dict) else {}
    return any(
        isinstance(ns, dict) and ns.get("type") == "network" and bool(ns.get("path"))
        for ns in (linux or {}).get("namespaces") or []
    )


def _spec(rec: ContainerRecord) -> tuple[dict[str, Any], list[str]]:
    """The recorded spec made podman's: no cgroup path of the old node, a plain PATH for processes
    exec'd later (the restored ones keep theirs, from memory), namespaces of its own."""
    spec: dict[str, Any] = copy.deepcopy(dict(rec.spec))
    warnings: list[str] = []
    process = spec.setdefault("process", {})
    if isinstance(process, dict):
        process.setdefault("env", [DEFAULT_PATH_ENV])
    linux = spec.setdefault("linux", {})
    if isinstance(linux, dict):
        linux.pop("cgroupsPath", None)
        for ns in linux.get("namespaces") or []:
            if isinstance(ns, dict) and ns.get("path"):
                warnings.append(
                    f"container {rec.name!r} joined its pod's {ns.get('type')} namespace, which a checkpoint "
                    "archive cannot carry: podman gives it one of its own"
                    + (" (loopback only)" if ns.get("type") == "network" else "")
                )
                ns.pop("path")
    binds = [
        f"{m.get('destination')} from {m.get('source')}"
        for m in spec.get("mounts") or []
        if isinstance(m, dict)
        and (m.get("type") == "bind" or "bind" in (m.get("options") or []) or "rbind" in (m.get("options") or []))
    ]
    if binds:
        warnings.append(
            f"container {rec.name!r} bind-mounts host paths ({', '.join(binds)}): the archive does not carry "
            "them, and podman restores it only where they exist"
        )
    return spec, warnings


# --- the OCI checkpoint image (CRI-O; containerd's form beside it) ----------------------------------
# A single-layer image whose layer is the checkpoint archive itself (its entries at the root), marked
# by annotations on the manifest: CRI-O restores a container whose pod spec names such an image as its
# `image` (`io.kubernetes.cri-o.annotations.checkpoint.name`, CRI-O's pkg/annotations); containerd's
# CRI and checkpointctl read the `org.criu.checkpoint.*` names.
CRIO_PREFIX = "io.kubernetes.cri-o.annotations.checkpoint."
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def checkpoint_image_annotations(config: SnapshotConfig, rec: ContainerRecord, dumps: PodmanDumps) -> dict[str, str]:
    """The manifest annotations that make an image a checkpoint image, in CRI-O's and checkpointctl's names."""
    image_id = str(dumps.config["rootfsImageID"])
    ann = {
        C.ANN_CREATED: config.created,
        CRIO_PREFIX + "name": rec.name,
        CRIO_PREFIX + "rawImageName": rec.image,
        CRIO_PREFIX + "rootfsImageName": rec.image,
        CRIO_PREFIX + "rootfsImageID": image_id,
        C.ANN_CRIU_CONTAINER_NAME: rec.name,
        C.ANN_CRIU_ENGINE_NAME: C.ENGINE_NAME,
        C.ANN_CRIU_ROOTFS_IMAGE_NAME: rec.image,
        C.CRIU_PREFIX + "rootfsImageID": image_id,
        C.ANN_CRIU_RUNTIME_NAME: "runc",
    }
    if rec.image_digest:
        ann[C.ANN_CRIU_ROOTFS_IMAGE_SHA] = rec.image_digest
    if config.pod is not None:
        ann[C.ANN_CRIU_POD_NAME] = config.pod.name
        ann[C.ANN_CRIU_POD_NAMESPACE] = config.pod.namespace
    return ann


def checkpoint_image(
    config: SnapshotConfig, rec: ContainerRecord, dumps: PodmanDumps, *, layer_digest: str, layer_size: int
) -> tuple[bytes, bytes]:
    """(image config, manifest) of the checkpoint image whose one layer is the archive (uncompressed:
    its digest is its diff id)."""
    image_config = canonical_json(
        {
            "architecture": _OCI_ARCH.get(config.host.arch, config.host.arch or "amd64"),
            "os": "linux",
            "created": config.created,
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "config": {"Labels": {CRIO_PREFIX + "name": rec.name}},
        }
    )
    manifest = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": C.OCI_MANIFEST,
            "config": {"mediaType": OCI_IMAGE_CONFIG, "digest": sha256_digest(image_config), "size": len(image_config)},
            "layers": [{"mediaType": OCI_LAYER_TAR, "digest": layer_digest, "size": layer_size}],
            "annotations": checkpoint_image_annotations(config, rec, dumps),
        }
    )
    return image_config, manifest
