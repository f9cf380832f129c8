"""Issue 10 item 5: restore limits, staged-data garbage collection and per-namespace fairness.

stage_artifact runs against a registry fake that records every call: each refusal is shown to happen
before a single blob is fetched. The free-space check uses the real statvfs of tmp_path's filesystem.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.chunks import Chunk, PagesFile
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, Unavailable
from kubectl_snapshot.core.model import ContainerRecord, DumpStats, HostFacts, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, Manifest
from kubectl_snapshot.core.reference import Reference
from shim.controller.fairness import FairScheduler
from shim.controller.restores import DOWNLOAD_GC_S, GC_GRACE_S, RestoreWorker
from shim.controller.settings import NodeSettings
from shim.engine.restore import RestoreLimits, plan_space, stage_artifact
from shim.engine.staging import StatePaths

D = "sha256:" + "a" * 64
CHUNK = "sha256:" + "c" * 64
MIB = 1 << 20


class RecordingRegistry:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        return True  # a HEAD: nothing downloaded

    def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> None:
        self.calls.append(digest)
        raise AssertionError("nothing may be downloaded")


def artifact(*, layer_size: int = MIB, memory: int = 8 * MIB, pages: tuple[PagesFile, ...] = ()) -> Artifact:
    rec = ContainerRecord(
        name="c",
        id="c",
        image="i",
        image_digest="",
        layer_digest=D,
        spec={},
        stats=DumpStats(memory_bytes=memory),
        pages=pages,
    )
    config = SnapshotConfig(group="g", namespace="n", created="", containers=(rec,), host=HostFacts())
    layers = (Descriptor("application/x", D, layer_size),)
    manifest = Manifest(config=Descriptor("application/y", "sha256:" + "b" * 64, 2), layers=layers)
    return Artifact(Reference.parse(f"127.0.0.1:1/x@{D}"), manifest, config)


def reused_chunk_pages(times: int) -> tuple[PagesFile, ...]:
    chunks = tuple(Chunk(i * MIB, MIB, CHUNK, 5000) for i in range(times))
    return (PagesFile("pages-1.img", times * MIB, chunks),)


def stage(tmp_path: Path, art: Artifact, limits: RestoreLimits) -> RecordingRegistry:
    reg = RecordingRegistry()
    paths = StatePaths(str(tmp_path / "state"))
    with pytest.raises(FailedPrecondition) as e:
        stage_artifact(art, [str(tmp_path / "s")], registry=reg, paths=paths, limits=limits)  # type: ignore[arg-type]
    assert reg.calls == []  # refused before any download
    stage.last = e.value  # type: ignore[attr-defined]
    return reg


def test_declared_sizes_over_the_limit_are_refused_before_downloading(tmp_path: Path) -> None:
    stage(tmp_path, artifact(layer_size=10 * MIB), RestoreLimits(max_bytes=5 * MIB, reserve_bytes=0))
    assert "over this node's limit" in stage.last.message  # type: ignore[attr-defined]


def test_more_than_the_free_space_is_refused_before_downloading(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    huge = artifact(layer_size=free + MIB, memory=free + MIB)
    stage(tmp_path, huge, RestoreLimits(max_bytes=1 << 62, reserve_bytes=0))
    err = stage.last  # type: ignore[attr-defined]
    assert "not enough space" in err.message and err.retryable


def test_the_reserve_counts(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    stage(tmp_path, artifact(), RestoreLimits(max_bytes=1 << 62, reserve_bytes=free))
    assert "kept free" in stage.last.message  # type: ignore[attr-defined]


def test_chunks_reused_beyond_the_recorded_memory_are_refused(tmp_path: Path) -> None:
    """One 5 kB chunk repeated 4096 times would write 4 GiB from a few kB of download."""
    art = artifact(memory=8 * MIB, pages=reused_chunk_pages(4096))
    with pytest.raises(FailedPrecondition, match="chunks reused beyond"):
        plan_space(art)
    stage(tmp_path, art, RestoreLimits())


def test_plan_counts_layers_chunks_and_memory() -> None:
    art = artifact(layer_size=3 * MIB, memory=8 * MIB, pages=reused_chunk_pages(8))
    plan = plan_space(art)
    assert plan.download_bytes == 3 * MIB + 8 * 5000
    assert plan.written_bytes == 3 * MIB + 8 * MIB
    v1 = plan_space(artifact(layer_size=3 * MIB, memory=8 * MIB))
    assert v1.written_bytes == 3 * MIB + 8 * MIB  # memory inside the layer is extracted


# --- the node's disk ledger: restores in flight see each other (shim/host/diskspace.py) ---------------

GIB = 1 << 30
NO_LIMITS = RestoreLimits(max_bytes=1 << 62, reserve_bytes=0)


def fake_statvfs(total: int, available: int) -> Any:
    """A filesystem of `total` bytes with `available` left (f_frsize 1), whatever the path."""
    return lambda path: os.statvfs_result((4096, 1, total, available, available, 0, 0, 0, 0, 255))


class HeldRegistry:
    """A registry whose first download waits until the test lets it go, then fails."""

    def __init__(self) -> None:
        self.downloading, self.go = threading.Event(), threading.Event()
        self.calls: list[str] = []

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        return True

    def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> None:
        self.calls.append(digest)
        self.downloading.set()
        self.go.wait(10)
        raise Unavailable("the registry went away")


class InFlight:
    """A restore staging on a thread, held in its download until `finish`."""

    def __init__(self, tmp_path: Path, art: Artifact, target: str, **kw: Any) -> None:
        self.registry = HeldRegistry()
        self.error: Exception | None = None
        paths = StatePaths(str(tmp_path / "state"))

        def run() -> None:
            try:
                stage_artifact(art, [str(tmp_path / target)], registry=self.registry, paths=paths, **kw)  # type: ignore[arg-type]
            except Exception as e:
                self.error = e

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.registry.downloading.wait(10), "the restore in flight was not admitted"

    def finish(self) -> Exception | None:
        self.registry.go.set()
        self.thread.join(10)
        return self.error


def test_two_restores_that_fit_alone_but_not_together_are_not_both_admitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each restore checked the same free space: both were admitted and together filled the disk."""
    monkeypatch.setattr(os, "statvfs", fake_statvfs(total=100 * GIB, available=20 * GIB))  # 10 GiB kept free
    art = artifact(layer_size=MIB, memory=6 * GIB)  # 6 GiB to write: one fits the 10 GiB of room, two do not
    first = InFlight(tmp_path, art, "s1", limits=NO_LIMITS)
    try:
        second = stage(tmp_path, art, NO_LIMITS)  # refused before a single download
        err = stage.last  # type: ignore[attr-defined]
        assert second.calls == []
        assert "promised to snapshots and restores in flight" in err.message and err.retryable
        assert "kept free" in err.message and err.hint
    finally:
        first_error = first.finish()
    assert isinstance(first_error, Unavailable)  # the first was admitted and downloading
    # its promise went with it (it failed): the same restore is admitted now
    again = InFlight(tmp_path, art, "s3", limits=NO_LIMITS)
    assert isinstance(again.finish(), Unavailable)


def test_one_namespace_cannot_take_the_staging_room_of_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "statvfs", fake_statvfs(total=100 * GIB, available=20 * GIB))  # 10 GiB of room
    art = artifact(layer_size=MIB, memory=3 * GIB)  # default share 50%: 5 GiB for one namespace
    busy = InFlight(tmp_path, art, "s1", limits=NO_LIMITS, namespace="busy")
    try:
        reg = RecordingRegistry()
        paths = StatePaths(str(tmp_path / "state"))
        with pytest.raises(FailedPrecondition, match="namespace 'busy' may not stage more") as e:
            stage_artifact(art, [str(tmp_path / "s2")], registry=reg, paths=paths, limits=NO_LIMITS, namespace="busy")  # type: ignore[arg-type]
        assert reg.calls == [] and e.value.retryable
        quiet = InFlight(tmp_path, art, "s3", limits=NO_LIMITS, namespace="quiet")  # another tenant's is admitted
        assert isinstance(quiet.finish(), Unavailable)
    finally:
        busy.finish()


# --- garbage collection of staged data ------------------------------------------------------------


class PodsKube:
    """The pods the API server still has (namespace, name) -> uid; GETs are counted."""

    def __init__(self, pods: dict[tuple[str, str], str], *, down: bool = False) -> None:
        self.pods, self.down, self.gets = pods, down, 0

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        self.gets += 1
        if self.down:
            raise Unavailable("the API server is not answering")
        if (ns, name) not in self.pods:
            raise NotFound(f"pod {ns}/{name} not found")
        return {"metadata": {"uid": self.pods[(ns, name)]}}


def worker(tmp_path: Path, kube: Any = None) -> RestoreWorker:
    settings = NodeSettings(node="n1", state_root=str(tmp_path / "state"), kubelet_root=str(tmp_path / "k"))
    return RestoreWorker(kube=kube, settings=settings, facts=HostFacts())


def staged_for(w: RestoreWorker, uid: str, name: str, *, old: bool = True) -> Path:
    d = Path(w.paths.staged_by_pod(uid, "c"))
    (d / "checkpoint").mkdir(parents=True)
    w._record_owner({"metadata": {"uid": uid, "namespace": "a", "name": name}})
    if old:
        t = time.time() - GC_GRACE_S - 10
        os.utime(d.parent, (t, t))
    return d.parent


def test_staged_data_of_pods_that_went_away_is_collected(tmp_path: Path) -> None:
    kube = PodsKube({("a", "live"): "live-uid", ("a", "recreated"): "new-uid"})
    w = worker(tmp_path, kube)
    gone = staged_for(w, "gone-uid", "gone")
    live = staged_for(w, "live-uid", "live")
    replaced = staged_for(w, "old-uid", "recreated")  # same name, another pod now
    fresh = staged_for(w, "fresh-uid", "fresh", old=False)
    downloads = Path(w.paths.downloads())
    downloads.mkdir(parents=True)
    (downloads / "sha256-x.123.part").write_bytes(b"x")
    stale = time.time() - DOWNLOAD_GC_S - 10
    os.utime(downloads / "sha256-x.123.part", (stale, stale))
    (downloads / "sha256-y.124.part").write_bytes(b"y")  # a restore running now
    # a node-level restore's staging that a crashed agent left (its container and page dirs), and one now
    by_id = Path(w.paths.staged_by_id("cid-old")).parent
    for name in ("cid-old", ".pages-abc", "cid-now", ".pages-now"):
        (by_id / name / "checkpoint").mkdir(parents=True)
        if name.endswith("old") or name == ".pages-abc":
            os.utime(by_id / name, (stale, stale))
    removed = w.collect_garbage()
    assert not gone.exists() and not replaced.exists()
    assert live.exists() and fresh.exists()  # live pod; too young to judge
    assert sorted(os.listdir(downloads)) == ["sha256-y.124.part"]
    assert sorted(os.listdir(by_id)) == [".pages-now", "cid-now"]
    assert len(removed) == 5
    assert kube.gets == 3  # only the old dirs were looked up, one GET each


def test_a_pods_staging_gates_stay_as_long_as_the_pod(tmp_path: Path) -> None:
    """A container restarted long after its restore reads its gate's answer again: the gates go only
    with the pod (a resume that started fresh has no staged dir, and its gates must stay all the same)."""
    kube = PodsKube({("a", "live"): "live-uid", ("a", "fresh"): "fresh-uid"})
    w = worker(tmp_path, kube)
    t = time.time() - GC_GRACE_S - 10
    gates = {}
    for uid, name in (("gone-uid", "gone"), ("live-uid", "live"), ("fresh-uid", "fresh"), ("young-uid", "young")):
        g = Path(w.paths.pod_gate(uid, "c"))
        w._record_owner({"metadata": {"uid": uid, "namespace": "a", "name": name}}, str(g.parent))
        g.write_bytes(b"")
        if uid != "young-uid":
            os.utime(g.parent, (t, t))
        gates[uid] = g.parent
    removed = w.collect_garbage()
    assert removed == [str(gates["gone-uid"])]
    assert gates["live-uid"].exists() and gates["fresh-uid"].exists() and gates["young-uid"].exists()


def test_nothing_is_collected_while_the_api_server_is_down(tmp_path: Path) -> None:
    w = worker(tmp_path, PodsKube({}, down=True))
    d = staged_for(w, "maybe-uid", "maybe")
    assert w.collect_garbage() == []
    assert d.exists()


def test_a_restore_in_progress_is_never_collected(tmp_path: Path) -> None:
    kube = PodsKube({})
    w = worker(tmp_path, kube)
    d = staged_for(w, "busy-uid", "busy")
    w._active.add("busy-uid")
    assert w.collect_garbage() == []
    assert d.exists() and kube.gets == 0


# --- fairness ------------------------------------------------------------------------------------


def test_a_namespace_with_many_jobs_does_not_starve_another() -> None:
    order: list[str] = []
    gate = threading.Event()
    s = FairScheduler(workers=1, per_key=1, name="t")
    s.submit("busy", gate.wait)  # holds the only worker until everything is queued
    for i in range(5):
        s.submit("busy", functools.partial(order.append, f"busy{i}"))
    s.submit("quiet", lambda: order.append("quiet"))
    gate.set()
    s.close()
    assert order.index("quiet") <= 1, order  # its turn comes right after one of busy's


def test_a_slow_job_does_not_hold_up_the_next() -> None:
    slow_release = threading.Event()
    done = threading.Event()
    s = FairScheduler(workers=2, per_key=2, name="t")
    s.submit("a", lambda: slow_release.wait(10))  # a restore stuck on a slow registry
    s.submit("b", done.set)
    assert done.wait(5)
    done.clear()
    s.submit("a", done.set)  # the same namespace too, with per_key=2
    assert done.wait(5)
    slow_release.set()
    s.close()


def test_per_key_limit_holds() -> None:
    running, peak = 0, 0
    lock = threading.Lock()

    def job() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    s = FairScheduler(workers=4, per_key=1, name="t")
    for _ in range(6):
        s.submit("ns", job)
    s.close()
    assert peak == 1


def test_a_failing_job_does_not_kill_the_worker() -> None:
    done = threading.Event()
    s = FairScheduler(workers=1, per_key=1, name="t")
    s.submit("a", lambda: 1 / 0)
    s.submit("a", done.set)
    assert done.wait(5)
    s.close()


def test_the_snapshot_queue_takes_namespaces_in_turn() -> None:
    """The agent's snapshot queue (one at a time, freezes never overlap) serves namespaces in turn."""
    from shim.controller.workqueue import WorkQueue

    order: list[str] = []
    gate, done = threading.Event(), threading.Event()
    q = WorkQueue("t")
    q.submit(lambda: gate.wait(10), key="busy")
    for i in range(5):
        q.submit(lambda i=i: order.append(f"busy{i}"), key="busy")  # type: ignore[misc]
    q.submit(lambda: order.append("quiet"), key="quiet")
    q.submit(done.set, key="last")
    gate.set()
    assert done.wait(10)
    time.sleep(0.1)
    assert order.index("quiet") <= 1, order
    assert [x for x in order if x.startswith("busy")] == [f"busy{i}" for i in range(5)]  # FIFO within one
