"""The snapshot config: the JSON document every artifact carries as its OCI config blob (formats v1-v3).

It says what was snapshotted (a group of containers, optionally a Kubernetes pod), how each container was
run (its recorded runtime spec and image), which layer holds which container, what the volumes were, and
facts about the host for a restore preflight. Parsing treats it as untrusted input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import PagesFile, chunk_digests, has_deltas, parse_pages_files
from kubectl_snapshot.core.encryption import EncryptionInfo
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.oci import canonical_json, is_digest, json_object


@dataclass(frozen=True)
class HostFacts:
    kernel: str = ""
    arch: str = ""
    criu_version: str = ""
    containerd_version: str = ""
    runc_version: str = ""
    cgroup_version: str = ""
    cpu_flags: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "arch": self.arch,
            "criuVersion": self.criu_version,
            "containerdVersion": self.containerd_version,
            "runcVersion": self.runc_version,
            "cgroupVersion": self.cgroup_version,
            "cpuFlags": list(self.cpu_flags),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostFacts:
        return cls(
            kernel=_str(d, "kernel"),
            arch=_str(d, "arch"),
            criu_version=_str(d, "criuVersion"),
            containerd_version=_str(d, "containerdVersion"),
            runc_version=_str(d, "runcVersion"),
            cgroup_version=_str(d, "cgroupVersion"),
            cpu_flags=tuple(str(x) for x in d.get("cpuFlags") or ()),
        )


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    comm: str

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "ppid": self.ppid, "comm": self.comm}


@dataclass(frozen=True)
class DumpStats:
    """Figures read from the CRIU images at snapshot time (also shown by `inspect`)."""

    process_count: int = 0
    memory_bytes: int = 0
    pages_written: int = 0
    frozen_time_us: int = 0
    processes: tuple[ProcessInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "processCount": self.process_count,
            "memoryBytes": self.memory_bytes,
            "pagesWritten": self.pages_written,
            "frozenTimeUs": self.frozen_time_us,
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DumpStats:
        return cls(
            process_count=_int(d, "processCount"),
            memory_bytes=_int(d, "memoryBytes"),
            pages_written=_int(d, "pagesWritten"),
            frozen_time_us=_int(d, "frozenTimeUs"),
            processes=tuple(
                ProcessInfo(pid=_int(p, "pid"), ppid=_int(p, "ppid"), comm=_str(p, "comm"))
                for p in (d.get("processes") or [])
                if isinstance(p, dict)
            ),
        )


@dataclass(frozen=True)
class ContainerRecord:
    name: str  # logical name (the container name in a pod, the container id otherwise)
    id: str  # the container id it had when snapshotted
    image: str  # image name as the runtime knew it
    image_digest: str  # digest of the image's manifest (or index) at snapshot time
    layer_digest: str  # digest of the checkpoint layer in the artifact
    spec: Mapping[str, Any]  # the OCI runtime spec it ran with, as stored_runtime_spec keeps it
    tcp_established: bool = True
    file_locks: bool = True
    stats: DumpStats = field(default_factory=DumpStats)
    # format v2: CRIU page files stored as chunks, not inside the layer (checkpoint/<name>)
    pages: tuple[PagesFile, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "id": self.id,
            "image": self.image,
            "imageDigest": self.image_digest,
            "layer": self.layer_digest,
            "spec": dict(self.spec),
            "dumpOptions": {"tcpEstablished": self.tcp_established, "fileLocks": self.file_locks},
            "stats": self.stats.to_dict(),
        }
        if self.pages:
            d["pages"] = [p.to_dict() for p in self.pages]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> ContainerRecord:
        layer = _str(d, "layer")
        if not is_digest(layer):
            raise _bad(f"{where} names an invalid layer digest {layer!r}")
        spec = d.get("spec") or {}
        if not isinstance(spec, dict):
            raise _bad(f"{where} spec is not an object")
        opts = d.get("dumpOptions") or {}
        name = _str(d, "name")
        if not name:
            raise _bad(f"{where} has no name")
        return cls(
            name=name,
            id=_str(d, "id"),
            image=_str(d, "image"),
            image_digest=_str(d, "imageDigest"),
            layer_digest=layer,
            spec=spec,
            tcp_established=bool(opts.get("tcpEstablished", True)),
            file_locks=bool(opts.get("fileLocks", True)),
            stats=DumpStats.from_dict(d.get("stats") or {}),
            pages=parse_pages_files(d.get("pages"), where),
        )


@dataclass(frozen=True)
class VolumeRecord:
    name: str  # the top directory of this volume inside the volumes layer
    source: str  # where it was on the snapshotted node (host dir, or emptyDir name for pods)

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "source": self.source}


@dataclass(frozen=True)
class PodRecord:
    name: str
    namespace: str
    uid: str = ""
    node: str = ""
    spec: Mapping[str, Any] = field(default_factory=dict)  # sanitized pod spec, used by `restore`

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "node": self.node,
            "spec": dict(self.spec),
        }


@dataclass(frozen=True)
class SnapshotConfig:
    group: str  # human name of what was snapshotted (pod name, or the first container id)
    namespace: str  # Kubernetes namespace, or containerd namespace
    created: str  # RFC 3339
    containers: tuple[ContainerRecord, ...]
    host: HostFacts
    volumes: tuple[VolumeRecord, ...] = ()
    volumes_layer: str | None = None
    stopped: bool = False
    freeze_ms: float = 0.0
    pod: PodRecord | None = None
    format_version: int = C.FORMAT_VERSION
    # encryption at rest (docs/format.md "Encryption"): absent = blobs stored in clear
    encryption: EncryptionInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "formatVersion": self.format_version,
            "group": self.group,
            "namespace": self.namespace,
            "created": self.created,
            "containers": [c.to_dict() for c in self.containers],
            "volumes": [v.to_dict() for v in self.volumes],
            "volumesLayer": self.volumes_layer,
            "host": self.host.to_dict(),
            "stopped": self.stopped,
            "freezeMs": round(self.freeze_ms, 3),
        }
        if self.pod is not None:
            d["pod"] = self.pod.to_dict()
        if self.encryption is not None:
            d["encryption"] = self.encryption.to_dict()
        return d

    def blob_digests(self) -> list[str]:
        """Every layer and chunk digest the config names (each distinct once)."""
        seen = dict.fromkeys(c.layer_digest for c in self.containers)
        if self.volumes_layer:
            seen.setdefault(self.volumes_layer, None)
        for c in self.containers:
            seen.update(dict.fromkeys(chunk_digests(c.pages)))
        return list(seen)

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    def container(self, name: str) -> ContainerRecord:
        for c in self.containers:
            if c.name == name:
                return c
        raise _bad(f"snapshot has no container {name!r}")


def parse_config(body: bytes) -> SnapshotConfig:
    d = json_object(body, "snapshot config")
    version = d.get("formatVersion")
    if version not in C.SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
        raise FailedPrecondition(
            f"snapshot format version {version!r} is not supported "
            f"(this build reads {', '.join(map(str, C.SUPPORTED_FORMAT_VERSIONS))})",
            hint="use a kubectl-snapshot release that matches the one that made the snapshot",
        )
    raw_containers = d.get("containers")
    if not isinstance(raw_containers, list) or not raw_containers:
        raise _bad("snapshot config lists no containers")
    containers = tuple(
        ContainerRecord.from_dict(c if isinstance(c, dict) else {}, f"container {i}")
        for i, c in enumerate(raw_containers)
    )
    if version >= 3 and any("env" in (c.spec.get("process") or {}) for c in containers):
        raise _bad("a format v3 snapshot config records a process environment (v3 never stores one)")
    if version < 2 and any(c.pages for c in containers):
        raise _bad("a format v1 snapshot config lists page chunks (a v2 feature)")
    if version < C.DELTA_FORMAT_VERSION and any(has_deltas(c.pages) for c in containers):
        raise _bad(f"a format v{version} snapshot config lists page deltas (a v{C.DELTA_FORMAT_VERSION} feature)")
    names = [c.name for c in containers]
    if len(set(names)) != len(names):
        raise _bad("snapshot config has duplicate container names")
    volumes = tuple(
        VolumeRecord(name=_str(v, "name"), source=_str(v, "source"))
        for v in (d.get("volumes") or [])
        if isinstance(v, dict)
    )
    for v in volumes:
        if not v.name or "/" in v.name or v.name in (".", ".."):
            raise _bad(f"snapshot config has an invalid volume name {v.name!r}")
    volumes_layer = d.get("volumesLayer")
    if volumes_layer is not None and (not isinstance(volumes_layer, str) or not is_digest(volumes_layer)):
        raise _bad("snapshot config has an invalid volumes layer digest")
    pod_raw = d.get("pod")
    pod = None
    if isinstance(pod_raw, dict):
        spec = pod_raw.get("spec") or {}
        pod = PodRecord(
            name=_str(pod_raw, "name"),
            namespace=_str(pod_raw, "namespace"),
            uid=_str(pod_raw, "uid"),
            node=_str(pod_raw, "node"),
            spec=spec if isinstance(spec, dict) else {},
        )
    host = d.get("host") or {}
    encryption = EncryptionInfo.from_dict(d["encryption"]) if d.get("encryption") is not None else None
    config = SnapshotConfig(
        group=_str(d, "group"),
        namespace=_str(d, "namespace"),
        created=_str(d, "created"),
        containers=containers,
        host=HostFacts.from_dict(host if isinstance(host, dict) else {}),
        volumes=volumes,
        volumes_layer=volumes_layer,
        stopped=bool(d.get("stopped", False)),
        freeze_ms=float(d.get("freezeMs") or 0.0),
        pod=pod,
        format_version=int(version),
        encryption=encryption,
    )
    if encryption is not None:
        encryption.check_covers(config.blob_digests())
    return config


# Runtime-spec fields a snapshot never stores: the kubelet has already resolved secretKeyRef values into
# process.env, so anyone who can read the repository would read those secrets. A restore does not need
# them (CRIU restores the process, its environment included, from memory; a pod's new runtime spec
# comes from its new pod).
DROPPED_PROCESS_FIELDS = ("env",)


def stored_runtime_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime spec as a snapshot records it (format v3): without the process environment."""
    out = dict(spec)
    process = out.get("process")
    if isinstance(process, dict):
        out["process"] = {k: v for k, v in process.items() if k not in DROPPED_PROCESS_FIELDS}
    return out


def layer_annotations(record: ContainerRecord, *, group: str, namespace: str) -> dict[str, str]:
    """checkpointctl-style annotations for a container's checkpoint layer."""
    return {
        C.ANN_TITLE: f"{record.name}.tar.zst",
        C.ANN_CRIU_CONTAINER_NAME: record.name,
        C.ANN_CRIU_POD_NAME: group,
        C.ANN_CRIU_POD_NAMESPACE: namespace,
        C.ANN_CRIU_ROOTFS_IMAGE_NAME: record.image,
        C.ANN_CRIU_ROOTFS_IMAGE_SHA: record.image_digest,
    }


def manifest_annotations(config: SnapshotConfig) -> dict[str, str]:
    """Manifest annotations: standard keys, checkpointctl's host keys and the project's own."""
    ann = {
        C.ANN_CREATED: config.created,
        C.ANN_CRIU_ENGINE_NAME: C.ENGINE_NAME,
        C.ANN_CRIU_RUNTIME_NAME: "runc",
        C.ANN_CRIU_RUNTIME_VERSION: config.host.runc_version,
        C.ANN_CRIU_VERSION: config.host.criu_version,
        C.ANN_CRIU_HOST_ARCH: config.host.arch,
        C.ANN_CRIU_HOST_KERNEL: config.host.kernel,
        C.ANN_CRIU_CGROUP_VERSION: config.host.cgroup_version,
        C.ANN_FORMAT_VERSION: str(config.format_version),
        C.ANN_GROUP_NAME: config.group,
        C.ANN_CONTAINER_COUNT: str(len(config.containers)),
    }
    if config.pod is not None:
        ann[C.ANN_CRIU_POD_NAME] = config.pod.name
        ann[C.ANN_CRIU_POD_NAMESPACE] = config.pod.namespace
        ann[C.ANN_CRIU_POD_UID] = config.pod.uid
    if config.encryption is not None:
        ann[C.ANN_ENCRYPTION] = config.encryption.scheme
        ann[C.ANN_ENCRYPTION_NAMESPACE] = config.encryption.namespace
    return ann


def layer_media_type(media_type: str, config: SnapshotConfig) -> str:
    """A layer's media type as stored: with the encrypted suffix when the snapshot is sealed."""
    return media_type + C.ENCRYPTED_SUFFIX if config.encryption is not None else media_type


def check_layers_match(config: SnapshotConfig, layer_digests: Sequence[str]) -> None:
    """Every layer the config names must be in the manifest (no dangling references)."""
    present = set(layer_digests)
    for c in config.containers:
        if c.layer_digest not in present:
            raise _bad(f"container {c.name!r} names layer {c.layer_digest} that the manifest lacks")
    if config.volumes_layer and config.volumes_layer not in present:
        raise _bad(f"volumes layer {config.volumes_layer} is not in the manifest")
    for c in config.containers:
        for digest in chunk_digests(c.pages):
            if digest not in present:
                raise _bad(f"container {c.name!r} names chunk {digest} that the manifest lacks")


def _str(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key, "")
    return v if isinstance(v, str) else str(v)


def _int(d: Mapping[str, Any], key: str) -> int:
    v = d.get(key, 0)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def _bad(message: str) -> FailedPrecondition:
    return FailedPrecondition(message, hint="the artifact is damaged or was not made by kubectl-snapshot")
