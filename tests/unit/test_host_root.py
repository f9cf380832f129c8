"""facts.host_root / podinfo.host_view: the host's files stay reachable after the host process that led
to them ends (the node's containerd restarted during a restore took it down with ENOENT on
/proc/PID/root/var/lib/kubelet), and mounts made there later are seen. Real processes in a real mount
namespace of their own (unshare -m) stand for the host's."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.controller import podinfo
from shim.host import facts as hostfacts

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="needs root and util-linux (a mount namespace of its own)",
)


def _other_namespace() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "300"])
    mine = os.readlink("/proc/self/ns/mnt")
    for _ in range(200):
        try:
            if (
                os.readlink(f"/proc/{proc.pid}/ns/mnt") != mine
                and b"sleep" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            ):
                return proc
        except OSError:
            pass
        time.sleep(0.01)
    proc.kill()
    raise AssertionError("unshare did not start")


def _join(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Another process of `proc`'s mount namespace (the host's always has more than one: init, the kubelet)."""
    other = subprocess.Popen(["nsenter", f"--mount=/proc/{proc.pid}/ns/mnt", "--", "sleep", "300"])
    want = os.readlink(f"/proc/{proc.pid}/ns/mnt")
    for _ in range(200):
        try:
            if os.readlink(f"/proc/{other.pid}/ns/mnt") == want:
                return other
        except OSError:
            pass
        time.sleep(0.01)
    other.kill()
    raise AssertionError("nsenter did not start")


@pytest.fixture
def roots(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    fresh: dict[str, int] = {}
    monkeypatch.setattr(hostfacts, "_roots", fresh)
    yield fresh
    for fd in fresh.values():
        os.close(fd)


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def test_the_host_view_outlives_the_process_it_came_through(
    monkeypatch: pytest.MonkeyPatch, roots: dict[str, int], tmp_path: Path
) -> None:
    (tmp_path / "kubelet").mkdir()
    (tmp_path / "kubelet" / "marker").write_text("here")
    host = _other_namespace()
    again = _join(host)
    try:
        monkeypatch.setattr(hostfacts, "_host_pid", lambda: host.pid)
        view = podinfo.host_view(str(tmp_path / "kubelet"))
        assert view.startswith(f"/proc/{os.getpid()}/fd/"), view
        assert (Path(view) / "marker").read_text() == "here"
        old_way = f"/proc/{host.pid}/root{tmp_path}/kubelet"
        assert os.path.isdir(old_way)
        _end(host)
        # the process is gone (containerd restarted): its /proc/PID/root no longer resolves, the view does
        assert not os.path.exists(old_way)
        assert (Path(view) / "marker").read_text() == "here"
        # a later look, through the namespace's other process, finds the namespace's fd again
        monkeypatch.setattr(hostfacts, "_host_pid", lambda: again.pid)
        assert podinfo.host_view(str(tmp_path / "kubelet")) == view
        assert len(roots) == 1
    finally:
        _end(host)
        _end(again)


def test_mounts_made_in_the_host_namespace_later_are_seen(
    monkeypatch: pytest.MonkeyPatch, roots: dict[str, int], tmp_path: Path
) -> None:
    """A memory-backed emptyDir: the kubelet mounts a tmpfs after the agent found the host's root."""
    volume = tmp_path / "volume"
    volume.mkdir()
    host = _other_namespace()
    stays = _join(host)
    try:
        monkeypatch.setattr(hostfacts, "_host_pid", lambda: host.pid)
        view = Path(podinfo.host_view(str(volume)))
        assert list(view.iterdir()) == []
        _end(host)  # the process the view came through is gone, its namespace lives on
        script = f"mount -t tmpfs ks-test {volume} && echo data > {volume}/in-tmpfs"
        nsenter = ["nsenter", f"--mount=/proc/{stays.pid}/ns/mnt", "--", "sh", "-c", script]
        subprocess.run(nsenter, check=True, timeout=30)
        assert (view / "in-tmpfs").read_text() == "data\n"
        assert not (volume / "in-tmpfs").exists()  # this process's own namespace does not see it
        monkeypatch.setattr(hostfacts, "_host_pid", lambda: stays.pid)
        assert Path(podinfo.host_view(str(volume))) == view  # one fd for the namespace
    finally:
        _end(host)
        _end(stays)


def test_a_process_that_ended_before_its_root_was_opened_is_looked_up_again(
    monkeypatch: pytest.MonkeyPatch, roots: dict[str, int], tmp_path: Path
) -> None:
    gone = _other_namespace()
    _end(gone)
    host = _other_namespace()
    try:
        monkeypatch.setattr(hostfacts, "host_pid", lambda: gone.pid)
        monkeypatch.setattr(hostfacts, "_host_pid", lambda: host.pid)
        view = podinfo.host_view(str(tmp_path))
        assert os.path.samefile(view, tmp_path)
    finally:
        _end(host)

    # no live process at all: a clear error, never a path that does not resolve
    monkeypatch.setattr(hostfacts, "_roots", {})
    monkeypatch.setattr(hostfacts, "_host_pid", lambda: gone.pid)
    with pytest.raises(FailedPrecondition, match="host's mount namespace"):
        podinfo.host_view(str(tmp_path))


def test_outside_a_container_the_path_is_itself(monkeypatch: pytest.MonkeyPatch, roots: dict[str, int]) -> None:
    monkeypatch.setattr(hostfacts, "_host_pid", lambda: None)
    assert podinfo.host_view("/var/lib/kubelet") == "/var/lib/kubelet"
    assert roots == {}
