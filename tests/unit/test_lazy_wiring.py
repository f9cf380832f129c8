"""The lazy restore's wiring that needs no CRIU: the runtime wrapper adds ``--lazy-pages`` only where the
agent's lazy-pages daemon listens (a socket; a file of that name from a snapshot's layer never counts),
the daemon's files in the staged dir are the daemon's own, and the node's slots for lazy sessions. The
restore itself runs in tests/integration/test_lazy_session.py."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import UnsafeArchive
from shim import runtime_wrapper as W
from shim.controller.lazypods import end_orphaned
from shim.criu.lazydaemon import LazyPagesDaemon
from shim.engine import lazyrestore
from shim.engine.staging import lazy_used_dir


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    d = tmp_path / "c1"
    (d / C.CHECKPOINT_DIRECTORY).mkdir(parents=True)
    return d


def _command(tmp_path: Path, staged: Path) -> list[str]:
    create = W.CreateArgs("c1", str(tmp_path / "bundle"), None, None, [])
    inv = W.Invocation(["--root", "/run/runc"], "create", [])
    return W.restore_command("/usr/sbin/runc", inv, create, str(staged), "/usr/sbin/criu")


def test_runc_restores_lazily_only_where_the_daemon_listens(tmp_path: Path, staged: Path) -> None:
    # the legitimate case: the agent's daemon listens in the staged dir
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(staged / C.LAZY_PAGES_SOCKET))
        cmd = _command(tmp_path, staged)
        assert "--lazy-pages" in cmd and cmd[-1] == "c1"
    finally:
        sock.close()
    os.unlink(staged / C.LAZY_PAGES_SOCKET)
    assert "--lazy-pages" not in _command(tmp_path, staged)  # an eager restore, as before
    # a file of that name a snapshot's layer put there is not a daemon
    (staged / C.LAZY_PAGES_SOCKET).write_text("")
    assert "--lazy-pages" not in _command(tmp_path, staged)
    os.unlink(staged / C.LAZY_PAGES_SOCKET)
    os.symlink("/run/some.socket", staged / C.LAZY_PAGES_SOCKET)
    assert "--lazy-pages" not in _command(tmp_path, staged)


def test_the_daemon_never_writes_through_a_file_the_layer_planted(tmp_path: Path, staged: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, staged / C.LAZY_PAGES_LOG)
    a, b = socket.socketpair()
    try:
        daemon = LazyPagesDaemon(["/bin/true"], str(staged / C.CHECKPOINT_DIRECTORY), str(staged), b)
        daemon.wait(10)
    finally:
        a.close()
        b.close()
    assert not os.path.lexists(staged / C.LAZY_PAGES_LOG) and target.read_text() == "keep"
    (staged / C.LAZY_PAGES_SOCKET).mkdir()  # a directory cannot be taken away: refused
    a, b = socket.socketpair()
    try:
        with pytest.raises(UnsafeArchive, match=C.LAZY_PAGES_SOCKET):
            LazyPagesDaemon(["/bin/true"], str(staged / C.CHECKPOINT_DIRECTORY), str(staged), b)
    finally:
        a.close()
        b.close()


def test_a_daemon_that_exits_before_it_listens_says_why(tmp_path: Path, staged: Path) -> None:
    a, b = socket.socketpair()
    try:
        daemon = LazyPagesDaemon(["/bin/false"], str(staged / C.CHECKPOINT_DIRECTORY), str(staged), b)
        with pytest.raises(Exception, match="exited 1 before it listened"):
            daemon.wait_listening(10)
    finally:
        a.close()
        b.close()


def test_lazy_sessions_are_bounded_per_node_and_all_or_none_per_pod() -> None:
    assert lazyrestore.take_slots(lazyrestore.LAZY_SLOTS - 1)
    try:
        assert not lazyrestore.take_slots(2)  # a two-container pod does not get one of the two
        assert lazyrestore.take_slots(1)  # ... and took none: the last one is still there
        assert not lazyrestore.take_slots(1)
        lazyrestore.give_slot()
    finally:
        lazyrestore.give_slot(lazyrestore.LAZY_SLOTS - 1)
    assert lazyrestore.take_slots(lazyrestore.LAZY_SLOTS)  # all back
    lazyrestore.give_slot(lazyrestore.LAZY_SLOTS)
    lazyrestore.give_slot()  # one too many is ignored: never more than LAZY_SLOTS
    assert not lazyrestore.take_slots(lazyrestore.LAZY_SLOTS + 1)


def test_an_agent_start_ends_the_lazy_phases_an_earlier_agent_left(tmp_path: Path) -> None:
    root = tmp_path / "by-pod"
    used = root / "uid-1" / ".lazy-app"  # restored lazily, its pages still coming when the agent died
    used.mkdir(parents=True)
    waiting = root / "uid-2" / "app"  # staged lazily, the restore not run yet: its daemon is gone
    waiting.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(waiting / C.LAZY_PAGES_SOCKET))
    sock.close()
    eager = root / "uid-3" / "app"  # the legitimate case: an eager restore's staged dir, left alone
    (eager / C.CHECKPOINT_DIRECTORY).mkdir(parents=True)
    planted = root / "uid-4" / "app"  # ... also when its layer holds a file of the socket's name
    planted.mkdir(parents=True)
    (planted / C.LAZY_PAGES_SOCKET).write_text("")
    stopped: list[tuple[str, list[str]]] = []
    reports: list[tuple[str, str, str]] = []

    def stop(uid: str, names: list[str]) -> list[str]:
        stopped.append((uid, names))
        return names

    removed = end_orphaned(str(root), stop, lambda *r: reports.append(r))
    assert sorted(removed) == sorted([str(used), str(waiting)])
    assert stopped == [("uid-1", ["app"])]
    assert len(reports) == 1 and reports[0][:2] == ("uid-1", "app") and "agent restarted" in reports[0][2]
    assert eager.is_dir() and planted.is_dir() and not used.exists() and not waiting.exists()


def test_an_agent_start_restores_again_eagerly_what_a_lazy_phase_it_did_not_see_through_served(tmp_path: Path) -> None:
    """With the save's record (`again` returns what stages it), the container is held at its gate before
    it is stopped and restored eagerly after; without one (None), the kubelet starts it afresh."""
    root = tmp_path / "by-pod"
    for uid in ("uid-1", "uid-2"):
        (root / uid / ".lazy-app").mkdir(parents=True)
    order: list[str] = []
    reports: list[tuple[str, str, str]] = []
    staged = threading.Event()

    def again(uid: str, container: str) -> Any:
        order.append(f"hold {uid}/{container}")
        if uid == "uid-2":
            return None  # no record of the save

        def restage() -> None:
            order.append(f"restage {uid}/{container}")
            staged.set()

        return restage

    def stop(uid: str, names: list[str]) -> list[str]:
        order.append(f"stop {uid}/{names[0]}")
        return names

    end_orphaned(str(root), stop, lambda *r: reports.append(r), again=again)
    assert staged.wait(5)
    assert sorted(order) == sorted(
        ["hold uid-1/app", "stop uid-1/app", "restage uid-1/app", "hold uid-2/app", "stop uid-2/app"]
    )
    # held before the stop, restaged after it (in a thread of its own: the next pod does not wait for it)
    assert order.index("hold uid-1/app") < order.index("stop uid-1/app") < order.index("restage uid-1/app")
    by_uid = {r[0]: r[2] for r in reports}
    assert "restored again, eagerly, from the same save" in by_uid["uid-1"]
    assert "the kubelet starts it afresh" in by_uid["uid-2"]


def _fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: int, *, resume: bool) -> tuple[Any, ...]:
    """A Fallback whose eager staging fails `fails` times (a registry that went away), then stages."""
    from kubectl_snapshot.core.errors import Unavailable
    from shim.controller import lazypods
    from shim.engine.staging import StatePaths

    calls: list[str] = []

    def stage_artifact(artifact: Any, dirs: list[str], **kw: Any) -> list[Any]:
        calls.append(dirs[0])
        if len(calls) <= fails:
            raise Unavailable("fetch blob: connection refused")
        os.makedirs(os.path.join(dirs[0], C.CHECKPOINT_DIRECTORY))
        assert [c.name for c in artifact.config.containers] == ["app"] and not artifact.config.volumes
        return []

    said: list[tuple[str, str]] = []
    monkeypatch.setattr(lazypods, "stage_artifact", stage_artifact)
    monkeypatch.setattr(lazypods, "check_staged", lambda spec, dirs, cache_dir: None)
    monkeypatch.setattr(lazypods, "pod_event", lambda kube, pod, reason, msg, warning=False: said.append((reason, msg)))
    paths = StatePaths(str(tmp_path / "state"))
    config = SimpleNamespace(containers=(SimpleNamespace(name="app"), SimpleNamespace(name="side")), volumes=())
    artifact = SimpleNamespace(config=config, reference="reg.example/app@sha256:" + "1" * 64)
    monkeypatch.setattr(lazypods, "replace", lambda obj, **kw: SimpleNamespace(**{**vars(obj), **kw}))
    fb = lazypods.Fallback(artifact, None, None, paths, None, resume, retry_s=(0.0, 0.0))  # type: ignore[arg-type]
    pod = {"metadata": {"uid": "u1", "namespace": "ns", "name": "p"}, "spec": {}}
    os.makedirs(paths.pod_dir("u1"), exist_ok=True)
    return fb, pod, calls, said, paths


def _gate_answer(paths: Any) -> tuple[str, str] | None:
    from shim.engine.staging import _read_answer

    return _read_answer(paths.pod_gate("u1", "app"))


@pytest.mark.parametrize("resume", [True, False])
def test_a_failed_lazy_container_is_staged_again_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resume: bool
) -> None:
    # the legitimate case: the registry answers again on the second try; the gate says ready, nothing is
    # marked failed or fresh, and the kubelet's restart restores the staged container
    from shim.engine.staging import READY
    from shim.net.podrestore import PodRestore

    fb, pod, calls, said, paths = _fallback(tmp_path, monkeypatch, 1, resume=resume)
    gate = fb.hold("u1", "app")
    assert gate is not None
    assert fb.stage(None, pod, "app", gate) is True
    assert len(calls) == 2
    assert _gate_answer(paths) == (READY, "")
    assert os.path.isdir(os.path.join(paths.staged_by_pod("u1", "app"), C.CHECKPOINT_DIRECTORY))
    record = PodRestore(paths.pod_dir("u1"))
    assert record.failed() is None and record.fresh() is None
    assert [r for r, _ in said] == [K.EVENT_RESTORE_STAGED]


def test_a_resume_whose_eager_staging_fails_too_starts_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim.engine.staging import READY
    from shim.net.podrestore import PodRestore

    fb, pod, calls, said, paths = _fallback(tmp_path, monkeypatch, 3, resume=True)
    gate = fb.hold("u1", "app")
    assert fb.stage(None, pod, "app", gate) is False
    assert len(calls) == 3  # every try
    state, message = _gate_answer(paths) or ("", "")
    assert state == READY and message.startswith("no restore:")  # the workload is never held down
    assert "connection refused" in (PodRestore(paths.pod_dir("u1")).fresh() or "")
    assert not os.path.exists(paths.staged_by_pod("u1", "app"))
    assert [r for r, _ in said] == [K.EVENT_LAZY_RESTORE_FAILED] and "starts fresh" in said[0][1]


def test_a_restore_whose_eager_staging_fails_too_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim.engine.staging import FAILED
    from shim.net.podrestore import PodRestore

    fb, pod, _, said, paths = _fallback(tmp_path, monkeypatch, 3, resume=False)
    gate = fb.hold("u1", "app")
    assert fb.stage(None, pod, "app", gate) is False
    state, message = _gate_answer(paths) or ("", "")
    assert state == FAILED and "connection refused" in message
    assert PodRestore(paths.pod_dir("u1")).failed() is not None  # whole or not at all: not from its image
    assert "not started from its image" in said[0][1]


class _Source:
    def total_pages(self) -> int:
        return 0

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes:
        raise KeyError(vaddr)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("handed_over", [False, True])
def test_a_sessions_end_leaves_the_staged_dir_to_the_eager_restore_it_handed_over_to(
    tmp_path: Path, handed_over: bool
) -> None:
    # the legitimate end removes the staged dir and what the lazy restore used; once the eager fallback
    # stages the same container there, the session's end (after it) must leave its data alone
    staged = tmp_path / "by-pod" / "u1" / "app"
    (staged / C.CHECKPOINT_DIRECTORY).mkdir(parents=True)
    used = Path(lazy_used_dir(str(staged)))
    used.mkdir()
    stage = lazyrestore.LazyStage("app", str(staged), {}, _Source(), 0)  # type: ignore[arg-type]
    assert lazyrestore.take_slots(1)
    session = lazyrestore.LazySession(stage, criu=["criu"], criu_version="4.2.1", on_failure=lambda why: None)
    if handed_over:
        session.hand_over()
    session.close()
    assert not used.exists()
    assert staged.exists() == handed_over


def test_an_agent_asked_to_stop_waits_for_the_lazy_phases_it_serves() -> None:
    from shim.engine import lazyrestore

    assert lazyrestore.wait_until_idle(0)  # none: at once
    assert lazyrestore.take_slots(2)
    assert not lazyrestore.wait_until_idle(0.2)  # two serving: not idle
    timer = threading.Timer(0.3, lazyrestore.give_slot, args=(2,))
    timer.start()
    t0 = time.monotonic()
    assert lazyrestore.wait_until_idle(10)  # both phases end: it stops then, not at the bound
    assert time.monotonic() - t0 < 5
    timer.join()
    assert not lazyrestore.take_slots(lazyrestore.LAZY_SLOTS + 1)  # refused whole: nothing left counted
    assert lazyrestore.wait_until_idle(0)
