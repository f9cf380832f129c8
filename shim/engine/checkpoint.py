"""Checkpoint a group of containers (a pod's containers) into one OCI artifact in a registry.

Consistency: every container is frozen (its cgroup freezer, written directly or through containerd)
before the first is dumped, and none runs again until the last dump and the capture of the writable
layers and volumes are done.
Safety: if anything fails before the snapshot is safely in the registry, every container is resumed and
keeps running; with ``stop`` the containers stay frozen while the artifact is uploaded and are killed
only once the manifest is in the registry.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from kubectl_snapshot.adapters.signatures import PendingSignature, push_signature_blobs
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import freeze as freeze_plan
from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.chunks import has_deltas
from kubectl_snapshot.core.diskspace import DUMP, Ask
from kubectl_snapshot.core.dumpspace import dump_bytes
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, SnapshotError, Unavailable
from kubectl_snapshot.core.model import (
    ContainerRecord,
    HostFacts,
    PodRecord,
    SnapshotConfig,
    VolumeRecord,
    stored_runtime_spec,
)
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import Origin, SigningKey
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Sealer
from shim.engine.hottraces import TRACES
from shim.engine.node_ports import Containerd, Freezer, FreezerFor, Registry
from shim.engine.package import (
    PackagedBlob,
    package_container,
    package_volumes,
    progress_counter,
    tree_bytes,
)
from shim.engine.pageindex import PageIndex, scope_key
from shim.engine.publish import CheckpointResult, dump_stats, push_snapshot
from shim.engine.staging import StatePaths
from shim.files.archive import tar_directories
from shim.files.rootfs_diff import capture_rootfs_diff, upperdir_from_mounts
from shim.host import diskspace, memwork, private, reaper, safefs
from shim.host import facts as hostfacts
from shim.host.diskspace import DiskLedger

PhaseFn = Callable[[str], None]
BytesFn = Callable[[int, int], None]  # (new bytes, total bytes)
UnixLinksFn = Callable[[list[int]], Sequence[Any]]  # init pids -> shim.net.unixpeers.CrossLink list
NetLockFn = Callable[[list[int]], AbstractContextManager[None]]  # init pids -> shim.net.dumplock.pod_network_locked
CriuLockFn = Callable[[list[int]], AbstractContextManager[Any]]  # init pids -> shim.net.criulock.lifted_after_failure
CriuCureFn = Callable[[list[int]], AbstractContextManager[Any]]  # init pids -> shim.criu.parasite.cured_after_failure
VOLUME_ENTRIES = 200_000  # a volume with more entries than this is not sized before its tar (the walk is not free)


@dataclass(frozen=True)
class CheckpointRequest:
    containers: Sequence[str]  # containerd container ids, in order
    target: Reference  # where to push (repository + tag)
    names: Sequence[str] | None = None  # logical names (pod container names); default: the ids
    volumes: Sequence[str] = ()  # host directories that stand for the group's emptyDir volumes
    volume_names: Sequence[str] | None = None  # names for them in the artifact; default vol-0, vol-1...
    stop: bool = False
    group: str | None = None
    namespace: str = ""
    pod: PodRecord | None = None
    tcp_established: bool = True
    file_locks: bool = True
    keep_work: bool = False
    probe_budgets: Sequence[freeze_plan.ProbeBudget] = ()  # the pod's liveness budgets (core/freeze.py)
    ignore_liveness: bool = False  # snapshot even if the freeze may outlast a liveness probe's budget
    # provenance (format v3): the agent's key signs the pushed manifest digest with the origin below;
    # without a key the snapshot is unsigned (restores then refuse it unless a policy trusts those)
    signing_key: SigningKey | None = None
    cluster: str = ""  # the cluster's identity (uid of kube-system), from the agent's trust settings
    node: str = ""


def _now_rfc3339() -> str:
    return T.rfc3339(time.time())


def _validate(req: CheckpointRequest) -> list[str]:
    if not req.containers:
        raise InvalidArgument("no containers to checkpoint", hint="name at least one container")
    if len(set(req.containers)) != len(req.containers):
        raise InvalidArgument("a container is named twice")
    names = list(req.names) if req.names is not None else list(req.containers)
    if len(names) != len(req.containers) or len(set(names)) != len(names):
        raise InvalidArgument("container names must be unique, one per container")
    for v in req.volumes:
        if not os.path.isdir(v):
            raise InvalidArgument(f"volume directory {v!r} does not exist", hint="pass an existing host directory")
    if req.volume_names is not None and len(req.volume_names) != len(req.volumes):
        raise InvalidArgument("one volume name per volume directory")
    return names


def checkpoint(
    req: CheckpointRequest,
    *,
    containerd: Containerd,
    registry: Registry,
    paths: StatePaths,
    on_phase: PhaseFn | None = None,
    on_bytes: BytesFn | None = None,
    clock: Callable[[], float] = time.monotonic,
    host: HostFacts | None = None,
    before_stop: Callable[[], None] | None = None,
    freezer_for: FreezerFor | None = None,
    memory_of: Callable[[int], int] | None = None,
    on_plan: Callable[[freeze_plan.FreezePlan], None] | None = None,
    sealer: Sealer | None = None,
    unix_links: UnixLinksFn | None = None,
    net_lock: NetLockFn | None = None,
    disk: DiskLedger | None = None,
    criu_lock: CriuLockFn | None = None,
    criu_cure: CriuCureFn | None = None,
) -> CheckpointResult:
    """Checkpoint `req.containers` together and push one artifact; see the module docstring.

    `before_stop` (with ``stop``) runs after the push and before the frozen containers are killed,
    e.g. to delete the pod object so that the kubelet does not restart them. `freezer_for` gives a
    task's cgroup freezer to write directly (shim.host.freezer; ~0.4 ms instead of a containerd Pause/Resume
    round trip of ~11 ms each way); without it, or where it gives None, containerd pauses.
    `memory_of` gives a task's memory (shim.host.freezer.task_memory): the freeze's expected length and
    deadline follow from it (core/freeze.py), checked against the pod's liveness budgets before
    anything is frozen; a freezer from shim.freeze_guard enforces the deadline.
    `sealer` (core/sealing.py): encrypt every layer and chunk for its namespace (get the namespace key
    before calling, so that a key problem fails before anything is frozen).
    `unix_links` finds Unix socket connections between the containers (shim.net.unixpeers), which CRIU
    cannot dump one container at a time: the snapshot is refused before anything is frozen.
    `net_lock` holds the network the containers share locked while they are dumped one after the
    other (shim.net.dumplock), so that both ends of a connection between them are dumped in agreement.
    `criu_lock` lifts the network lock a CRIU killed mid-dump left in the containers' namespaces
    (shim.net.criulock: tables listed before the freeze, lifted on failure before the thaw).
    `criu_cure` unmaps what CRIU's parasite left in the tasks of a dump that failed, once they are thawed
    (shim.criu.parasite: its mappings listed before the freeze).
    `disk` is the ledger a dump on disk reserves its bytes in (default: the node's, shim/host/diskspace.py).
    """
    names = _validate(req)
    phase = on_phase or (lambda _p: None)
    t0 = clock()
    pre = _preflight(
        req, names, containerd=containerd, registry=registry, host=host, freezer_for=freezer_for,
        memory_of=memory_of, unix_links=unix_links,
    )  # fmt: skip
    if on_plan is not None:
        on_plan(pre.plan)
    preflight_ms = (clock() - t0) * 1000

    snapshot_id = f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
    timings: dict[str, float] = {"preflight_ms": preflight_ms}
    frozen: list[str] = []
    layers = _layers_bytes(pre)
    with contextlib.ExitStack() as held:
        # the dump in memory where it clearly fits (shim/host/memwork.py), else in the state dir on disk, where
        # its bytes are promised first (shim/host/diskspace.py): a refusal comes before anything is frozen
        in_memory = held.enter_context(memwork.reserve(paths.root, snapshot_id, _expected_dump(req, pre, layers)))
        if in_memory is None:
            held.enter_context((disk or diskspace.NODE).reserve(paths.root, _dump_ask(req, names, pre, layers)))
        work = in_memory or paths.work_dir(snapshot_id)
        if in_memory is None:
            private.makedirs(work)  # work/ too: 0700, as everything of the dump (shim/host/private.py)
        try:
            frozen, volume_tar = _freeze_and_dump(
                req, names, pre, containerd, work, phase, clock, timings, net_lock, criu_lock, criu_cure
            )
            # Everything below runs after the resume: compression, hashing and upload never extend the freeze.
            phase("upload")
            result = _package_and_push(
                req, names, pre, registry, work, on_bytes, sealer, volume_tar, clock, timings, paths
            )
        except BaseException:
            if frozen:
                _resume_all(containerd, frozen, pre.direct)
            raise
        finally:
            if not req.keep_work:
                # no longer a record of frozen containers (recover_interrupted) from here on; the dump
                # itself is removed after the answer (shim/host/reaper.py; the memory area's by memwork)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(work, FROZEN_FILE))
                if in_memory is None:
                    reaper.remove_later(work)
    result.work_in_memory = in_memory is not None

    if req.stop:
        phase("stop")
        t_stop = clock()
        _stop_frozen(containerd, registry, frozen, pre.direct, result.reference, before_stop)
        timings["stop_ms"] = (clock() - t_stop) * 1000
    timings["total_ms"] = (clock() - t0) * 1000
    result.timings_ms = timings
    result.frozen_by = " + ".join(
        sorted({"cgroup freezer" if c in pre.direct else "containerd" for c in req.containers})
    )
    result.plan = pre.plan
    return result


@dataclass
class _Preflight:
    """What the checks before the freeze found: nothing of the workload has been touched yet."""

    infos: list[Any]
    upperdirs: list[str | None]
    pids: list[int]
    direct: dict[str, Freezer]  # the containers frozen through their cgroup (the rest: containerd pauses)
    image_digests: list[str]
    host: HostFacts
    plan: freeze_plan.FreezePlan
    memory: int | None = None  # the containers' resident memory (None: not measured)


def _layers_bytes(pre: _Preflight) -> int | None:
    """What the writable layers hold (None: a layer too large or too busy to size)."""
    total = 0
    for upper in pre.upperdirs:
        size = memwork.tree_size(upper) if upper is not None else 0
        if size is None:
            return None
        total += size
    return total


def _expected_dump(req: CheckpointRequest, pre: _Preflight, layers: int | None) -> int | None:
    """The dump's expected bytes (memory + writable layers) where they are known and the dump may go to
    memory: not for volumes (their size is the tenant's), nor a work dir kept for inspection."""
    if pre.memory is None or layers is None or req.volumes or req.keep_work:
        return None
    return pre.memory + layers


def _dump_ask(req: CheckpointRequest, names: list[str], pre: _Preflight, layers: int | None) -> Ask:
    """The disk a dump takes, from what is known of it: the containers' memory, their writable layers and
    the volumes' contents (each unknown one counts nothing; the slack covers CRIU's other images and the
    tars' headers)."""
    volumes = sum(memwork.tree_size(v, VOLUME_ENTRIES) or 0 for v in req.volumes)
    what = f"the dump of pod {req.namespace}/{req.group}" if req.namespace else f"the dump of {req.group or names[0]}"
    return Ask(
        need=dump_bytes((pre.memory or 0) + (layers or 0) + volumes),
        what=what,
        hint="free space on the node's disk (the agent's state dir) or snapshot the pod when fewer snapshots and "
        "restores run on its node; nothing was frozen: the pod keeps running",
        kind=DUMP,
        namespace=req.namespace,
    )


def _preflight(
    req: CheckpointRequest,
    names: list[str],
    *,
    containerd: Containerd,
    registry: Registry,
    host: HostFacts | None,
    freezer_for: FreezerFor | None,
    memory_of: Callable[[int], int] | None,
    unix_links: UnixLinksFn | None,
) -> _Preflight:
    """Before touching the workload: the containers run, the registry answers, CRIU is there, and the
    freeze fits the pod's liveness budgets (raises otherwise).

    The registry's answer and the images' digests are asked for on a thread beside the checks of the
    containers (each a round trip of its own); their failures are reported in the order of the checks."""
    infos, upperdirs, pids = [], [], []
    direct: dict[str, Freezer] = {}
    memory = 0
    aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="preflight")
    try:  # a refusal below does not wait for the registry's answer
        ping = aside.submit(registry.ping, req.target)
        digests: list[Future[str]] = []
        for i, cid in enumerate(req.containers):
            info = containerd.get_container(cid)
            digests.append(aside.submit(_image_digest, containerd, info.image))
            task = containerd.get_task(cid)
            if task is None or task.status not in ("running",):
                state = "no task" if task is None else task.status
                raise FailedPrecondition(
                    f"container {cid!r} is not running ({state})",
                    hint="only running containers can be snapshotted",
                )
            fz = freezer_for(task.pid) if freezer_for is not None else None
            if fz is not None:
                direct[cid] = fz
            if memory_of is not None:
                memory += memory_of(task.pid)
            _refuse_runtime_shm(info.spec, task.pid, names[i])
            infos.append(info)
            pids.append(task.pid)
            upperdirs.append(_upperdir(containerd, info))
        if unix_links is not None:
            _refuse_unix_links(unix_links(pids), names)
        if host is None:
            version, _ = containerd.version()
            host = hostfacts.gather_cached(containerd_version=version)
        ping.result()
        image_digests = [d.result() for d in digests]
    finally:
        aside.shutdown(wait=False, cancel_futures=True)
    if not host.criu_version:
        raise FailedPrecondition("CRIU is not installed on this node", hint="run hack/install-node-deps.sh")
    plan = freeze_plan.plan(
        memory, stop=req.stop, budgets=req.probe_budgets, ignore_liveness=req.ignore_liveness
    )  # raises when a liveness probe would restart a container before the freeze ends
    return _Preflight(
        infos, upperdirs, pids, direct, image_digests, host, plan, memory if memory_of is not None else None
    )


def _freeze_and_dump(
    req: CheckpointRequest,
    names: list[str],
    pre: _Preflight,
    containerd: Containerd,
    work: str,
    phase: PhaseFn,
    clock: Callable[[], float],
    timings: dict[str, float],
    net_lock: NetLockFn | None,
    criu_lock: CriuLockFn | None = None,
    criu_cure: CriuCureFn | None = None,
) -> tuple[list[str], str | None]:
    """Freeze every container, dump them (under the shared network's lock), capture the volumes, and
    thaw them again unless `stop`. Returns the containers still frozen (with `stop`) and the volume tar.
    On any failure every container frozen so far is thawed before the error goes on."""
    # A standalone command's private freeze guard may still be starting (a Python process): wait for
    # it while the pod runs, so that neither the freeze nor its clock includes that start-up.
    for fz in pre.direct.values():
        fz.ready()
    # Written before the first pause: if this process dies while containers are frozen, the next
    # agent start (recover_interrupted) finds the list and thaws them. Never lose the workload.
    with private.create(os.path.join(work, FROZEN_FILE)) as f:
        json.dump(list(req.containers), f)
    frozen: list[str] = []
    phase("freeze")  # where the dump gate is waited for
    # entered before the clock starts (its listing costs the freeze nothing), left after the thaw below:
    # on a failure, what CRIU's parasite left is unmapped from the running tasks
    with criu_cure(pre.pids) if criu_cure is not None else contextlib.nullcontext():
        t_freeze = clock()
        try:
            # entered before the first freeze (its listing costs the freeze nothing), left before the thaw
            with criu_lock(pre.pids) if criu_lock is not None else contextlib.nullcontext():
                for cid in req.containers:
                    _freeze(containerd, pre.direct, cid, pre.plan.deadline_s)
                    frozen.append(cid)
                timings["freezing_ms"] = (clock() - t_freeze) * 1000
                phase("dump")
                _test_hold([pre.direct[c] for c in frozen if c in pre.direct])
                with net_lock(pre.pids) if net_lock is not None else contextlib.nullcontext():
                    _dump_all(containerd, req, names, pre.upperdirs, work, clock, timings)
                t_volumes = clock()
                volume_tar = _capture_volumes(req, work) if req.volumes else None
                timings["volumes_ms"] = (clock() - t_volumes) * 1000
                timings["dump_ms"] = (clock() - t_freeze) * 1000
        except BaseException:
            _resume_all(containerd, frozen, pre.direct)
            raise
    if not req.stop:
        t_thaw = clock()
        _resume_all(containerd, frozen, pre.direct, strict=True)
        timings["thaw_ms"] = (clock() - t_thaw) * 1000
        frozen = []
    timings["freeze_ms"] = (clock() - t_freeze) * 1000
    return frozen, volume_tar


def _package_and_push(
    req: CheckpointRequest,
    names: list[str],
    pre: _Preflight,
    registry: Registry,
    work: str,
    on_bytes: BytesFn | None,
    sealer: Sealer | None,
    volume_tar: str | None,
    clock: Callable[[], float],
    timings: dict[str, float],
    paths: StatePaths | None = None,
) -> CheckpointResult:
    """Compress, hash (and seal) what was dumped, push blobs, config and manifest, and sign it.

    With `paths` page deltas are used (shim/engine/pageindex.py: the node's bases live there)."""
    t_pack, cpu_pack = clock(), time.process_time()  # this process's CPU, all threads: how busy packaging keeps it
    on_raw = progress_counter(on_bytes, tree_bytes(work))
    records, packaged = [], []
    # the dumps' statistics (CRIU's images decoded in Python) are read beside the packaging, which
    # waits on its workers' compression and requests meanwhile
    stats_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dump-stats")
    stats_of = [stats_pool.submit(dump_stats, os.path.join(work, name)) for name in names]
    stats_pool.shutdown(wait=False)
    for cid, name, info, image_digest, stats_future in zip(
        req.containers, names, pre.infos, pre.image_digests, stats_of, strict=True
    ):
        cdir = os.path.join(work, name)
        _write_metadata(cdir, cid, name, info, req)
        # what its processes asked for first after their last restore on this node, if any: in the layer,
        # sealed with it (the addresses tell how their memory is laid out)
        hot = TRACES.recall(req.pod.uid, name) if req.pod is not None and req.pod.uid else ()
        if hot:
            with private.create(os.path.join(cdir, C.HOT_PAGES_FILE)) as f:
                f.write(hotpages.to_bytes(hot).decode())
        index = None
        if paths is not None and os.environ.get(C.ENV_PAGE_DELTAS, "1") != "0":
            key_id = sealer.key.key_id if sealer is not None else None
            # never another pod's bases (shim/engine/pageindex.py); outside Kubernetes, the container's
            owner = req.pod.uid if req.pod is not None and req.pod.uid else f"{req.namespace}/{cid}"
            scope = scope_key(req.target.registry, req.target.repository, owner, name, key_id)
            index = PageIndex.load(paths.page_index(), scope)
        pc = package_container(registry, req.target, cdir, on_raw=on_raw, sealer=sealer, index=index)
        records.append(
            ContainerRecord(
                name=name,
                id=cid,
                image=info.image,
                image_digest=image_digest,
                layer_digest=pc.layer.digest,
                spec=stored_runtime_spec(info.spec),
                tcp_established=req.tcp_established,
                file_locks=req.file_locks,
                stats=stats_future.result(),
                pages=pc.pages,
            )
        )
        packaged.append(pc)
    volumes_layer: PackagedBlob | None = None
    if volume_tar is not None:
        volumes_layer = package_volumes(registry, req.target, volume_tar, on_raw=on_raw, sealer=sealer)
    timings["package_ms"] = (clock() - t_pack) * 1000
    timings["package_cpu_ms"] = (time.process_time() - cpu_pack) * 1000

    config = SnapshotConfig(
        group=req.group or names[0],
        namespace=req.namespace,
        created=_now_rfc3339(),
        containers=tuple(records),
        host=pre.host,
        volumes=tuple(VolumeRecord(name=n, source=src) for n, src in zip(_volume_names(req), req.volumes, strict=True)),
        volumes_layer=volumes_layer.digest if volumes_layer else None,
        stopped=req.stop,
        freeze_ms=timings["freeze_ms"],
        pod=req.pod,
        # a reader that does not know page deltas must refuse, not restore the bases alone
        format_version=C.DELTA_FORMAT_VERSION if any(has_deltas(r.pages) for r in records) else C.FORMAT_VERSION,
    )
    if sealer is not None:
        config = replace(config, encryption=sealer.info(config.blob_digests()))
    t_up = clock()
    key = req.signing_key
    signed: Callable[[Reference], PendingSignature] | None = None
    if key is not None:

        def signed(pinned: Reference) -> PendingSignature:
            t_sign = clock()
            try:
                return push_signature_blobs(registry, pinned, _origin(req, config), key)
            finally:
                timings["sign_ms"] = (clock() - t_sign) * 1000  # beside the config's upload

    result, was_signed = push_snapshot(req.target, config, records, packaged, volumes_layer, registry, signed)
    if was_signed and key is not None:
        result.signed_by = key.public.id
    timings["upload_ms"] = (clock() - t_up) * 1000
    return result


def _stop_frozen(
    containerd: Containerd,
    registry: Registry,
    frozen: list[str],
    direct: Mapping[str, Freezer],
    reference: Reference,
    before_stop: Callable[[], None] | None,
) -> None:
    """`stop`: the snapshot is pushed and verified, then the still-frozen containers are killed. Until
    the kill, any failure thaws them: the pod keeps running rather than being lost."""
    thawed_early = [cid for cid in frozen if cid in direct and not _still_frozen(direct[cid])]
    if thawed_early:  # the freeze guard's deadline passed during the upload: the pod ran on since
        _resume_all(containerd, frozen, direct)
        raise FailedPrecondition(
            f"the pod was thawed before it could be stopped (container {thawed_early[0]!r} passed the freeze's "
            f"deadline during the upload): it keeps running, and {reference} is older than its state",
            hint="snapshot it again; a large pod on a slow registry link may need a faster destination",
        )
    # the registry really has the snapshot, while the pod can still go on
    try:
        verify_pushed(registry, reference)
    except BaseException:
        _resume_all(containerd, frozen, direct)
        raise
    if before_stop is not None:
        try:
            before_stop()
        except BaseException:
            _resume_all(containerd, frozen, direct)
            raise
    for cid in frozen:
        with contextlib.suppress(NotFound):  # already removed by the kubelet: nothing to kill
            containerd.kill_task(cid, signal.SIGKILL, all=True)
    _resume_all(containerd, frozen, direct)  # thaw so that the pending SIGKILL is delivered
    for cid in frozen:
        # The kubelet may already be removing the pod's containers (its object was deleted):
        # a task that is gone is as stopped as one that exited.
        with contextlib.suppress(SnapshotError):
            containerd.wait_task(cid, timeout=30)


def verify_pushed(registry: Registry, reference: Reference) -> None:
    """Before --stop deletes anything: the manifest resolves by its digest and the registry has every
    blob it names (config, layers, chunks). A registry or proxy that acknowledged an upload it did not
    keep is caught here, while the pod still runs."""
    body, _media_type, digest = registry.get_manifest(reference)
    if digest != reference.digest:
        raise Unavailable(
            f"the registry returned manifest {digest} for {reference}",
            hint="the registry does not serve what was pushed; the pod was not stopped",
        )
    manifest = parse_manifest(body)
    missing = [d.digest for d in (manifest.config, *manifest.layers) if not registry.blob_exists(reference, d.digest)]
    if missing:
        raise Unavailable(
            f"the registry lacks {len(missing)} of the {1 + len(manifest.layers)} blobs of {reference} "
            f"right after the push (first: {missing[0]}); the pod was not stopped and keeps running",
            hint="check the registry's storage (or a proxy in front of it), then snapshot again",
            retryable=True,
        )


def _still_frozen(fz: Freezer) -> bool:
    try:
        return fz.frozen()
    except OSError:
        return False


ENV_TEST_FROZEN_HOLD_S = "KUBECTL_SNAPSHOT_TEST_FROZEN_HOLD_S"


def _test_hold(freezers: Sequence[Freezer]) -> None:
    """Tests only (tests/e2e/test_freeze_guard.py sets it on the agent DaemonSet while it runs): stay
    frozen up to this many seconds before dumping, so that a test can kill or stop the agent while a pod
    is frozen; ends early once something else (the freeze guard, at the deadline) thawed the pod."""
    value = os.environ.get(ENV_TEST_FROZEN_HOLD_S, "")
    if not value:
        return
    end = time.monotonic() + min(float(value), 600.0)
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            if freezers and not all(fz.frozen() for fz in freezers):
                return
        time.sleep(0.1)


FROZEN_FILE = "frozen-containers.json"


def _origin(req: CheckpointRequest, config: SnapshotConfig) -> Origin:
    pod = config.pod
    return Origin(
        cluster=req.cluster,
        namespace=pod.namespace if pod is not None else config.namespace,
        pod=pod.name if pod is not None else config.group,
        pod_uid=pod.uid if pod is not None else "",
        node=req.node or (pod.node if pod is not None else ""),
        created=config.created,
        format_version=config.format_version,
    )


def runtime_shm(spec: Mapping[str, Any]) -> bool:
    """Whether the container's /dev/shm is the runtime's (the pod sandbox's tmpfs, which containerd binds
    into every container of the pod) rather than a pod volume, which snapshots capture."""
    for m in spec.get("mounts") or ():
        if m.get("destination") == "/dev/shm":
            return "/volumes/kubernetes.io~" not in str(m.get("source") or "")
    return False


def _refuse_runtime_shm(
    spec: Mapping[str, Any], pid: int, name: str, listdir: Callable[[str], list[str]] = os.listdir
) -> None:
    """Refuse a container that keeps files in the runtime's /dev/shm: the snapshot does not capture that
    tmpfs, and CRIU cannot restore a process whose shared-memory file is gone ("Can't open file
    dev/shm/..."). Said before anything is frozen, with the way out users take anyway for bigger /dev/shm."""
    if not runtime_shm(spec):
        return
    try:  # the container's own view, through its init process (the agent runs with the host's pids)
        held = sorted(listdir(f"/proc/{pid}/root/dev/shm"))
    except OSError:
        return
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise FailedPrecondition(
            f"container {name!r} keeps files in the container runtime's /dev/shm ({shown}), which a snapshot "
            "does not capture: its restore would fail",
            hint="mount an emptyDir with medium: Memory at /dev/shm (snapshots capture it, as every emptyDir); "
            "POSIX shared memory and shm_open() then live in the pod's volume",
        )


def _refuse_unix_links(links: Sequence[Any], names: Sequence[str]) -> None:
    """Refuse a group whose containers are connected by Unix sockets (see shim/net/unixpeers.py)."""
    if not links:
        return
    described = "; ".join(
        f"{names[link.a]!r} and {names[link.b]!r} ({link.kind} socket{', ' + link.name if link.name else ''})"
        for link in links
    )
    raise FailedPrecondition(
        f"containers of the pod are connected to each other by Unix sockets, which cannot be snapshotted: {described}",
        hint="CRIU dumps each container on its own and cannot restore one end of a Unix socket connection "
        "whose other end is in another container; connect such containers over TCP on 127.0.0.1 "
        "(restored on both ends), or reconnect on demand",
    )


def recover_interrupted(
    containerd: Containerd,
    paths: StatePaths,
    freezer_for: FreezerFor | None = None,
    net_unlock: Callable[[list[int]], Any] | None = None,
) -> list[str]:
    """Thaw containers that a killed checkpoint left frozen and drop its work dirs; returns their ids.

    A container frozen through its cgroup freezer directly is "running" to containerd (its shim keeps
    its own state): `freezer_for` finds those. `net_unlock` (shim.net.dumplock.release_leftover) lifts the
    dump's network lock from the namespace those containers share, if it was left.
    """
    root = os.path.dirname(paths.work_dir("x"))
    thawed: list[str] = []
    works = [os.path.join(root, e) for e in sorted(os.listdir(root))] if os.path.isdir(root) else []
    for work in works + memwork.leftovers(paths.root):  # on disk, and in the memory work area
        try:
            with open(os.path.join(work, FROZEN_FILE)) as f:
                cids = [str(c) for c in json.load(f)]
        except (OSError, ValueError):
            cids = []
        pids: list[int] = []
        for cid in cids:
            with contextlib.suppress(SnapshotError, OSError):  # gone, or its cgroup with it: nothing to thaw
                task = containerd.get_task(cid)
                if task is not None:
                    pids.append(task.pid)
                if task is not None and task.status == "paused":
                    containerd.resume_task(cid)
                    thawed.append(cid)
                    continue
                fz = freezer_for(task.pid) if task is not None and freezer_for is not None else None
                if fz is not None and fz.frozen():
                    fz.thaw()
                    thawed.append(cid)
        if net_unlock is not None and pids:
            net_unlock(pids)
        shutil.rmtree(work, ignore_errors=True)
    memwork.tidy(paths.root)
    return thawed


def _image_digest(containerd: Containerd, image: str) -> str:
    if not image:
        return ""
    try:
        return str(containerd.get_image(image).target.digest)
    except SnapshotError:
        return ""


def _dump_all(
    containerd: Containerd,
    req: CheckpointRequest,
    names: Sequence[str],
    upperdirs: Sequence[str | None],
    work: str,
    clock: Callable[[], float] = time.monotonic,
    timings: dict[str, float] | None = None,
) -> None:
    """Dump every (already frozen) container; in parallel for a group, since each CRIU dump is
    mostly one core's work. Every dump has finished, well or not, before the first error is raised,
    so nothing is still being dumped when the caller resumes the group. `timings` gets the longest
    container's CRIU (``criu_ms``: runc checkpoint) and writable-layer capture (``layer_diff_ms``)."""
    steps: dict[str, float] = timings if timings is not None else {}
    jobs = [
        (cid, os.path.join(work, name), upper)
        for cid, name, upper in zip(req.containers, names, upperdirs, strict=True)
    ]
    if len(jobs) == 1:
        _dump_one(containerd, *jobs[0], req, clock, steps)
        return
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1), thread_name_prefix="dump") as pool:
        futures = [pool.submit(_dump_one, containerd, cid, cdir, upper, req, clock, steps) for cid, cdir, upper in jobs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]


def _upperdir(containerd: Containerd, info: Any) -> str | None:
    """The overlay upperdir holding the container's writable layer (None: no rootfs snapshot at all)."""
    if not info.snapshot_key:
        return None
    mounts = containerd.snapshot_mounts(info.snapshotter, info.snapshot_key)
    upper = upperdir_from_mounts([(m.type, m.source, list(m.options)) for m in mounts])
    if upper is None and mounts:
        raise FailedPrecondition(
            f"container {info.id!r} uses snapshotter {info.snapshotter!r} whose rootfs has no overlay upperdir",
            hint="kubectl-snapshot captures writable layers of the overlayfs snapshotter (containerd's default)",
        )
    return upper


def _dump_one(
    containerd: Containerd,
    cid: str,
    cdir: str,
    upper: str | None,
    req: CheckpointRequest,
    clock: Callable[[], float] = time.monotonic,
    steps: dict[str, float] | None = None,
) -> None:
    """CRIU (through runc) dumps the frozen container, then its writable layer is captured, still frozen.
    `upper` is the upperdir the preflight found (a running container's rootfs snapshot does not move):
    no containerd round trip while the workload is frozen."""
    image_path = os.path.join(cdir, C.CHECKPOINT_DIRECTORY)
    private.makedirs(image_path)
    t = clock()
    containerd.checkpoint_task(
        cid,
        image_path=image_path,
        work_path=cdir,
        exit=False,  # with --stop the container is killed only after the push succeeded
        open_tcp=req.tcp_established,
        file_locks=req.file_locks,
    )
    t_diff = clock()
    if upper is not None:
        with private.create_binary(os.path.join(cdir, C.ROOTFS_DIFF_TAR)) as out:
            deleted = capture_rootfs_diff(upper, out)
        with private.create(os.path.join(cdir, C.DELETED_FILES_FILE)) as f:
            json.dump(deleted, f)
    if steps is not None:
        done = clock()
        steps["criu_ms"] = max(steps.get("criu_ms", 0.0), (t_diff - t) * 1000)
        steps["layer_diff_ms"] = max(steps.get("layer_diff_ms", 0.0), (done - t_diff) * 1000)


def _volume_names(req: CheckpointRequest) -> list[str]:
    return list(req.volume_names) if req.volume_names is not None else [f"vol-{i}" for i in range(len(req.volumes))]


def _capture_volumes(req: CheckpointRequest, work: str) -> str:
    """One tar of the volumes, every entry read through O_NOFOLLOW directory fds (shim/host/safefs.py):
    a link the workload planted in its volume is recorded as a link, never followed to a host file."""
    path = os.path.join(work, "volumes.tar")
    fds: list[int] = []
    try:
        for src in req.volumes:
            parent, leaf = os.path.split(os.path.normpath(src))
            fds.append(safefs.open_dir(parent or "/", leaf))
        with private.create_binary(path) as out:
            tar_directories(list(zip(_volume_names(req), fds, strict=True)), out)
    finally:
        for fd in fds:
            os.close(fd)
    return path


def _write_metadata(cdir: str, cid: str, name: str, info: Any, req: CheckpointRequest) -> None:
    with private.create(os.path.join(cdir, C.SPEC_DUMP_FILE)) as f:
        json.dump(stored_runtime_spec(info.spec), f)  # no process.env: it holds resolved secrets
    with private.create(os.path.join(cdir, C.CONFIG_DUMP_FILE)) as f:
        json.dump(
            {
                "id": cid,
                "name": name,
                "rootfsImageName": info.image,
                "runtime": "runc",
                "checkpointedTime": _now_rfc3339(),
            },
            f,
        )
    with private.create(os.path.join(cdir, C.DUMP_OPTIONS_FILE)) as f:
        json.dump({"tcpEstablished": req.tcp_established, "fileLocks": req.file_locks}, f)


def _freeze(containerd: Containerd, direct: dict[str, Freezer], cid: str, deadline_s: float) -> None:
    """Freeze through the cgroup freezer where placed, else (or if that fails) through containerd.

    A guarded freezer that the guard refuses raises a SnapshotError: no unguarded fallback then."""
    fz = direct.get(cid)
    if fz is not None:
        try:
            fz.freeze(deadline_s=deadline_s)
            return
        except OSError:  # TimeoutError included: freeze() thawed it again; containerd takes over
            del direct[cid]
    containerd.pause_task(cid)


def _resume_all(
    containerd: Containerd, cids: Sequence[str], direct: Mapping[str, Freezer], *, strict: bool = False
) -> None:
    """Resume every container; with strict, raise the first failure after trying all."""
    first: BaseException | None = None
    for cid in cids:
        try:
            fz = direct.get(cid)
            if fz is None:
                containerd.resume_task(cid)
            else:
                try:
                    fz.thaw()
                except OSError:
                    containerd.resume_task(cid)  # runc thaws what it sees paused
        except Exception as e:  # keep going: every container must get its chance to run again
            first = first or e
    if strict and first is not None:
        raise first
