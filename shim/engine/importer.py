"""Import a checkpoint archive of another tool (the kubelet's checkpoint API, podman's export) as a
snapshot of this project: the same container layer and page chunks a snapshot taken here has
(shim/engine/package.py), the same config and manifest (shim/engine/checkpoint.py), signed by the
importer's own key with an origin that says it was imported (docs/security.md, "Imported checkpoints").

The archive is untrusted: every member's name and type is checked before anything is written
(kubectl_snapshot/core/checkpoint_archive.py), files are created O_EXCL in a private directory, and
`spec.dump` is stored as a snapshot stores a spec (no process environment, which holds resolved
secrets). Nothing is tagged until every blob is in the registry, so a failed import leaves no tag.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO

from kubectl_snapshot.adapters.signatures import PendingSignature, push_signature_blobs
from kubectl_snapshot.core import checkpoint_archive as A
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument, NotFound
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, PodRecord, SnapshotConfig, stored_runtime_spec
from kubectl_snapshot.core.provenance import Origin, SigningKey
from kubectl_snapshot.core.reference import Reference
from shim.engine.node_ports import Registry
from shim.engine.package import package_container
from shim.engine.publish import dump_stats, push_snapshot
from shim.engine.staging import StatePaths

# what the layer keeps of the archive (the dumps are written anew; logs and CRI status are not kept)
KEPT_FILES = (C.ROOTFS_DIFF_TAR, C.DELETED_FILES_FILE, C.STATS_DUMP_FILE, C.DUMP_LOG_FILE)
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImportRequest:
    archive: str
    target: Reference  # REGISTRY/REPO[:TAG]
    signing_key: SigningKey | None = None  # the importer's own key (unsigned without one)
    name: str | None = None  # the container's name (default: the archive's)
    namespace: str | None = None  # the origin's namespace (default: the archive's pod's)
    pod: str | None = None  # the origin's pod (default: the archive's)
    node: str = ""  # the node the checkpoint was taken on, as the importer states it
    image_digest: str = ""  # the image's manifest digest, checked by a restore where given
    host: HostFacts | None = None  # the checkpointing host's facts (default: this host's)
    # the pod the container ran in, as a snapshot records it (shim/controller/podinfo.py record_pod): what
    # `kubectl snapshot restore` recreates; without it the snapshot restores on a node only
    pod_record: PodRecord | None = None


@dataclass(frozen=True)
class ImportResult:
    reference: Reference  # repository@digest
    tagged: Reference
    config: SnapshotConfig
    source: A.ImportedContainer
    signed_by: str  # the key id ("" when unsigned)


def import_archive(req: ImportRequest, *, registry: Registry, paths: StatePaths) -> ImportResult:
    """Push `req.archive` as a snapshot to `req.target`; see the module docstring."""
    if not os.path.isfile(req.archive):
        raise NotFound(f"{req.archive} is not a file", hint=A.NOT_AN_ARCHIVE_HINT)
    os.makedirs(paths.downloads(), mode=0o700, exist_ok=True)
    work = tempfile.mkdtemp(prefix="import-", dir=paths.downloads())
    try:
        cdir = os.path.join(work, "container")
        os.mkdir(cdir, 0o700)
        extract(req.archive, cdir)
        with open(os.path.join(cdir, C.CONFIG_DUMP_FILE), "rb") as f:
            config_dump = A.parse_dump(f.read(A.MAX_DUMP_BYTES + 1), C.CONFIG_DUMP_FILE)
        with open(os.path.join(cdir, C.SPEC_DUMP_FILE), "rb") as f:
            spec_dump = A.parse_dump(f.read(A.MAX_DUMP_BYTES + 1), C.SPEC_DUMP_FILE)
        src = A.describe(config_dump, spec_dump, name=req.name)
        namespace = req.namespace or src.namespace
        if not namespace:
            raise InvalidArgument("the archive names no namespace (not a Kubernetes pod's)", hint="pass --namespace NS")
        spec = stored_runtime_spec(spec_dump)
        _write_dumps(cdir, src, spec)
        plain_rootfs_diff(os.path.join(cdir, C.ROOTFS_DIFF_TAR))
        stats = dump_stats(cdir)
        pc = package_container(registry, req.target, cdir)
        created = _now()
        rec = ContainerRecord(
            name=src.name,
            id=src.id or src.name,
            image=src.image,
            image_digest=req.image_digest,
            layer_digest=pc.layer.digest,
            spec=spec,
            stats=stats,
            pages=pc.pages,
        )
        pod_name = req.pod or src.pod or src.name
        pod = PodRecord(name=pod_name, namespace=namespace, uid=src.pod_uid, node=req.node)
        if req.pod_record is not None:
            pod = _same_pod(req.pod_record, src, namespace, req.node)
            pod_name = pod.name
        config = SnapshotConfig(
            group=pod_name,
            namespace=namespace,
            created=created,
            containers=(rec,),
            host=req.host if req.host is not None else _host(),
            pod=pod,
        )
        key = req.signing_key
        signer = None
        if key is not None:
            origin = Origin(
                namespace=namespace,
                pod=pod_name,
                pod_uid=pod.uid,
                node=req.node,
                created=created,
                format_version=config.format_version,
                imported=True,
            )

            def signer(pinned: Reference) -> PendingSignature:
                return push_signature_blobs(registry, pinned, origin, key)

        result, _signed = push_snapshot(req.target, config, [rec], [pc], None, registry, signer)
        return ImportResult(result.reference, result.tagged, config, src, key.public.id if key else "")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _same_pod(record: PodRecord, src: A.ImportedContainer, namespace: str, node: str) -> PodRecord:
    """The pod record given, refused where it is not the archive's pod: another namespace or uid, or
    no container of the archive's name."""
    if record.namespace != namespace:
        raise InvalidArgument(f"the pod manifest is of namespace {record.namespace!r}, the archive's {namespace!r}")
    if src.pod_uid and record.uid and record.uid != src.pod_uid:
        raise InvalidArgument(
            f"the pod manifest is of pod uid {record.uid}, the archive was taken from {src.pod_uid}",
            hint="give the manifest of the pod the checkpoint was taken from (kubectl get pod NAME -o json)",
        )
    names = [c.get("name") for c in record.spec.get("containers") or [] if isinstance(c, dict)]
    if src.name not in names:
        raise InvalidArgument(f"the pod manifest has no container {src.name!r} (it has {', '.join(map(str, names))})")
    return dataclasses.replace(record, node=node or record.node)


def extract(archive: str, into: str) -> set[str]:
    """The archive's files into the empty directory `into`, every member checked first
    (core/checkpoint_archive.py); what was written."""
    try:
        tar = tarfile.open(archive, mode="r:*")  # noqa: SIM115 - closed by the `with` below
    except (tarfile.TarError, EOFError) as e:
        raise InvalidArgument(f"{archive} is not a tar archive ({e})", hint=A.NOT_AN_ARCHIVE_HINT) from None
    written: set[str] = set()
    with tar:
        try:
            for member in tar:
                kind = "file" if member.isreg() else "dir" if member.isdir() else _kind(member)
                path = A.check_member(member.name, kind)
                if path is None:
                    continue
                if path in written:
                    raise InvalidArgument(f"{member.name!r} is in the archive twice", hint=A.NOT_AN_ARCHIVE_HINT)
                src = tar.extractfile(member)
                if src is None:  # pragma: no cover - a regular member always has data
                    raise InvalidArgument(f"cannot read {member.name!r}", hint=A.NOT_AN_ARCHIVE_HINT)
                _write(into, path, src)
                written.add(path)
        except (tarfile.TarError, EOFError) as e:
            raise InvalidArgument(f"{archive} is damaged ({e})", hint=A.NOT_AN_ARCHIVE_HINT) from None
    A.check_complete(written)
    return written


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk():
        return "device"
    if member.isfifo():
        return "fifo"
    return "special file"


def _write(root: str, path: str, src: IO[bytes]) -> None:
    head, _, _leaf = path.rpartition("/")
    if head:
        os.makedirs(os.path.join(root, head), mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(root, path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(src, out, _CHUNK)


def plain_rootfs_diff(path: str) -> None:
    """The container's layer diff as a plain tar, as a snapshot's layer holds it: containerd's CRI writes
    it gzip-compressed; an empty file (no diff) is left out."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        magic = f.read(2)
    if not magic:
        os.unlink(path)
        return
    if magic != b"\x1f\x8b":
        return
    tmp = path + ".plain"
    try:
        with gzip.open(path, "rb") as src, open(tmp, "xb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
    except (OSError, EOFError) as e:
        raise InvalidArgument(f"{C.ROOTFS_DIFF_TAR} of the archive is not a valid gzip stream ({e})") from None
    os.replace(tmp, path)


def _write_dumps(cdir: str, src: A.ImportedContainer, spec: dict[str, object]) -> None:
    """The layer's spec.dump and config.dump as a snapshot taken here writes them; the logs and CRI
    status the archive may carry are not kept."""
    for name in os.listdir(cdir):
        if name not in (C.CHECKPOINT_DIRECTORY, *KEPT_FILES):
            os.unlink(os.path.join(cdir, name))
    with open(os.path.join(cdir, C.SPEC_DUMP_FILE), "w") as f:
        json.dump(spec, f)
    with open(os.path.join(cdir, C.CONFIG_DUMP_FILE), "w") as f:
        json.dump({"id": src.id, "name": src.name, "rootfsImageName": src.image, "runtime": "runc"}, f)
    with open(os.path.join(cdir, C.DUMP_OPTIONS_FILE), "w") as f:
        json.dump({"tcpEstablished": True, "fileLocks": True}, f)


def _host() -> HostFacts:
    from shim.host import facts as hostfacts

    return hostfacts.gather()


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
