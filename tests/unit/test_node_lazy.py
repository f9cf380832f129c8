"""NodeLazyPhase (shim/engine/nodelazy.py), the lazy phase of `ks-agent restore --lazy`: its bookkeeping
with stand-in sessions (real ones, with CRIU, containerd and a registry: tests/integration/test_node_lazy.py).
A container whose pages cannot come is killed before anything else; stopping the command kills those still
waiting and only those; the legitimate case waits until every page is in and reports each container."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shim.criu.pageserver import ServeStats
from shim.engine import nodelazy
from shim.engine.nodelazy import NodeLazyPhase


class _Stats:
    def __init__(self) -> None:
        self.pages = 0


class _Server:
    def __init__(self) -> None:
        self.stats = _Stats()


class FakeSession:
    made: list[FakeSession] = []
    fail_start: set[str] = set()

    def __init__(self, stage: Any, *, criu: list[str], criu_version: str, on_failure: Any, on_done: Any) -> None:
        self.stage, self.on_failure, self.on_done = stage, on_failure, on_done
        self.server = _Server()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.ended: str | None = None
        FakeSession.made.append(self)

    def start(self) -> FakeSession:
        if self.stage.container in FakeSession.fail_start:
            raise RuntimeError("daemon did not listen")
        return self

    def end(self, reason: str) -> None:
        self.ended = reason
        self.on_failure(reason)

    def close(self) -> None:
        self.closed = True


class Stage:
    def __init__(self, container: str, lazy_bytes: int) -> None:
        self.container, self.lazy_bytes = container, lazy_bytes


@pytest.fixture(autouse=True)
def fake_sessions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    FakeSession.made, FakeSession.fail_start = [], set()
    given: list[int] = []
    monkeypatch.setattr(nodelazy, "LazySession", FakeSession)
    monkeypatch.setattr(nodelazy, "give_slot", given.append)
    return given


def _phase(killed: list[str], *names: str) -> NodeLazyPhase:
    stages: list[tuple[str, Any]] = [(f"new-{n}", Stage(n, 8 << 20)) for n in names]
    return NodeLazyPhase(stages, criu="criu", criu_version="4.2.1", kill=killed.append)


def test_every_page_in_reports_each_container_and_kills_none() -> None:
    killed: list[str] = []
    phase = _phase(killed, "app", "side").start()
    assert phase.total_bytes() == 16 << 20
    one, two = FakeSession.made
    seen: list[int] = []

    def serve() -> None:
        one.server.stats.pages = 2048
        one.on_done(ServeStats(pages=2048), 1.5)
        two.server.stats.pages = 2048
        two.on_done(ServeStats(pages=2048), 2.0)

    threading.Timer(0.05, serve).start()
    outcomes = phase.wait(seen.append, poll_s=0.01)
    assert [(o.container, o.pages, o.seconds, o.error) for o in outcomes] == [
        ("new-app", 2048, 1.5, ""),
        ("new-side", 2048, 2.0, ""),
    ]
    assert killed == [] and sum(seen) <= 16 << 20


def test_pages_that_cannot_come_kill_the_container_first() -> None:
    killed: list[str] = []
    phase = _phase(killed, "app").start()
    (s,) = FakeSession.made
    s.server.stats.pages = 10
    s.on_failure("chunk sha256:ab could not be fetched")
    (o,) = phase.wait(poll_s=0.01)
    assert killed == ["new-app"] and o.error == "chunk sha256:ab could not be fetched" and o.pages == 10


def test_a_kill_that_fails_is_said_too() -> None:
    def kill(cid: str) -> None:
        raise OSError("containerd is gone")

    stage: Any = Stage("app", 1)
    phase = NodeLazyPhase([("new-app", stage)], criu="criu", criu_version="4.2.1", kill=kill).start()
    FakeSession.made[0].on_failure("registry gone")
    (o,) = phase.wait(poll_s=0.01)
    assert o.error == "registry gone (ending the container failed: containerd is gone)"


def test_stopping_ends_those_still_waiting_and_only_those() -> None:
    killed: list[str] = []
    phase = _phase(killed, "app", "side").start()
    one, two = FakeSession.made
    one.on_done(ServeStats(pages=1), 0.1)  # this one is whole already
    assert phase.end("stopped") == ["new-side"]
    assert killed == ["new-side"] and one.ended is None and two.ended == "stopped"
    assert one.closed and two.closed


def test_a_session_that_does_not_start_closes_the_others_and_gives_back_the_rest(fake_sessions: list[int]) -> None:
    FakeSession.fail_start = {"side"}
    with pytest.raises(RuntimeError):
        _phase([], "app", "side", "third").start()
    app, side = FakeSession.made  # the third never made
    assert app.closed and side.closed
    assert fake_sessions == [1]  # the third's slot: the two made give theirs back as they close


def test_the_restore_says_which_containers_came_back_lazily_and_why_one_asked_for_did_not() -> None:
    from shim.service.text import restore_text

    data = {
        "containers": [{"name": "web", "pid": 41}, {"name": "db", "pid": 42}],
        "lazy": [{"name": "db", "pages": 25600, "seconds": 3.24}],
    }
    assert restore_text(data).splitlines() == [
        "web\trunning (pid 41)",
        "db\trunning (pid 42), restored lazily: 100 MiB fetched in 3.2 s",
    ]
    eager = {"containers": [{"name": "web", "pid": 41}], "eagerBecause": "this process serves 4 lazy restores already"}
    assert restore_text(eager).splitlines() == [
        "web\trunning (pid 41)",
        "restored eagerly: this process serves 4 lazy restores already",
    ]


def test_what_a_lazy_restore_killed_outright_left_running_is_ended_and_nothing_else(tmp_path: Any) -> None:
    import os
    import subprocess

    from kubectl_snapshot.core.errors import NotFound
    from shim.engine.nodelazy import RESTORER_FILE, _identity, end_orphaned, mark_served
    from shim.engine.staging import LAZY_PREFIX

    here = "/run/containerd.sock k8s"
    alive = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:

        def lazy_dir(cid: str, restorer: int | None, where: str = here) -> str:
            d = tmp_path / (LAZY_PREFIX + cid)
            d.mkdir()
            if restorer is not None:
                (d / RESTORER_FILE).write_text(f"{_identity(restorer) or f'{restorer} 1'}\n{where}\n")
            return str(d)

        lazy_dir("served", alive.pid)  # its command still runs
        lazy_dir("orphan", gone.pid)  # its command was killed outright
        lazy_dir("vanished", gone.pid)  # ... and its container is gone too
        lazy_dir("elsewhere", gone.pid, "/run/other.sock k8s")  # another containerd's: not ours to end
        lazy_dir("agents", None)  # the agent's own (Kubernetes) lazy restore: no restorer file
        (tmp_path / "plain").mkdir()  # a staged dir not restored yet
        killed: list[str] = []

        def kill(cid: str) -> None:
            if cid == "vanished":
                raise NotFound("no such task")
            killed.append(cid)

        assert end_orphaned(str(tmp_path), kill, here) == ["orphan", "vanished"]
        assert killed == ["orphan"]
        assert sorted(os.listdir(tmp_path)) == sorted(
            [LAZY_PREFIX + n for n in ("served", "elsewhere", "agents")] + ["plain"]
        )
        # a pid reused by another process does not count as the restorer
        reused = tmp_path / (LAZY_PREFIX + "reused")
        reused.mkdir()
        (reused / RESTORER_FILE).write_text(f"{alive.pid} 1\n{here}\n")
        assert end_orphaned(str(tmp_path), kill, here) == ["reused"]
        # what mark_served writes names this process: left alone while it runs
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        mark_served([str(fresh)], here)
        os.rename(fresh, tmp_path / (LAZY_PREFIX + "fresh"))
        assert end_orphaned(str(tmp_path), kill, here) == []
    finally:
        alive.kill()
        alive.wait()


def test_a_session_that_ended_without_a_word_ends_the_wait() -> None:
    killed: list[str] = []
    phase = _phase(killed, "app").start()
    (s,) = FakeSession.made
    s.thread = threading.Thread(target=lambda: None)  # its supervision ended (no restore connected)
    s.thread.start()
    s.thread.join()
    (o,) = phase.wait(poll_s=0.01)
    assert o.error == "its restore never asked for a page" and killed == ["new-app"]
