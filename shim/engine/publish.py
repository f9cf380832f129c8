"""Publishing a snapshot: its config and manifest pushed once every blob is in the registry (no tag ever points
at a partial snapshot), and what a checkpoint directory's CRIU images say of the dump. Shared by the
checkpoint of a running pod and the import of another runtime's checkpoint archive."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kubectl_snapshot.adapters.signatures import PendingSignature, publish_signature
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import freeze as freeze_plan
from kubectl_snapshot.core.artifact import blob_digests, dangling_after_push
from kubectl_snapshot.core.chunks import chunk_digests, chunk_sizes, delta_digests
from kubectl_snapshot.core.errors import NotFound, SnapshotError, Unavailable
from kubectl_snapshot.core.model import (
    ContainerRecord,
    DumpStats,
    ProcessInfo,
    SnapshotConfig,
    layer_annotations,
    layer_media_type,
    manifest_annotations,
)
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.reference import Reference
from shim.criu.images import summarize_checkpoint
from shim.engine.node_ports import Registry
from shim.engine.package import PackagedBlob, PackagedContainer
from shim.engine.presence import missing_blobs


@dataclass
class CheckpointResult:
    reference: Reference  # repository@digest
    tagged: Reference
    config: SnapshotConfig
    timings_ms: dict[str, float] = field(default_factory=dict)
    size: int = 0  # compressed bytes of all blobs
    uploaded: int = 0  # bytes actually sent (blobs the registry lacked)
    frozen_by: str = ""  # "cgroup freezer", "containerd" or both: how the containers were paused
    plan: freeze_plan.FreezePlan | None = None  # expected freeze and deadline
    signed_by: str = ""  # id of the key that signed it ("" when unsigned)
    work_in_memory: bool = False  # the dump was written to the node's memory work area (shim/host/memwork.py)


def dump_stats(cdir: str) -> DumpStats:
    stats_file = os.path.join(cdir, C.STATS_DUMP_FILE)
    try:
        s = summarize_checkpoint(
            os.path.join(cdir, C.CHECKPOINT_DIRECTORY),
            stats_dump=stats_file if os.path.exists(stats_file) else None,
        )
    except SnapshotError:
        return DumpStats()
    return DumpStats(
        process_count=s.process_count,
        memory_bytes=s.memory_bytes,
        pages_written=s.pages_written,
        frozen_time_us=s.frozen_time_us or 0,
        processes=tuple(ProcessInfo(pid=p.pid, ppid=p.ppid, comm=p.comm) for p in s.processes),
    )


def push_snapshot(
    target: Reference,
    config: SnapshotConfig,
    records: Sequence[ContainerRecord],
    packaged: Sequence[PackagedContainer],
    volumes_layer: PackagedBlob | None,
    registry: Registry,
    signed: Callable[[Reference], PendingSignature] | None = None,
) -> tuple[CheckpointResult, bool]:
    """Config and manifest, after every blob is in the registry: no tag ever points at a partial snapshot.

    `signed`: signs the snapshot (pinned by its manifest's digest, known before the push) and uploads the
    signature's blobs, beside the config's upload; then the signature's tag, and the snapshot's tag last:
    a signature that cannot be stored leaves no snapshot tag behind, and no tag ever names an unsigned
    snapshot (restore would refuse it). A snapshot tag that then fails leaves the signature's tag of a
    digest nothing names, which no restore or listing takes for a snapshot. Returns whether it was signed."""
    config_bytes = config.to_bytes()
    config_desc = Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(config_bytes), len(config_bytes))
    descs = [
        Descriptor(
            layer_media_type(C.CHECKPOINT_LAYER_MEDIA_TYPE, config),
            pc.layer.digest,
            pc.layer.size,
            layer_annotations(rec, group=config.group, namespace=config.namespace),
        )
        for rec, pc in zip(records, packaged, strict=True)
    ]
    stored = sum(pc.stored for pc in packaged) + len(config_bytes)
    sent = sum(pc.uploaded for pc in packaged)
    if volumes_layer is not None:
        descs.append(
            Descriptor(
                layer_media_type(C.VOLUMES_LAYER_MEDIA_TYPE, config),
                volumes_layer.digest,
                volumes_layer.size,
                {C.ANN_TITLE: "volumes.tar.zst"},
            )
        )
        stored += volumes_layer.size
        sent += volumes_layer.size
    # Every chunk is a layer too, so that registry garbage collection keeps what the snapshot needs.
    all_pages = [p for rec in records for p in rec.pages]
    sizes = chunk_sizes(all_pages)
    # Page deltas' bases are chunks too, so they are listed here (and kept) as long as a delta needs them.
    chunk_type = layer_media_type(C.CHUNK_MEDIA_TYPE, config)
    delta_type, deltas = layer_media_type(C.DELTA_MEDIA_TYPE, config), delta_digests(all_pages)
    descs.extend(Descriptor(delta_type if d in deltas else chunk_type, d, sizes[d]) for d in chunk_digests(all_pages))
    built = build_manifest(
        config=config_desc,
        layers=descs,
        artifact_type=C.ARTIFACT_TYPE,
        annotations=manifest_annotations(config),
    )
    manifest = built.to_bytes()
    pinned = replace(target, tag=None, digest=sha256_digest(manifest))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sign") as pool:
        signing = pool.submit(signed, pinned) if signed is not None else None
        # the config names this snapshot's creation time: no registry has it yet
        if registry.push_blob(target, digest=config_desc.digest, size=config_desc.size, data=config_bytes, fresh=True):
            sent += len(config_bytes)
        pending = signing.result() if signing is not None else None
    # a registry that acknowledged an upload it did not keep gets no manifest (nor signature) naming it:
    # registries need not refuse a manifest whose blobs are missing (threat B3)
    digests = blob_digests(built)
    missing = missing_blobs(registry, target, digests)
    if missing:
        raise dangling_after_push(pinned, missing, len(digests))
    if pending is not None:
        publish_signature(registry, pending)  # cosign's .sig tag names the digest, not the snapshot's tag
    registry.push_manifest(target, manifest, C.OCI_MANIFEST)
    confirm_manifest(registry, target, pinned)
    return CheckpointResult(reference=pinned, tagged=target, config=config, size=stored, uploaded=sent), (
        pending is not None
    )


READBACK_WAITS_S = (0.1, 0.3, 0.6)  # between reads of a tag the registry does not serve yet


def confirm_manifest(registry: Registry, target: Reference, pinned: Reference) -> None:
    """After the manifest's PUT: the registry serves it (read by digest: another save may have moved the
    same tag since, which is not this save's failure). A registry that answered the PUT without keeping
    it fails the save; what it did keep of it is deleted (best effort), so no tag is left naming a
    snapshot that was not confirmed."""
    digest = ""
    for wait in (*READBACK_WAITS_S, None):  # a registry slow to show what it just stored is given a second
        try:
            _body, _media_type, digest = registry.get_manifest(pinned)
        except NotFound:
            digest = ""
        if digest == pinned.digest:
            return
        if wait is not None:
            time.sleep(wait)
    with contextlib.suppress(SnapshotError):
        registry.delete_manifest(target, pinned.digest or "")
    served = f"manifest {digest}" if digest else "nothing"
    raise Unavailable(
        f"the registry acknowledged manifest {pinned.digest} for {target} but serves {served} there; "
        "the snapshot failed and what was pushed of it was deleted",
        hint="check the registry's storage (or a proxy in front of it), then snapshot again",
        retryable=True,
    )
