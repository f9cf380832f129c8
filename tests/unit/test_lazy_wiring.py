"""The lazy restore's wiring that needs no CRIU: the runtime wrapper adds ``--lazy-pages`` only where the
agent's lazy-pages daemon listens (a socket; a file of that name from a snapshot's layer never counts),
the daemon's files in the staged dir are the daemon's own, and the node's slots for lazy sessions. The
restore itself runs in tests/integration/test_lazy_session.py."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import UnsafeArchive
from shim import runtime_wrapper as W
from shim.criu.lazydaemon import LazyPagesDaemon
from shim.engine import lazyrestore


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
