"""Export one container of a snapshot as the checkpoint archive podman and checkpointctl read.

Authorised as a restore is (shim/engine/restore.py): the signature of exactly this digest by a
trusted key, agreeing with the config, before any layer is fetched; an encrypted snapshot opens only
with its namespace's key. The container's layer (and its page chunks) is then staged as for a
restore, every blob verified and decrypted, into a private directory, and written to one tar with
the two documents podman reads (kubectl_snapshot/core/podman_archive.py). The file holds the
container's memory in clear: it is created 0600, never over an existing file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.adapters.signatures import load_signed, verify_for_restore
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import podman_archive as P
from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound
from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig
from kubectl_snapshot.core.oci import sha256_digest
from kubectl_snapshot.core.provenance import TrustPolicy
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import KeyProvider
from shim.criu import images as criu_images
from shim.engine.node_ports import Registry
from shim.engine.restore import opener_for, stage_artifact
from shim.engine.staging import StatePaths

ImageIdFn = Callable[[ContainerRecord], str]
UNENCRYPTED_WARNING = (
    "the memory of container {name!r} is in {path} unencrypted (every secret its processes read): "
    "keep it like the pod's secrets, and delete it when done"
)


@dataclass(frozen=True)
class ExportRequest:
    source: Reference
    output: str
    container: str | None = None  # the snapshot's only container when None
    name: str | None = None  # the name podman gives the restored container (default: the container's)
    trust: TrustPolicy = field(default_factory=TrustPolicy)  # default trusts nothing: all refused
    key_namespace: str | None = None  # whose key opens an encrypted snapshot (default: the one that sealed it)
    oci_image: Reference | None = None  # also push the archive as a checkpoint image there


@dataclass(frozen=True)
class ExportResult:
    reference: Reference
    container: str
    output: str
    size: int
    provenance: str
    warnings: tuple[str, ...]
    restore_flags: tuple[str, ...]
    image: str = ""  # REGISTRY/REPO@DIGEST of the OCI checkpoint image, where one was pushed


def export(
    req: ExportRequest,
    *,
    registry: Registry,
    paths: StatePaths,
    keys: KeyProvider | None,
    image_id_of: ImageIdFn,
    image_registry: Registry | None = None,
) -> ExportResult:
    """Write `req.output`; `image_id_of` gives podman's id of the container's image (its config digest).
    With `req.oci_image` the archive is also pushed as the OCI checkpoint image CRI-O restores
    (through `image_registry`)."""
    if os.path.lexists(req.output):
        raise FailedPrecondition(f"{req.output} exists", hint="name a new file with -o, or remove that one")
    directory = os.path.dirname(os.path.abspath(req.output))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        raise FailedPrecondition(
            f"cannot write {req.output}: {directory} is not a directory this user may write to",
            hint="name a file in an existing, writable directory with -o",
        )
    artifact, signatures = load_signed(registry, req.source)
    config = artifact.config
    pod_uid = config.pod.uid if config.pod is not None else ""
    origin_ns = config.pod.namespace if config.pod is not None else config.namespace
    verdict = verify_for_restore(registry, artifact.reference, origin_ns, pod_uid, req.trust, signatures)
    rec = P.choose_container(config, req.container)
    enc_ns = config.encryption.namespace if config.encryption is not None else ""
    opener = opener_for(config, keys, req.key_namespace or enc_ns)
    dumps = P.podman_dumps(
        config,
        rec,
        reference_digest=artifact.reference.digest or "",
        rootfs_image_id=image_id_of(rec),
        name=req.name,
    )
    # only this container's layer and chunks: no other container's, no volumes
    one = Artifact(
        artifact.reference,
        artifact.manifest,
        dataclasses.replace(config, containers=(rec,), volumes=(), volumes_layer=None),
    )
    os.makedirs(paths.downloads(), mode=0o700, exist_ok=True)
    work = tempfile.mkdtemp(prefix="export-", dir=paths.downloads())
    try:
        staged = os.path.join(work, "container")
        stage_artifact(one, [staged], registry=registry, paths=paths, opener=opener)
        size = _write_archive(staged, req.output, dumps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    image = ""
    if req.oci_image is not None:
        image = push_checkpoint_image(req.output, req.oci_image, image_registry or registry, config, rec, dumps)
    return ExportResult(
        artifact.reference, rec.name, req.output, size, verdict.reason, dumps.warnings, dumps.restore_flags, image
    )


def push_checkpoint_image(
    archive: str,
    target: Reference,
    registry: Registry,
    config: SnapshotConfig,
    rec: ContainerRecord,
    dumps: P.PodmanDumps,
) -> str:
    """Push `archive` as the one layer of a checkpoint image to `target`; its reference by digest."""
    h = hashlib.sha256()
    with open(archive, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        size = f.tell()
    layer = "sha256:" + h.hexdigest()
    image_config, manifest = P.checkpoint_image(config, rec, dumps, layer_digest=layer, layer_size=size)
    registry.push_blob(target, digest=layer, size=size, path=archive)
    registry.push_blob(target, digest=sha256_digest(image_config), size=len(image_config), data=image_config)
    digest = registry.push_manifest(target, manifest, C.OCI_MANIFEST)
    return str(Reference(target.registry, target.repository, digest=digest))


def image_id_lookup(explicit: str | None, containerd: Callable[[], Any]) -> ImageIdFn:
    """podman's image id: `explicit` (from --image-id), else the config digest of the image as this
    node's containerd (`containerd()`, connected on first use) has it, checked against the digest the
    snapshot recorded: a podman that holds the same image has it under that id."""

    def lookup(rec: ContainerRecord) -> str:
        if explicit:
            return P.image_id(explicit)
        from shim.containerd import imageconfig

        client = containerd()
        try:
            target = client.get_image(rec.image).target
        except NotFound:
            raise FailedPrecondition(
                f"image {rec.image!r} is not in this containerd, so its id for podman is unknown",
                hint="pass --image-id (podman image inspect --format '{{.Id}}' IMAGE where podman has it)",
            ) from None
        if rec.image_digest and target.digest != rec.image_digest:
            raise FailedPrecondition(
                f"image {rec.image!r} here is {target.digest}, the snapshot ran {rec.image_digest}",
                hint="pass --image-id of the image the snapshot ran, or pull it by digest here",
            )
        data = client.read_content(target.digest)
        doc = imageconfig.parse_json(data, f"image {rec.image}")
        if imageconfig.is_index(target.media_type, doc):
            desc = imageconfig.select_manifest(doc)
            doc = imageconfig.parse_json(client.read_content(str(desc["digest"])), f"image {rec.image}")
        return P.image_id(P.config_digest_of(doc))

    return lookup


def _write_archive(staged: str, output: str, dumps: P.PodmanDumps) -> int:
    """The archive, written beside `output` and renamed into place once complete (0600, no overwrite)."""
    directory = os.path.dirname(os.path.abspath(output))
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".tar", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add_json(tar, C.SPEC_DUMP_FILE, dumps.spec)
            _add_json(tar, C.CONFIG_DUMP_FILE, dumps.config)
            _add_json(tar, P.NETWORK_STATUS_FILE, None)  # podman's own for a container without a network
            for name in P.COPIED_FILES:
                path = os.path.join(staged, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    _add_file(tar, path, name)
            cp = os.path.join(staged, C.CHECKPOINT_DIRECTORY)
            files_img = criu_images.files_without_root_mode(cp)
            tar.addfile(_info(C.CHECKPOINT_DIRECTORY + "/", tarfile.DIRTYPE, 0, 0o700))
            for entry in sorted(os.scandir(cp), key=lambda e: e.name):
                member = f"{C.CHECKPOINT_DIRECTORY}/{entry.name}"
                if entry.name == "files.img" and files_img is not None:
                    tar.addfile(_info(member, tarfile.REGTYPE, len(files_img), 0o600), io.BytesIO(files_img))
                elif entry.is_file(follow_symlinks=False):
                    _add_file(tar, entry.path, member)
        try:
            os.link(tmp, output)  # never over a file that appeared meanwhile
        except FileExistsError:
            raise FailedPrecondition(f"{output} exists", hint="name a new file with -o") from None
        return os.stat(output).st_size
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _info(name: str, kind: bytes, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, size, mode
    return info


def _add_json(tar: tarfile.TarFile, name: str, doc: object) -> None:
    data = json.dumps(doc, indent=1).encode()
    tar.addfile(_info(name, tarfile.REGTYPE, len(data), 0o600), io.BytesIO(data))


def _add_file(tar: tarfile.TarFile, path: str, name: str) -> None:
    with open(path, "rb") as f:
        tar.addfile(_info(name, tarfile.REGTYPE, os.fstat(f.fileno()).st_size, 0o600), f)
