"""The checkpoint use case's ordering and failure rules, over fakes of its two ports.

(The real thing is tested against containerd, CRIU and a registry in tests/integration.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

import pytest
import zstandard

from kubectl_snapshot.core.errors import CriuFailed, FailedPrecondition, NotFound, Unavailable
from kubectl_snapshot.core.model import HostFacts, parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import (
    ANN_COSIGN_SIGNATURE,
    SignatureCandidate,
    SigningKey,
    TrustPolicy,
    evaluate,
    signature_tag,
)
from kubectl_snapshot.core.reference import Reference
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.staging import StatePaths
from shim.host import reaper
from tests.support.fakenode import FakeContainerd, FakeRegistry

HOST = HostFacts(kernel="6.18", arch="x86_64", criu_version="4.2.1")
TARGET = Reference.parse("127.0.0.1:5000/snap:v1")


def run(cd: FakeContainerd, reg: FakeRegistry, tmp_path: Path, **kw: Any) -> Any:
    req = CheckpointRequest(containers=kw.pop("containers", ["a", "b"]), target=TARGET, **kw)
    return checkpoint(req, containerd=cd, registry=reg, paths=StatePaths(str(tmp_path)), host=HOST)


def test_all_frozen_first_then_dumped_then_resumed(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    result = run(cd, reg, tmp_path)
    # all frozen, then every dump (in parallel for a group: any order), then all resumed
    assert cd.calls[:2] == [("pause", "a"), ("pause", "b")]
    assert sorted(cd.calls[2:4]) == [("checkpoint", "a"), ("checkpoint", "b")]
    assert cd.calls[4:] == [("resume", "a"), ("resume", "b")]
    assert cd.paused == set() and cd.killed == set()
    manifest = parse_manifest(reg.manifests["v1"])
    cfg = parse_config(reg.blobs[manifest.config.digest])
    assert [c.name for c in cfg.containers] == ["a", "b"]
    assert {layer.digest for layer in manifest.layers} <= set(reg.blobs)
    assert str(result.reference) == f"127.0.0.1:5000/snap@{manifest.digest}"
    assert reaper.drain(10)  # the work dir is removed after the answer (shim/host/reaper.py)
    assert not os.listdir(tmp_path / "work")  # work dir cleaned


def test_dump_failure_resumes_everything_and_keeps_the_log(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}, fail_checkpoint="b"), FakeRegistry()
    with pytest.raises(CriuFailed) as e:
        run(cd, reg, tmp_path, stop=True)
    assert "boom" in (e.value.details or "")
    assert cd.paused == set() and cd.killed == set()
    assert reg.manifests == {}


def test_push_failure_with_stop_resumes_and_does_not_kill(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry(fail_push=True)
    with pytest.raises(Unavailable):
        run(cd, reg, tmp_path, stop=True)
    assert cd.paused == set() and cd.killed == set()


def test_stop_keeps_frozen_until_pushed_then_kills(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    run(cd, reg, tmp_path, stop=True)
    assert cd.killed == {"a", "b"}
    names = [c for c, _ in cd.calls]
    assert names.index("kill") < names.index("resume")  # killed while frozen, then thawed to die


def test_stop_checks_every_blob_is_in_the_registry_before_deleting_anything(tmp_path: Path) -> None:
    """Issue 10 item 6: an upload the registry acknowledged but lost never costs the pod."""
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry(loses_last_layer=True)
    deleted: list[str] = []
    req = CheckpointRequest(containers=["a", "b"], target=TARGET, stop=True)
    with pytest.raises(Unavailable, match="not stopped and keeps running") as e:
        checkpoint(
            req,
            containerd=cd,
            registry=reg,
            paths=StatePaths(str(tmp_path)),
            host=HOST,
            before_stop=lambda: deleted.append("pod"),
        )
    [layer] = reg.loses
    assert layer in e.value.message
    assert deleted == [] and cd.killed == set() and cd.paused == set()


def test_registry_down_is_found_before_freezing(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a"}), FakeRegistry(down=True)
    with pytest.raises(Unavailable):
        run(cd, reg, tmp_path, containers=["a"])
    assert cd.calls == []


def test_unknown_or_stopped_containers_are_refused_before_freezing(tmp_path: Path) -> None:
    cd = FakeContainerd({"a"})
    with pytest.raises(NotFound):
        run(cd, FakeRegistry(), tmp_path, containers=["a", "zzz"])
    assert cd.calls == []
    cd.get_task = lambda cid: SimpleNamespace(pid=0, status="stopped")  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="not running"):
        run(cd, FakeRegistry(), tmp_path, containers=["a"])


def test_a_dump_that_would_take_the_node_under_the_eviction_threshold_is_refused_before_freezing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dump on disk reserves the pod's memory (and writable layers, volumes) first (shim/host/diskspace.py):
    refused, nothing is frozen or written and the pod keeps running; a dump that fits is taken."""
    gib = 1 << 30
    monkeypatch.setenv("KUBECTL_SNAPSHOT_MEMORY_WORK_MIB", "0")  # the dump goes to the disk
    # the node's disk: 100 GiB, 16 GiB available, the kubelet's 10% kept free: 6 GiB of room
    monkeypatch.setattr(
        os, "statvfs", lambda path: os.statvfs_result((4096, 1, 100 * gib, 16 * gib, 16 * gib, 0, 0, 0, 0, 255))
    )
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    req = CheckpointRequest(containers=["a", "b"], target=TARGET, stop=True, namespace="n", group="p")
    paths = StatePaths(str(tmp_path))
    with pytest.raises(FailedPrecondition) as e:  # two containers of 4 GiB each
        checkpoint(req, containerd=cd, registry=reg, paths=paths, host=HOST, memory_of=lambda pid: 4 * gib)
    err = e.value
    assert "not enough space" in err.message and "the dump of pod n/p" in err.message and "kept free" in err.message
    assert err.retryable and "the pod keeps running" in (err.hint or "")
    assert cd.calls == [] and cd.paused == set() and cd.killed == set()  # never frozen, never stopped
    assert not (tmp_path / "work").exists()  # nothing written
    assert reg.manifests == {}
    checkpoint(req, containerd=cd, registry=reg, paths=paths, host=HOST, memory_of=lambda pid: gib)
    assert reg.manifests
    from shim.host import diskspace

    assert diskspace.NODE.held() == {}  # both promises went with their dumps


def test_a_killed_checkpoint_is_recovered_by_thawing(tmp_path: Path) -> None:
    from shim.engine.checkpoint import FROZEN_FILE, recover_interrupted

    cd = FakeContainerd({"a", "b"})
    paths = StatePaths(str(tmp_path))
    work = Path(paths.work_dir("123-abc"))
    work.mkdir(parents=True)
    (work / FROZEN_FILE).write_text('["a", "b"]')
    cd.pause_task("a")  # the agent died after freezing "a" only
    assert recover_interrupted(cd, paths) == ["a"]
    assert cd.paused == set() and not work.exists()


class FakeFreezer:
    """A cgroup freezer; what it freezes the fake containerd sees as paused (as runc would)."""

    def __init__(self, cid: str, log: list[tuple[str, str]], cd: FakeContainerd, fail: bool = False) -> None:
        self.cid, self.log, self.cd, self.fail, self.is_frozen = cid, log, cd, fail, False

    def ready(self) -> None:
        self.log.append(("ready", self.cid))

    def freeze(self, *, deadline_s: float | None = None) -> None:
        if self.fail:
            raise OSError("EACCES")
        self.log.append(("freeze", self.cid))
        self.is_frozen = True
        self.cd.paused.add(self.cid)

    def thaw(self) -> None:
        self.log.append(("thaw", self.cid))
        self.is_frozen = False
        self.cd.paused.discard(self.cid)

    def frozen(self) -> bool:
        return self.is_frozen


def test_direct_freezer_replaces_containerd_pause_and_falls_back_when_it_fails(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    log: list[tuple[str, str]] = []
    freezers = iter([FakeFreezer("a", log, cd), FakeFreezer("b", log, cd, fail=True)])  # in container order
    req = CheckpointRequest(containers=["a", "b"], target=TARGET)
    paths = StatePaths(str(tmp_path))
    checkpoint(req, containerd=cd, registry=reg, paths=paths, host=HOST, freezer_for=lambda _pid: next(freezers))
    assert ("freeze", "a") in log and ("thaw", "a") in log
    assert ("pause", "a") not in cd.calls and ("resume", "a") not in cd.calls
    assert ("pause", "b") in cd.calls and ("resume", "b") in cd.calls  # b's freezer failed: containerd


def test_recover_thaws_a_directly_frozen_container(tmp_path: Path) -> None:
    from shim.engine.checkpoint import FROZEN_FILE, recover_interrupted

    cd = FakeContainerd({"a"})
    paths = StatePaths(str(tmp_path))
    work = Path(paths.work_dir("killed"))
    work.mkdir(parents=True)
    (work / FROZEN_FILE).write_text('["a"]')
    fz = FakeFreezer("a", [], cd)
    fz.is_frozen = True  # containerd still says "running"
    assert recover_interrupted(cd, paths, lambda _pid: fz) == ["a"]
    assert not fz.is_frozen and not work.exists()


def test_recover_goes_on_when_a_cgroup_is_gone(tmp_path: Path) -> None:
    from shim.engine.checkpoint import FROZEN_FILE, recover_interrupted

    class Gone(FakeFreezer):
        def frozen(self) -> bool:
            raise FileNotFoundError("cgroup.events")

    cd = FakeContainerd({"a", "b"})
    paths = StatePaths(str(tmp_path))
    work = Path(paths.work_dir("killed"))
    work.mkdir(parents=True)
    (work / FROZEN_FILE).write_text('["a", "b"]')
    b = FakeFreezer("b", [], cd)
    b.is_frozen = True
    freezers = {"a": Gone("a", [], cd), "b": b}
    order = iter(["a", "b"])
    assert recover_interrupted(cd, paths, lambda _pid: freezers[next(order)]) == ["b"]
    assert not b.is_frozen and not work.exists()


def test_pushed_snapshot_is_signed_and_holds_no_environment(tmp_path: Path) -> None:
    """The config never records process.env (resolved secrets); the agent's key signs the digest + origin."""
    key = SigningKey.generate()
    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    result = run(cd, reg, tmp_path, containers=["a"], signing_key=key, cluster="c1", node="n1", namespace="k8s.io")
    assert result.signed_by == key.public.id
    manifest = parse_manifest(reg.manifests["v1"])
    assert b"s3cret" not in reg.blobs[manifest.config.digest]
    layer_tar = zstandard.ZstdDecompressor().decompressobj().decompress(reg.blobs[manifest.layers[0].digest])
    assert b"spec.dump" in layer_tar and b"s3cret" not in layer_tar  # nor in the layer's spec.dump
    sig = parse_manifest(reg.manifests[signature_tag(manifest.digest)])
    layer = sig.layers[0]
    cand = SignatureCandidate(reg.blobs[layer.digest], layer.annotations[ANN_COSIGN_SIGNATURE])
    verdict = evaluate([cand], manifest.digest, TrustPolicy((key.public,)))
    assert verdict.verified and verdict.claim is not None
    assert (verdict.claim.origin.cluster, verdict.claim.origin.node) == ("c1", "n1")
    assert verdict.claim.origin.namespace == "k8s.io" and verdict.claim.origin.format_version == 3
    assert sig.config.digest in reg.blobs  # the registry needs the config blob before the manifest


def test_a_signature_that_cannot_be_stored_leaves_no_tag_and_the_pod_running(tmp_path: Path) -> None:
    """The signature's blobs go up beside the config, before the snapshot's tag: when they fail, the
    snapshot is never tagged (nothing unsigned is left under the name) and the containers run on."""

    class SigBlobsFail(FakeRegistry):
        def push_blob(self, ref: Reference, **kw: Any) -> bool:
            if (ref.tag or "").endswith(".sig"):
                raise Unavailable("connection reset mid-push")
            return super().push_blob(ref, **kw)

    cd, reg = FakeContainerd({"a"}), SigBlobsFail()
    with pytest.raises(Unavailable):
        run(cd, reg, tmp_path, containers=["a"], signing_key=SigningKey.generate())
    assert reg.manifests == {} and cd.paused == set() and cd.killed == set()


def test_unsigned_without_a_key(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    result = run(cd, reg, tmp_path, containers=["a"])
    assert result.signed_by == "" and not any(tag.endswith(".sig") for tag in reg.manifests)


def test_containers_connected_by_unix_sockets_are_refused_before_freezing(tmp_path: Path) -> None:
    from shim.net.unixpeers import CrossLink

    cd = FakeContainerd({"a", "b"})
    seen: list[list[int]] = []

    def links(pids: list[int]) -> list[CrossLink]:
        seen.append(pids)
        return [CrossLink(0, 1, "stream", "/vol/sock")]

    req = CheckpointRequest(containers=["a", "b"], target=TARGET, names=["server", "client"])
    paths = StatePaths(str(tmp_path))
    with pytest.raises(FailedPrecondition, match=r"'server' and 'client' \(stream socket, /vol/sock\)") as e:
        checkpoint(req, containerd=cd, registry=FakeRegistry(), paths=paths, host=HOST, unix_links=links)
    assert "TCP on 127.0.0.1" in (e.value.hint or "")
    assert seen == [[1, 1]] and cd.calls == []  # nothing was frozen
    # no connection between them: the snapshot goes ahead
    checkpoint(req, containerd=cd, registry=FakeRegistry(), paths=paths, host=HOST, unix_links=lambda p: [])
    assert ("checkpoint", "a") in cd.calls


def test_liveness_preflight_refuses_before_anything_is_frozen(tmp_path: Path) -> None:
    from kubectl_snapshot.core.freeze import ProbeBudget

    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    log: list[tuple[str, str]] = []
    req = CheckpointRequest(containers=["a"], target=TARGET, probe_budgets=[ProbeBudget("a", "liveness", 3.0)])
    with pytest.raises(FailedPrecondition, match="liveness probe of container 'a'"):
        checkpoint(
            req,
            containerd=cd,
            registry=reg,
            paths=StatePaths(str(tmp_path)),
            host=HOST,
            freezer_for=lambda _pid: FakeFreezer("a", log, cd),
            memory_of=lambda _pid: 1024 * 1024 * 1024,
        )
    assert log == [] and ("pause", "a") not in cd.calls and cd.paused == set()


def test_the_deadline_from_the_pods_memory_reaches_the_freezer(tmp_path: Path) -> None:
    from kubectl_snapshot.core.freeze import FreezePlan, ProbeBudget

    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    deadlines: list[float | None] = []
    plans: list[FreezePlan] = []

    class Recording(FakeFreezer):
        def freeze(self, *, deadline_s: float | None = None) -> None:
            deadlines.append(deadline_s)
            super().freeze()

    order = iter(["a", "b"])
    req = CheckpointRequest(
        containers=["a", "b"],
        target=TARGET,
        probe_budgets=[ProbeBudget("b", "liveness", 500.0)],
    )
    result = checkpoint(
        req,
        containerd=cd,
        registry=reg,
        paths=StatePaths(str(tmp_path)),
        host=HOST,
        freezer_for=lambda _pid: Recording(next(order), [], cd),
        memory_of=lambda _pid: 512 * 1024 * 1024,  # 1 GiB for the pod: 5 + 16 s expected
        on_plan=plans.append,
    )
    assert deadlines == [42.0, 42.0]
    assert result.plan == plans[0] and plans[0].expected_s == 21.0 and plans[0].memory_bytes == 1024**3


def test_a_guard_that_thaws_early_fails_the_snapshot_and_pushes_nothing(tmp_path: Path) -> None:
    from shim.freeze_guard import GuardError

    cd, reg = FakeContainerd({"a"}), FakeRegistry()

    class Expired(FakeFreezer):
        def thaw(self) -> None:
            super().thaw()
            raise GuardError("the pod stayed frozen past its deadline")

    req = CheckpointRequest(containers=["a"], target=TARGET)
    with pytest.raises(GuardError, match="deadline"):
        checkpoint(
            req,
            containerd=cd,
            registry=reg,
            paths=StatePaths(str(tmp_path)),
            host=HOST,
            freezer_for=lambda _pid: Expired("a", [], cd),
        )
    assert cd.paused == set() and not reg.manifests


def test_with_stop_a_pod_thawed_during_the_upload_is_not_killed(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    fz = FakeFreezer("a", [], cd)

    def expire(_: Any) -> None:  # the guard's deadline passes while the artifact is uploaded
        fz.thaw()

    req = CheckpointRequest(containers=["a"], target=TARGET, stop=True)
    killed: list[str] = []
    with pytest.raises(FailedPrecondition, match="thawed before it could be stopped"):
        checkpoint(
            req,
            containerd=cd,
            registry=reg,
            paths=StatePaths(str(tmp_path)),
            host=HOST,
            freezer_for=lambda _pid: fz,
            on_phase=lambda p: expire(p) if p == "upload" else None,
            before_stop=lambda: killed.append("pod deleted"),
        )
    assert killed == [] and cd.killed == set() and not fz.is_frozen


def test_a_freeze_guard_still_starting_is_waited_for_before_the_freeze_and_its_clock(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    log: list[tuple[str, str]] = []
    now = [0.0]

    class Starting(FakeFreezer):
        def ready(self) -> None:  # a private guard's Python start-up: 5 s on this clock, the pod unfrozen
            assert not self.is_frozen
            now[0] += 5.0
            super().ready()

        def freeze(self, *, deadline_s: float | None = None) -> None:
            now[0] += 0.01
            super().freeze()

    result = checkpoint(
        CheckpointRequest(containers=["a"], target=TARGET),
        containerd=cd,
        registry=reg,
        paths=StatePaths(str(tmp_path)),
        host=HOST,
        freezer_for=lambda _pid: Starting("a", log, cd),
        clock=lambda: now[0],
    )
    assert log[:2] == [("ready", "a"), ("freeze", "a")]
    assert result.timings_ms["freezing_ms"] == pytest.approx(10.0)
    assert result.timings_ms["freeze_ms"] < 1000  # the 5 s of start-up are not frozen time
    assert result.timings_ms["total_ms"] >= 5000  # but they are the command's time


def test_the_registry_is_asked_beside_the_containers_checks(tmp_path: Path) -> None:
    """The preflight's registry ping runs while the containers are looked up, and a refusal does not
    wait for a registry that never answers."""
    import threading
    import time

    cd, reg = FakeContainerd({"a"}), FakeRegistry()
    pinging = threading.Event()
    get_task = cd.get_task
    overlapped: list[bool] = []

    def task_while_pinging(cid: str) -> Any:
        overlapped.append(pinging.wait(5))  # the ping started before the task was looked up
        return get_task(cid)

    cd.get_task = task_while_pinging  # type: ignore[method-assign]
    reg.ping = lambda ref: pinging.set()  # type: ignore[method-assign]
    run(cd, reg, tmp_path, containers=["a"])
    assert overlapped == [True]

    stuck = threading.Event()
    reg2 = FakeRegistry()

    def never_answers(ref: Reference) -> None:
        stuck.wait(30)

    reg2.ping = never_answers  # type: ignore[method-assign]
    cd2 = FakeContainerd({"a"})
    cd2.get_task = lambda cid: SimpleNamespace(pid=0, status="stopped")  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        with pytest.raises(FailedPrecondition, match="not running"):
            run(cd2, reg2, tmp_path, containers=["a"])
        assert time.monotonic() - t0 < 10
    finally:
        stuck.set()


def test_a_registry_down_is_reported_after_the_containers_checks(tmp_path: Path) -> None:
    """The order of the preflight's answers is the checks' order: a missing container first."""
    cd, reg = FakeContainerd({"a"}), FakeRegistry(down=True)
    with pytest.raises(NotFound):
        run(cd, reg, tmp_path, containers=["a", "zzz"])


def test_files_in_the_runtimes_dev_shm_are_refused_a_volume_there_is_not() -> None:
    """The sandbox's /dev/shm is not captured: a container keeping files there is refused before anything
    is frozen (its restore would fail in CRIU); /dev/shm as an emptyDir is a volume, which is captured."""
    from shim.engine.checkpoint import _refuse_runtime_shm, runtime_shm

    sandbox = {
        "mounts": [
            {
                "destination": "/dev/shm",
                "type": "bind",
                "source": "/run/containerd/io.containerd.grpc.v1.cri/sandboxes/ab/shm",
            }
        ]
    }
    volume = {
        "mounts": [
            {
                "destination": "/dev/shm",
                "type": "bind",
                "source": "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/dshm",
            }
        ]
    }
    assert runtime_shm(sandbox) and not runtime_shm(volume) and not runtime_shm({"mounts": []})
    with pytest.raises(
        FailedPrecondition, match=r"keeps files in the container runtime's /dev/shm \(app-counter\)"
    ) as e:
        _refuse_runtime_shm(sandbox, 42, "app", listdir=lambda _p: ["app-counter"])
    assert "emptyDir with medium: Memory at /dev/shm" in (e.value.hint or "")
    _refuse_runtime_shm(sandbox, 42, "app", listdir=lambda _p: [])  # an empty one: nothing is lost
    _refuse_runtime_shm(volume, 42, "app", listdir=lambda _p: ["app-counter"])  # captured as a volume


def _criu_lock_recorder(cd: FakeContainerd, what: str = "criu-lock") -> Any:
    """A `criu_lock` (or `criu_cure`) port that records, among the containerd calls, when it is entered
    and left."""
    import contextlib

    @contextlib.contextmanager
    def criu_lock(pids: list[int]) -> Any:
        cd.calls.append((f"{what}-listed", ""))
        try:
            yield []
        except BaseException:
            cd.calls.append((f"{what}-lifted", ""))
            raise

    return criu_lock


def test_a_failed_dump_lifts_criu_s_network_lock_before_the_thaw(tmp_path: Path) -> None:
    """Threat A2: the namespaces' tables are listed before anything is frozen, and what a failed CRIU left
    is lifted before the containers run again (shim/net/criulock.py does it on the kernel)."""
    cd, reg = FakeContainerd({"a", "b"}, fail_checkpoint="b"), FakeRegistry()
    req = CheckpointRequest(containers=["a", "b"], target=TARGET)
    with pytest.raises(CriuFailed):
        checkpoint(
            req, containerd=cd, registry=reg, paths=StatePaths(str(tmp_path)), host=HOST,
            criu_lock=_criu_lock_recorder(cd),
        )  # fmt: skip
    names = [c for c, _ in cd.calls]
    assert names.index("criu-lock-listed") < names.index("pause")
    assert names.index("criu-lock-lifted") < names.index("resume")
    assert cd.paused == set()


def test_a_dump_that_succeeds_lifts_no_criu_lock(tmp_path: Path) -> None:
    cd, reg = FakeContainerd({"a", "b"}), FakeRegistry()
    req = CheckpointRequest(containers=["a", "b"], target=TARGET)
    checkpoint(
        req, containerd=cd, registry=reg, paths=StatePaths(str(tmp_path)), host=HOST,
        criu_lock=_criu_lock_recorder(cd), criu_cure=_criu_lock_recorder(cd, "cure"),
    )  # fmt: skip
    names = [c for c, _ in cd.calls]
    assert names[:2] == ["cure-listed", "criu-lock-listed"]
    assert "criu-lock-lifted" not in names and "cure-lifted" not in names


def test_a_failed_dump_cures_the_tasks_after_the_thaw(tmp_path: Path) -> None:
    """Threat A4: CRIU's parasite mappings are listed before anything is frozen; what a failed CRIU left is
    unmapped once every container runs again (a frozen task would not run the injected munmap:
    shim/criu/parasite.py does it through ptrace)."""
    cd, reg = FakeContainerd({"a", "b"}, fail_checkpoint="b"), FakeRegistry()
    req = CheckpointRequest(containers=["a", "b"], target=TARGET)
    with pytest.raises(CriuFailed):
        checkpoint(
            req, containerd=cd, registry=reg, paths=StatePaths(str(tmp_path)), host=HOST,
            criu_lock=_criu_lock_recorder(cd), criu_cure=_criu_lock_recorder(cd, "cure"),
        )  # fmt: skip
    names = [c for c, _ in cd.calls]
    assert names.index("cure-listed") < names.index("pause")
    resumes = [i for i, n in enumerate(names) if n == "resume"]
    assert len(resumes) == 2 and names.index("cure-lifted") > max(resumes)
    assert cd.paused == set()
