"""Restore a snapshot artifact into new containers on this node's containerd.

Order of trust: the manifest and config are verified by digest (artifact.py); every layer is downloaded
and its digest verified before a single byte is extracted; extraction is strict (safe_extract); only then
are containers created. Each new container runs under the project's runtime wrapper, which sees the
staged data (found by container id in the agent's own state dir) and turns runc `create` into
`runc restore`.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.adapters.signatures import load_signed, verify_for_restore
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.artifact import Artifact, blob_digests, checked_before_restore, dangling_before_restore
from kubectl_snapshot.core.diskspace import STAGING, Ask
from kubectl_snapshot.core.errors import (
    CriuFailed,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SnapshotError,
    UnsafeArchive,
    log_tail,
)
from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor
from kubectl_snapshot.core.provenance import TrustPolicy
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.safepath import ExtractLimits
from kubectl_snapshot.core.sealing import DecryptionFailed, KeyProvider, KeyUse, Opener
from shim.criu import guard as criu_guard
from shim.engine.lazyrestore import LAZY_SLOTS, LazyStage, give_slot, stage_lazy, take_slots
from shim.engine.node_ports import Registry
from shim.engine.nodelazy import NodeLazyPhase, criu_for_daemon, end_orphaned, mark_served
from shim.engine.package import progress_counter
from shim.engine.presence import missing_blobs
from shim.engine.staging import FAILED, READY, StagingGate, StatePaths, check_key
from shim.engine.stream import fetch_chunks
from shim.files.archive import safe_extract
from shim.files.zstdio import open_zstd_reader
from shim.host import diskspace, private, safefs
from shim.host import facts as hostfacts
from shim.host.diskspace import DiskLedger, Reservation

log = logging.getLogger(__name__)
PhaseFn = Callable[[str], None]
BytesFn = Callable[[int, int], None]
DEFAULT_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class RestoreRequest:
    source: Reference
    new_ids: Sequence[str]  # one per snapshotted container, in order
    runtime_binary: str  # the runc-compatible wrapper (ks-runc, or kubectl-snapshot-runc on nodes)
    volumes: Sequence[str] = ()  # host dirs that receive the volume contents, one per snapshotted volume
    runc_root: str = ""
    log_dir: str = "/var/log/kubectl-snapshot"
    snapshotter: str = "overlayfs"
    trust: TrustPolicy = field(default_factory=TrustPolicy)  # default trusts nothing: all refused
    early_create: bool = True  # create the containers while their data downloads (the staging gate)
    early_restore: bool = True  # ... and start `runc restore` before the page files are in place (two phases)
    lazy: bool = False  # the containers run before their memory is back (shim/engine/nodelazy.py)


@dataclass
class RestoreResult:
    reference: Reference
    containers: list[tuple[str, int]]  # (new id, pid)
    config: SnapshotConfig
    timings_ms: dict[str, float] = field(default_factory=dict)
    provenance: str = ""  # why it was trusted
    lazy: NodeLazyPhase | None = None  # the lazy phase still serving the containers' pages (wait for it)
    eager_because: str = ""  # a lazy restore asked for that came eagerly: why


@dataclass(frozen=True)
class RestoreLimits:
    """What one restore may take on a node (issue 10, item 5), checked before the first download."""

    max_bytes: int = 64 << 30  # downloaded + written by one restore, as the artifact declares them
    reserve_bytes: int = 1 << 30  # free space the staging filesystem keeps after the restore


@dataclass(frozen=True)
class SpacePlan:
    download_bytes: int  # compressed layers and chunks, as declared (each chunk use counts)
    written_bytes: int  # what lands on the staging filesystem: downloads, page files, memory in layers


def plan_space(artifact: Artifact) -> SpacePlan:
    """The bytes a restore of `artifact` declares it needs; refuses page files beyond the recorded memory.

    A page file rebuilt from chunks is exactly as long as its chunks (core/chunks.check_tiling), so a
    small chunk reused many times makes a large file: the sum must stay within the memory the snapshot
    recorded for the container, which is also what the restore is sized by.
    """
    config = artifact.config
    layers = {d.digest: d for d in artifact.manifest.layers}
    wanted = _wanted_layers(artifact)
    download = sum(d.size for d in wanted)
    written = download  # layers are downloaded to files; chunks are verified in memory, then written
    for rec in config.containers:
        pages = sum(p.size for p in rec.pages)
        if pages > rec.stats.memory_bytes:
            raise FailedPrecondition(
                f"container {rec.name!r}: its chunks rebuild {pages} bytes of pages, more than the "
                f"{rec.stats.memory_bytes} bytes of memory the snapshot recorded (chunks reused beyond it)",
                hint="the snapshot is corrupted or was crafted; do not restore it",
            )
        download += sum(c.size + (c.delta.size if c.delta else 0) for p in rec.pages for c in p.chunks)
        # pages stored as chunks are written once; otherwise the memory is inside the (compressed) layer
        written += pages if rec.pages else max(rec.stats.memory_bytes, layers[rec.layer_digest].size)
    return SpacePlan(download, written)


def check_limit(plan: SpacePlan, limits: RestoreLimits) -> None:
    """Refuse a restore over the node's limit for one restore (its free space: `reserve_staging`)."""
    if plan.written_bytes > limits.max_bytes:
        raise FailedPrecondition(
            f"the snapshot declares {plan.written_bytes} bytes to download and write, over this node's "
            f"limit of {limits.max_bytes} bytes for one restore",
            hint="restore it on a node configured for larger restores, or take a smaller snapshot",
        )


def reserve_staging(
    plan: SpacePlan, directory: str, limits: RestoreLimits, namespace: str, disk: DiskLedger
) -> contextlib.AbstractContextManager[Reservation]:
    """The restore's bytes promised on `directory`'s filesystem (shim/host/diskspace.py), or a refusal: the
    node keeps its eviction threshold (or `limits.reserve_bytes`, the larger) free, beside the
    snapshots and restores in flight, and `namespace`'s restores keep within its share."""
    return disk.reserve(
        directory,
        Ask(
            need=plan.written_bytes,
            what="the snapshot's staging",
            hint="free space on the node's staging filesystem, wait for the restores in flight, or restore "
            "on another node (--node)",
            kind=STAGING,
            namespace=namespace,
            keep=limits.reserve_bytes,
        ),
    )


def _wanted_layers(artifact: Artifact) -> list[Descriptor]:
    config = artifact.config
    layers = {d.digest: d for d in artifact.manifest.layers}
    wanted: list[Descriptor] = [layers[c.layer_digest] for c in config.containers]
    if config.volumes_layer:
        wanted.append(layers[config.volumes_layer])
    return wanted


def stage_artifact(
    artifact: Artifact,
    staged_dirs: Sequence[str],
    *,
    registry: Registry,
    paths: StatePaths,
    volume_targets: Sequence[str | VolumeTarget] = (),
    on_bytes: BytesFn | None = None,
    opener: Opener | None = None,
    limits: RestoreLimits | None = None,
    timings: dict[str, float] | None = None,
    on_images: Callable[[], None] | None = None,
    namespace: str = "",
    disk: DiskLedger | None = None,
    lazy: bool = False,
) -> list[LazyStage]:
    """Download, verify and extract every layer: container i into staged_dirs[i], volumes into targets.

    Format v2 page files are rebuilt from their chunks meanwhile by parallel workers, each chunk verified
    against its digest before it is written (shim/engine/stream.py), and linked into place once their
    container's layer is extracted. Nothing is downloaded before the
    declared sizes passed `limits` and their bytes are reserved on the staging filesystem (`disk`, default
    the node's ledger), charged to `namespace` (the tenant restoring; "" outside Kubernetes).
    An encrypted snapshot needs its `opener` (`opener_for`): each blob is decrypted after its digest is
    verified, every segment authenticated before its bytes reach the extraction. `timings` gets the
    milliseconds of its steps (presence_ms: the registry asked for every blob; layers_ms: downloaded;
    extract_ms: extracted, decode cache filled; pages_ms: page files rebuilt, beside those;
    pages_wait_ms: what was left of that after the extraction).
    `on_images` is called once everything but the page files is in place, when page files are still to
    come (a two-phase staging gate's first answer, shim/engine/staging.py).
    `lazy`: the page files of the tasks' private memory are left in the registry (shim/engine/lazyrestore.py);
    returns the containers so staged, whose sessions the caller starts (a container whose images cannot be
    restored lazily is staged eagerly, and not in the list).
    """
    config = artifact.config
    stages: list[LazyStage] = []
    spent = timings if timings is not None else {}
    clock = time.monotonic
    if (config.encryption is None) != (opener is None):
        raise FailedPrecondition(
            "the snapshot is encrypted but no key was given"
            if opener is None
            else "a key was given for a snapshot stored in clear",
            hint="internal: get the opener with opener_for(config, ...)",
        )
    wanted = _wanted_layers(artifact)
    downloads = paths.downloads()
    os.makedirs(downloads, mode=0o700, exist_ok=True)
    plan = plan_space(artifact)
    limits = limits or RestoreLimits()
    check_limit(plan, limits)
    # a manifest whose registry lacks some of its blobs (threat B3) is refused before any download
    # (a lazy restore: but the page files' chunks, each verified as it is fetched; see checked_before_restore)
    t = clock()
    missing = missing_blobs(registry, artifact.reference, checked_before_restore(artifact, lazy=lazy))
    spent["presence_ms"] = (clock() - t) * 1000
    if missing:
        raise dangling_before_restore(artifact.reference, missing, len(blob_digests(artifact.manifest)))
    count = progress_counter(on_bytes, plan.download_bytes)
    blobs: dict[str, str] = {}
    # Each container's page files download beside its layer, into a private directory next to its
    # staged one, and are moved into place once the layer is extracted: a small pod's restore does not
    # wait for the layer's round trips, its extraction and the decode cache before its first chunk.
    stop = threading.Event()
    aside: list[tuple[str, Future[float]] | None] = []
    t = clock()
    with contextlib.ExitStack() as stack:
        # before any download, and released once the downloads and page dirs are gone: the bytes promised
        # on the staging filesystem; what sizes cannot declare is capped by the room the promise saw
        reserved = stack.enter_context(reserve_staging(plan, downloads, limits, namespace, disk or diskspace.NODE))
        cap = max(0, min(ExtractLimits().max_total_bytes, reserved.room))
        extract_limits = ExtractLimits(max_total_bytes=cap, max_member_bytes=cap)
        stack.callback(_remove_pages_dirs, aside)  # last, after the pool's exit: nothing writes there any more
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=1, thread_name_prefix="pages"))
        try:
            for record, target in zip(config.containers, staged_dirs, strict=True):
                if record.pages and not lazy:
                    pdir = _pages_dir(target)
                    aside.append((pdir, pool.submit(_fetch_pages, registry, artifact.reference, record, pdir, count,
                                                    opener, stop)))  # fmt: skip
                else:
                    aside.append(None)
            # 1. every blob downloaded and verified ...
            for d in wanted:
                if d.digest in blobs:
                    continue
                path = os.path.join(downloads, d.digest.replace(":", "-") + f".{os.getpid()}.part")
                with open(path, "wb") as out:
                    blobs[d.digest] = path
                    registry.fetch_blob(
                        artifact.reference,
                        d.digest,
                        out,
                        expected_size=d.size,
                        max_size=d.size,
                        progress=count,
                    )
            # 2. ... before anything is extracted
            spent["layers_ms"] = (clock() - t) * 1000
            t = clock()
            for record, target, pending in zip(config.containers, staged_dirs, aside, strict=True):
                _extract_fresh(blobs[record.layer_digest], target, extract_limits, opener, record.layer_digest)
                if pending is not None:
                    os.close(_checkpoint_dir(record, target))  # made, and checked, before the pages' place is announced
                _cache_decoded(os.path.join(target, C.CHECKPOINT_DIRECTORY), paths)
            if config.volumes_layer:
                for vol, vtarget in zip(config.volumes, volume_targets, strict=True):
                    _extract_volume(blobs[config.volumes_layer], vol.name, vtarget, opener, config.volumes_layer)
            spent["extract_ms"] = (clock() - t) * 1000
            if lazy:
                t = clock()
                stages = _stage_lazily(artifact, staged_dirs, registry, count, opener, stop)
                spent["lazy_ms"] = (clock() - t) * 1000
            if on_images is not None and any(p is not None and not p[1].done() for p in aside):
                on_images()  # everything but the page files: the hooks may start CRIU (it waits for them)
            for record, target, pending in zip(config.containers, staged_dirs, aside, strict=True):
                if pending is not None:
                    t = clock()
                    fetched_ms = pending[1].result()
                    _place_pages(record, pending[0], target)
                    spent["pages_ms"] = spent.get("pages_ms", 0.0) + fetched_ms
                    spent["pages_wait_ms"] = spent.get("pages_wait_ms", 0.0) + (clock() - t) * 1000
        except BaseException:
            stop.set()  # no further chunk is begun; the pool's exit waits for those in flight
            for target in staged_dirs:
                shutil.rmtree(target, ignore_errors=True)
            raise
        finally:
            for path in blobs.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    return stages


def _stage_lazily(
    artifact: Artifact,
    staged_dirs: Sequence[str],
    registry: Registry,
    count: Callable[[int], None] | None,
    opener: Opener | None,
    stop: threading.Event,
) -> list[LazyStage]:
    """The containers with page files staged for a lazy restore, or eagerly where that cannot be."""
    stages = []
    for record, target in zip(artifact.config.containers, staged_dirs, strict=True):
        if not record.pages:
            continue
        os.close(_checkpoint_dir(record, target))  # no page file in the layer itself
        stage = stage_lazy(record, target, registry=registry, ref=artifact.reference, opener=opener, on_bytes=count)
        if stage is not None:
            stages.append(stage)
            continue
        pdir = _pages_dir(target)
        try:
            _fetch_pages(registry, artifact.reference, record, pdir, count, opener, stop)
            _place_pages(record, pdir, target)
        finally:
            shutil.rmtree(pdir, ignore_errors=True)
    return stages


def _remove_pages_dirs(aside: Sequence[tuple[str, Future[float]] | None]) -> None:
    for pending in aside:
        if pending is not None:
            shutil.rmtree(pending[0], ignore_errors=True)


def _pages_dir(target: str) -> str:
    """A fresh private directory beside `target` (same filesystem: its files are linked into place)
    whose name no staged container's can have (check_key: never a leading dot)."""
    parent = os.path.dirname(target)
    private.makedirs(parent)
    return tempfile.mkdtemp(prefix=".pages-", dir=parent)


def _cache_decoded(image_dir: str, paths: StatePaths) -> None:
    """Decode the images the wrapper's check reads, for it (shim/criu/guard.py, "the decode cache").
    Best effort: without an entry the wrapper decodes the image itself, and refuses what it cannot."""
    with contextlib.suppress(SnapshotError, OSError):
        criu_guard.cache_decoded(image_dir, paths.image_cache())


def opener_for(
    config: SnapshotConfig,
    keys: KeyProvider | None,
    namespace: str,
    *,
    other_namespace_ok: bool = False,
    use: KeyUse | None = None,
) -> Opener | None:
    """How to open an encrypted snapshot restored into `namespace` (None: it is stored in clear).

    A snapshot sealed for another namespace is refused unless the caller has established that this
    restore is allowed there (`other_namespace_ok`, e.g. a grant verified with the signature); the
    key used is always the one of the namespace that sealed it, which the wrapped keys are bound to.
    `use`: the pod and snapshot the key is for (the key broker checks them).
    """
    enc = config.encryption
    if enc is None:
        return None
    if enc.namespace != namespace and not other_namespace_ok:
        raise PermissionDenied(
            f"the snapshot is encrypted for namespace {enc.namespace!r} and cannot be restored into {namespace!r}",
            hint=f"restore it into {enc.namespace!r}, or have that namespace grant the restore",
        )
    if keys is None:
        raise FailedPrecondition(
            f"the snapshot is encrypted for namespace {enc.namespace!r} and no key store is configured",
            hint="restore it with the agent that holds the namespace keys (--key-dir for the standalone agent)",
        )
    try:
        key = keys.namespace_key(enc.namespace, create=False, key_id=enc.key_id, use=use)
    except NotFound as e:
        raise FailedPrecondition(
            f"the snapshot is encrypted with key {enc.key_id} of namespace {enc.namespace!r}, "
            f"which this cluster does not have: {e.message}",
            hint="restore it in the cluster that took it, or restore the key from a backup of the key Secret",
        ) from None
    return Opener(enc, key)


def _fetch_pages(
    registry: Registry,
    ref: Reference,
    record: ContainerRecord,
    pages_dir: str,
    count: Callable[[int], None] | None,
    opener: Opener | None,
    stop: threading.Event,
) -> float:
    """The container's page files rebuilt from their chunks in `pages_dir`; returns the milliseconds."""
    t = time.monotonic()
    fetch_chunks(registry, ref, record.pages, pages_dir, on_bytes=count, opener=opener, cancelled=stop)
    return (time.monotonic() - t) * 1000


def _checkpoint_dir(record: ContainerRecord, target: str) -> int:
    """The extracted layer's checkpoint/ (made if the layer has none), opened; refused where the layer
    made it something else than a directory, or carries one of the page files itself."""
    cp = os.path.join(target, C.CHECKPOINT_DIRECTORY)
    with contextlib.suppress(FileExistsError):
        os.mkdir(cp, 0o700)
    try:
        fd = os.open(cp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        what = "a symlink" if e.errno == errno.ELOOP else "not a directory"
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeArchive(
                f"container {record.name!r}: {C.CHECKPOINT_DIRECTORY}/ in its layer is {what}",
                hint="the snapshot is corrupted or was crafted; do not restore it",
            ) from e
        raise
    for f in record.pages:
        try:
            os.stat(f.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        os.close(fd)
        raise UnsafeArchive(
            f"{f.name} is both in the container layer and stored as chunks",
            hint="the snapshot is corrupted or was crafted; do not restore it",
        )
    return fd


def _place_pages(record: ContainerRecord, pages_dir: str, target: str) -> None:
    """Link the rebuilt page files into the extracted layer's checkpoint/ (_checkpoint_dir)."""
    dst = _checkpoint_dir(record, target)
    try:
        src = os.open(pages_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except BaseException:
        os.close(dst)
        raise
    try:
        for f in record.pages:
            try:
                os.link(f.name, f.name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
            except FileExistsError:
                raise UnsafeArchive(
                    f"{f.name} is both in the container layer and stored as chunks",
                    hint="the snapshot is corrupted or was crafted; do not restore it",
                ) from None
            os.unlink(f.name, dir_fd=src)
    finally:
        os.close(src)
        os.close(dst)


def _extract_fresh(
    blob_path: str, target: str, limits: ExtractLimits | None = None, opener: Opener | None = None, digest: str = ""
) -> None:
    shutil.rmtree(target, ignore_errors=True)
    private.makedirs(target)  # staged/ and staged/by-id too: root's alone
    with open(blob_path, "rb") as f, _opened(f, opener, digest) as source, open_zstd_reader(source) as reader:
        safe_extract(reader, target, limits=limits or ExtractLimits())


@contextlib.contextmanager
def _opened(f: Any, opener: Opener | None, digest: str) -> Iterator[Any]:
    """The layer's plaintext stream: the file itself, or decrypted segment by segment (each authenticated
    before a byte of it is returned); a failed authentication names the layer."""
    try:
        yield f if opener is None else opener.reader(digest, f)
    except DecryptionFailed as e:
        if digest in e.message:
            raise
        raise DecryptionFailed(f"layer {digest}: {e.message}", hint=e.hint) from None


@dataclass(frozen=True)
class VolumeTarget:
    """A pod volume directory: `root` is a trusted host dir (the kubelet's root, followed as set up);
    `rel` below it is opened without following any link (shim/host/safefs.py), since the pod's
    containers can write there."""

    root: str
    rel: str


def _extract_volume(
    blob_path: str, name: str, target: str | VolumeTarget, opener: Opener | None = None, digest: str = ""
) -> None:
    """Extract volume `name` of the volumes layer straight into the target directory's fd.

    Every write below it goes through O_NOFOLLOW directory fds (safe_extract), so links the pod's
    containers may plant in their volume (a racing ephemeral container, say) are replaced, never
    followed; entries already there are replaced by the snapshot's.
    """
    if isinstance(target, str):
        os.makedirs(target, exist_ok=True)
        parent, leaf = os.path.split(os.path.normpath(target))
        target = VolumeTarget(parent or "/", leaf)
    with (
        safefs.opened_dir(target.root, target.rel) as fd,
        open(blob_path, "rb") as f,
        _opened(f, opener, digest) as source,
        open_zstd_reader(source) as reader,
    ):
        safe_extract(reader, fd, only=name, overwrite=True)


def restore(
    req: RestoreRequest,
    *,
    containerd: Any,
    registry: Registry,
    paths: StatePaths,
    namespace: str,
    on_phase: PhaseFn | None = None,
    on_bytes: BytesFn | None = None,
    clock: Callable[[], float] = time.monotonic,
    keys: KeyProvider | None = None,
    key_namespace: str | None = None,
) -> RestoreResult:
    """Restore `req.source` as new containers; an encrypted snapshot opens only with the key of
    `key_namespace` (default: the containerd `namespace`) from `keys`."""
    phase = on_phase or (lambda _p: None)
    t0 = clock()
    timings: dict[str, float] = {}
    phase("resolve")
    plan = _resolve(req, containerd, registry)
    opener = opener_for(plan.config, keys, key_namespace if key_namespace is not None else namespace)
    timings["resolve_ms"] = (clock() - t0) * 1000

    phase("download")
    t_dl = clock()
    staged = [paths.staged_by_id(cid) for cid in req.new_ids]
    where = f"{getattr(containerd, 'address', '')} {namespace}"
    if req.lazy:  # what an earlier lazy restore killed outright left running: ended before a new one
        for cid in end_orphaned(os.path.dirname(staged[0]), lambda c: containerd.kill_task(c, 9, all=True), where):
            log.warning("ended container %s: the lazy restore serving its pages was killed outright", cid)
    lazy, eager_because = _lazy_slots(req, plan.config)
    early = (
        _EarlyCreate.start(containerd, req, plan, staged, namespace, paths, clock, two_phase=req.early_restore)
        if req.early_create and not lazy  # a lazy staging is short: its daemons listen before any create
        else None
    )
    on_images = early.images_staged if early is not None and req.early_restore else None
    try:
        stages = stage_artifact(
            plan.artifact,
            staged,
            registry=registry,
            paths=paths,
            volume_targets=req.volumes,
            on_bytes=on_bytes,
            opener=opener,
            timings=timings,
            on_images=on_images,
            lazy=lazy > 0,
        )
    except BaseException as e:
        give_slot(lazy)
        if early is not None:
            with contextlib.suppress(OSError):  # the staging error is the one to report
                early.abandon(f"{type(e).__name__}: {e}")
        raise
    give_slot(lazy - len(stages))  # containers staged eagerly after all
    timings["download_ms"] = (clock() - t_dl) * 1000

    phase("restore")
    t_run = clock()
    serving: NodeLazyPhase | None = None
    try:
        if stages:  # each daemon listens in its staged dir before its container is created
            try:
                mark_served([st.staged_dir for st in stages], where)
                criu = criu_for_daemon()
                criu_version = hostfacts.criu_version(hostfacts.HostProbe(criu=criu))
            except BaseException:
                give_slot(len(stages))  # no session took them
                raise
            by_dir = dict(zip(staged, req.new_ids, strict=True))
            serving = NodeLazyPhase(
                [(by_dir[st.staged_dir], st) for st in stages],
                criu=criu,
                criu_version=criu_version,
                kill=lambda cid: containerd.kill_task(cid, 9, all=True),
            )
            serving.start()  # a failure closes the sessions started and gives back the others' slots
        results = early.finish() if early is not None else None
        timings["created_during_download"] = float(results is not None)
        if results is None:  # not tried, or given up before the data was complete: in order, now
            results = _create_all(containerd, req, plan, staged, namespace)
    except BaseException:
        if serving is not None:
            serving.close()
        raise
    finally:
        for sdir in staged:  # a lazily restored one is aside already (lazy_used_dir), its session's
            shutil.rmtree(sdir, ignore_errors=True)
    timings["restore_ms"] = (clock() - t_run) * 1000
    timings["total_ms"] = (clock() - t0) * 1000
    return RestoreResult(
        plan.artifact.reference, results, plan.config, timings, plan.trust_reason, serving, eager_because
    )


def _lazy_slots(req: RestoreRequest, config: SnapshotConfig) -> tuple[int, str]:
    """How many of the node's lazy slots this restore took (its containers with page files), and why a
    lazy restore asked for is eager: none to serve lazily, or the node serves LAZY_SLOTS already."""
    if not req.lazy:
        return 0, ""
    paged = sum(1 for c in config.containers if c.pages)
    if not paged:
        return 0, "the snapshot's memory is in its layers (a small dump): nothing to fetch later"
    if not take_slots(paged):
        return 0, f"this process serves {LAZY_SLOTS} lazy restores already"
    return paged, ""


@dataclass(frozen=True)
class _Plan:
    """What a restore found out before downloading anything: the artifact, its verified provenance and
    the image (chain id) each new container is created from."""

    artifact: Artifact
    trust_reason: str
    chain_ids: list[str]

    @property
    def config(self) -> SnapshotConfig:
        return self.artifact.config


def _resolve(req: RestoreRequest, containerd: Any, registry: Registry) -> _Plan:
    """Everything checked before a byte is downloaded: names, the wrapper, the signature, the shape of
    the request against the snapshot, this node, the names free in containerd, the images present."""
    for cid in req.new_ids:
        check_key(cid, "container name")
    if len(set(req.new_ids)) != len(req.new_ids):
        raise InvalidArgument("the new container names must be unique")
    if not os.access(req.runtime_binary, os.X_OK):
        raise FailedPrecondition(
            f"the runtime wrapper {req.runtime_binary!r} is not executable",
            hint="install kubectl-snapshot on this node (it provides ks-runc)",
        )
    # the new names are looked up in containerd while the registry answers (reported in this order)
    aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resolve")
    try:
        taken = aside.submit(_taken_name, containerd, req.new_ids)
        artifact, signatures = load_signed(registry, req.source)
    except BaseException:
        aside.shutdown(wait=False, cancel_futures=True)
        raise
    aside.shutdown(wait=False)
    config = artifact.config
    # Provenance first: a signature by a trusted key of exactly this digest, agreeing with the config.
    # A node-level restore is an operator's (root) action: no namespace binding here (see restores.py).
    pod_uid = config.pod.uid if config.pod is not None else ""
    origin_ns = config.pod.namespace if config.pod is not None else config.namespace
    verdict = verify_for_restore(registry, artifact.reference, origin_ns, pod_uid, req.trust, signatures)
    if len(req.new_ids) != len(config.containers):
        raise InvalidArgument(
            f"the snapshot has {len(config.containers)} container(s) "
            f"({', '.join(c.name for c in config.containers)}) but {len(req.new_ids)} new name(s) were given",
            hint="give one new name per snapshotted container, in that order",
        )
    if len(req.volumes) != len(config.volumes):
        raise InvalidArgument(
            f"the snapshot has {len(config.volumes)} volume(s) but {len(req.volumes)} --volume dir(s) were given",
            hint="pass one --volume HOSTDIR per snapshotted volume, in order",
        )
    problems = hostfacts.preflight_problems(config.host, hostfacts.gather_cached())
    if problems:
        raise FailedPrecondition(
            "this node cannot restore the snapshot: " + "; ".join(problems),
            hint="restore on a node like the one the snapshot was taken on",
        )
    existing = taken.result()
    if existing is not None:
        raise FailedPrecondition(f"a container named {existing!r} already exists", hint="choose another name")
    return _Plan(artifact, verdict.reason, [_check_image(containerd, rec) for rec in config.containers])


def _taken_name(containerd: Any, new_ids: Sequence[str]) -> str | None:
    """The first of `new_ids` containerd already has, else None."""
    for cid in new_ids:
        try:
            containerd.get_container(cid)
        except NotFound:
            continue
        return cid
    return None


def _create_all(
    containerd: Any, req: RestoreRequest, plan: _Plan, staged: Sequence[str], namespace: str
) -> list[tuple[str, int]]:
    """Create the restored containers in order, all or none: one that fails removes those before it."""
    created: list[str] = []
    results: list[tuple[str, int]] = []
    try:
        for rec, cid, chain, sdir in zip(plan.config.containers, req.new_ids, plan.chain_ids, staged, strict=True):
            created.append(cid)
            pid = _create_restored(containerd, req, rec, cid, chain, sdir, namespace, plan.config)
            results.append((cid, pid))
    except BaseException:
        for cid in created:
            with contextlib.suppress(SnapshotError):
                containerd.remove_container(cid)
        raise
    return results


class _EarlyCreate:
    """The restored containers created, in a thread, while their data downloads: containerd starts each
    task's shim and the runtime wrapper meanwhile, and the hook's `create` waits at the container's staging
    gate (shim/engine/staging.py) until the staged data is complete. Staging that fails answers the gates
    with its error: the hooks refuse, and _create_all removes what it created."""

    def __init__(self, gates: list[StagingGate], clock: Callable[[], float]) -> None:
        self.gates = gates
        self.clock = clock
        self.results: list[tuple[str, int]] | None = None
        self.error: BaseException | None = None
        self.failed_at = self.answered_at = 0.0
        self.thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        containerd: Any,
        req: RestoreRequest,
        plan: _Plan,
        staged: Sequence[str],
        namespace: str,
        paths: StatePaths,
        clock: Callable[[], float],
        *,
        two_phase: bool = True,
    ) -> _EarlyCreate | None:
        gates: list[StagingGate] = []
        try:
            for cid in req.new_ids:
                gates.append(StagingGate(paths.staging_gate(cid), two_phase=two_phase))
        except OSError:
            for g in gates:
                g.close()
            return None  # no gate, no early create: the containers are created after the download
        early = cls(gates, clock)

        def run() -> None:
            try:
                early.results = _create_all(containerd, req, plan, staged, namespace)
            except BaseException as e:  # handed to the restore's own thread
                early.error, early.failed_at = e, clock()

        early.thread = threading.Thread(target=run, name="early-create", daemon=True)
        early.thread.start()
        return early

    def _end(self, state: str, message: str = "") -> None:
        self.answered_at = self.clock()
        try:
            for g in self.gates:
                g.answer(state, message)
        except OSError:  # unanswered: let go of the gates, and a waiting hook refuses at once
            for g in self.gates:
                g.close()
            self.gates = []
            raise
        finally:
            if self.thread is not None:
                self.thread.join()
            for g in self.gates:
                g.close()

    def images_staged(self) -> None:
        """All but the page files is staged: each hook may check its images and start `runc restore`,
        whose CRIU waits at the gate's pages lock for finish() (shim/engine/staging.py, "two phases")."""
        for g in self.gates:
            g.answer_images()

    def abandon(self, why: str) -> None:
        """Staging failed: the waiting hooks refuse, the containers created so far are removed."""
        self._end(FAILED, why)

    def finish(self) -> list[tuple[str, int]] | None:
        """The staged data is complete: the containers as created and started; None when their creation
        failed before the data was complete (a hook that gave up waiting, say): the caller creates them
        again now. A failure after it is the restore's."""
        self._end(READY)
        if self.error is None:
            return self.results
        if self.failed_at < self.answered_at:
            return None
        raise self.error


def _check_image(containerd: Any, rec: ContainerRecord) -> str:
    try:
        image = containerd.get_image(rec.image)
    except NotFound:
        raise FailedPrecondition(
            f"image {rec.image!r} of container {rec.name!r} is not on this node",
            hint=f"pull or import {rec.image} (digest {rec.image_digest}) into this containerd first",
        ) from None
    if rec.image_digest and image.target.digest != rec.image_digest:
        raise FailedPrecondition(
            f"image {rec.image!r} on this node is {image.target.digest}, the snapshot was taken on {rec.image_digest}",
            hint="restore needs the exact image the container ran; pull it by digest",
        )
    return str(containerd.image_chain_id(rec.image))


def restored_spec(
    rec: ContainerRecord, new_id: str, namespace: str, config: SnapshotConfig, volume_targets: Sequence[str]
) -> dict[str, Any]:
    """The recorded runtime spec, adapted to the new container: cgroup path, volume bind mounts."""
    spec: dict[str, Any] = copy.deepcopy(dict(rec.spec))
    # Format v3 stores no environment (the restored process has its own, from memory); processes
    # exec'd into the container later get a plain PATH.
    process = spec.setdefault("process", {})
    if isinstance(process, dict):
        process.setdefault("env", [DEFAULT_PATH_ENV])
    linux = spec.setdefault("linux", {})
    linux["cgroupsPath"] = f"/{namespace}/{new_id}"
    remap = {v.source: t for v, t in zip(config.volumes, volume_targets, strict=True)}
    for m in spec.get("mounts", []):
        if m.get("source") in remap:
            m["source"] = remap[m["source"]]
    for ns in linux.get("namespaces", []):
        if ns.get("path"):
            raise FailedPrecondition(
                f"container {rec.name!r} joined an existing {ns.get('type')} namespace ({ns['path']}), "
                "which cannot be recreated on restore",
                hint="snapshot containers that own their namespaces, or restore the pod through Kubernetes",
            )
    return spec


def _create_restored(
    containerd: Any,
    req: RestoreRequest,
    rec: ContainerRecord,
    cid: str,
    chain_id: str,
    staged: str,
    namespace: str,
    config: SnapshotConfig,
) -> int:
    from shim.containerd.client import RuncOptions  # the adapter's value type

    spec = restored_spec(rec, cid, namespace, config, req.volumes)
    # Under a lease until the container holds it: a snapshot nothing references yet is garbage to a
    # collection that containerd runs meanwhile (after another container's removal, say), which left
    # the task's rootfs mount without its directories in a benchmark run.
    with containerd.lease():
        mounts = containerd.prepare_snapshot(req.snapshotter, cid, chain_id)
        containerd.create_container(
            cid,
            image=rec.image,
            spec=spec,
            snapshotter=req.snapshotter,
            snapshot_key=cid,
            runc_options=RuncOptions(binary_name=req.runtime_binary, root=req.runc_root),
        )
    os.makedirs(req.log_dir, exist_ok=True)
    log = "file://" + os.path.join(req.log_dir, f"{namespace}-{cid}.log")
    try:
        containerd.create_task(cid, rootfs=mounts, stdout=log, stderr=log)
    except SnapshotError as e:
        tail = _read_tail(os.path.join(staged, C.RESTORE_LOG_FILE))
        raise CriuFailed(
            f"restoring container {rec.name!r} as {cid!r} failed: {e.message}",
            hint="see the CRIU restore log below; the snapshot itself is unchanged in the registry",
            details=tail or e.details,
        ) from e
    return int(containerd.start_task(cid))


def _read_tail(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return log_tail(f.read())
    except OSError:
        return None
