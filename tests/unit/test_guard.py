"""The freeze guard's protocol and rules (shim/freeze_guard.py) against freezer files in a temporary directory.

A cgroup v1 ``freezer.state`` is a plain file here (what is written reads back), so the guard's real code
runs end to end; tests/integration/test_freeze_guard.py does the same against real cgroups and processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim import freeze_guard as guard
from shim.host import freezer

PID = 424242  # the fake container task


class FakeCgroups:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs: dict[int, Path] = {}

    def add(self, pid: int, rel: str) -> Path:
        d = self.root / "freezer" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "freezer.state").write_text("THAWED")
        self.dirs[pid] = d
        return d

    def lookup(self, pid: int) -> freezer.CgroupFreezer | None:
        d = self.dirs.get(pid)
        return freezer.CgroupFreezer(str(d), False) if d else None


@pytest.fixture
def cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCgroups:
    fake = FakeCgroups(tmp_path / "cgroupfs")
    monkeypatch.setattr(freezer, "lookup", fake.lookup)
    return fake


@pytest.fixture
def served(tmp_path: Path, cgroups: FakeCgroups) -> Iterator[guard.Guard]:
    g = guard.Guard(str(tmp_path / "s" / "guard.sock"), str(tmp_path / "holds"))
    g.root = str(cgroups.root)
    g.recover()
    t = threading.Thread(target=g.serve, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not os.path.exists(g.socket_path):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield g
    g._stop.set()
    t.join(5)


def state(d: Path) -> str:
    return (d / "freezer.state").read_text()


def wait_state(d: Path, want: str, within: float) -> float:
    t0 = time.monotonic()
    while state(d) != want:
        assert time.monotonic() - t0 < within, f"{d} still {state(d)} after {within} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def test_freeze_and_thaw_through_the_guard(served: guard.Guard, cgroups: FakeCgroups) -> None:
    d = cgroups.add(PID, "pods/a/c1")
    fz = guard.GuardClient(served.socket_path).freezer_for(PID)
    assert fz is not None
    fz.freeze(deadline_s=30)
    assert state(d) == "FROZEN" and fz.frozen()
    assert len(list(Path(served.state_dir).glob("*.hold"))) == 1
    fz.thaw()
    wait_state(d, "THAWED", 1.0)
    wait_for_no_holds(served)
    fz.thaw()  # a second thaw (the engine's error path) is harmless


def wait_for_no_holds(g: guard.Guard) -> None:
    deadline = time.monotonic() + 2
    while list(Path(g.state_dir).glob("*.hold")):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_dropped_connection_thaws_at_once(served: guard.Guard, cgroups: FakeCgroups) -> None:
    d = cgroups.add(PID, "pods/a/c1")
    fz = guard.GuardClient(served.socket_path).freezer_for(PID)
    assert fz is not None
    fz.freeze(deadline_s=300)
    assert state(d) == "FROZEN"
    assert fz._conn is not None
    fz._conn.close()  # what the kernel does for a killed holder
    assert wait_state(d, "THAWED", 2.0) < 2.0
    wait_for_no_holds(served)


def test_the_deadline_thaws_and_the_late_thaw_fails_the_snapshot(served: guard.Guard, cgroups: FakeCgroups) -> None:
    d = cgroups.add(PID, "pods/a/c1")
    fz = guard.GuardClient(served.socket_path).freezer_for(PID)
    assert fz is not None
    t0 = time.monotonic()
    fz.freeze(deadline_s=0.5)
    wait_state(d, "THAWED", 3.0)
    assert 0.4 < time.monotonic() - t0 < 2.5
    with pytest.raises(guard.GuardError, match="deadline"):
        fz.thaw()


def test_refuses_pids_and_cgroups_that_are_not_a_containers(served: guard.Guard, cgroups: FakeCgroups) -> None:
    def ask(pid: object) -> dict:  # type: ignore[type-arg]
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(served.socket_path)
            c.sendall(json.dumps({"op": "freeze", "pid": pid, "deadline_s": 5}).encode() + b"\n")
            answer: dict = json.loads(c.makefile().readline())  # type: ignore[type-arg]
            return answer

    assert not ask(1)["ok"] and not ask(os.getpid())["ok"] and not ask("12")["ok"] and not ask(True)["ok"]
    assert "cannot be placed" in ask(PID)["error"]  # no cgroup known for it
    # the guard's own cgroup, and any ancestor of it, is never frozen
    cgroups.add(os.getpid(), "system/guard")
    cgroups.add(PID, "system")
    assert "holds the guard" in ask(PID)["error"]
    assert state(cgroups.dirs[PID]) == "THAWED"


def test_check_target_paths() -> None:
    def fz(d: str) -> freezer.CgroupFreezer:
        return freezer.CgroupFreezer(d, False)

    guard.check_target(fz("/cg/freezer/kubepods/pod1/c"), protected=["/cg/freezer"], root="/cg")
    for bad in ("/elsewhere/x", "/cg", "/cg/freezer", "/cg/unified", "/cg/freezer/a/../../../etc"):
        with pytest.raises(guard.GuardError):
            guard.check_target(fz(bad), protected=[], root="/cg")
    with pytest.raises(guard.GuardError, match="holds"):
        guard.check_target(fz("/cg/freezer/kubepods"), protected=["/cg/freezer/kubepods/agentpod/agent"], root="/cg")


def test_a_restarted_guard_thaws_what_it_held(tmp_path: Path, cgroups: FakeCgroups) -> None:
    d = cgroups.add(PID, "pods/a/c1")
    (d / "freezer.state").write_text("FROZEN")
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / "x.hold").write_text(json.dumps({"directory": str(d), "v2": False, "report": None}))
    (holds / "bad.hold").write_text(json.dumps({"directory": "/etc", "v2": False}))
    g = guard.Guard(str(tmp_path / "g.sock"), str(holds))
    g.root = str(cgroups.root)
    assert g.recover() == [str(d)]
    assert state(d) == "THAWED" and not list(holds.iterdir())


def test_deadlines_are_finite_numbers_within_bounds() -> None:
    assert guard._deadline(None) == guard.MAX_DEADLINE_S
    assert guard._deadline(0) == 0.1 and guard._deadline(1e9) == guard.MAX_DEADLINE_S and guard._deadline(12) == 12
    for bad in (float("nan"), float("inf"), "12", True, [1]):
        with pytest.raises(guard.GuardError):
            guard._deadline(bad)


def test_the_failure_report_is_a_merge_patch_of_the_status_over_https(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """report_failed against a local HTTPS server standing in for the API server (loopback only)."""
    import http.server
    import ssl

    from shim.service.metrics_server import self_signed

    cert, key = self_signed(["127.0.0.1"], str(tmp_path))
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-123\n")
    (sa / "ca.crt").write_text(Path(cert).read_text())
    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.command, self.path, dict(self.headers), body))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setattr(guard, "SA_DIR", str(sa))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
    monkeypatch.setenv("NODE_NAME", "ks-n1")
    try:
        guard.report_failed({"namespace": "team-a", "name": "web-1", "uid": "u"}, "the agent went away")
    finally:
        server.server_close()
    [(method, path, headers, body)] = seen
    assert method == "PATCH"
    assert path == "/apis/kubectl-snapshot.io/v1alpha1/namespaces/team-a/podsnapshots/web-1/status"
    assert headers["Authorization"] == "Bearer tok-123"
    assert headers["Content-Type"] == "application/merge-patch+json"
    status = json.loads(body)["status"]
    assert status["phase"] == "Failed" and status["stage"] == "failed" and status["node"] == "ks-n1"
    assert status["reason"] == "Interrupted" and status["message"] == "the agent went away"
    assert "keeps running" in status["hint"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Succeeded": "False", "Failed": "True"}


def test_cgroup_paths_are_rebased_onto_the_current_host_process() -> None:
    """containerd (the host process cgroup paths are reached through) restarted: the guard still checks."""
    from shim.freeze_guard import _rebase

    old = "/proc/9526/root/sys/fs/cgroup/freezer/ks-n1/kubepods/pod1/c1"
    assert (
        _rebase(old, "/proc/30984/root/sys/fs/cgroup")
        == "/proc/30984/root/sys/fs/cgroup/freezer/ks-n1/kubepods/pod1/c1"
    )
    assert _rebase(old, "/sys/fs/cgroup") == "/sys/fs/cgroup/freezer/ks-n1/kubepods/pod1/c1"
    assert _rebase("/sys/fs/cgroup/freezer/x", "/proc/1/root/sys/fs/cgroup") == "/sys/fs/cgroup/freezer/x"


def test_a_persistent_private_guard_leaves_with_its_owner(tmp_path: Path) -> None:
    """`ks-agent serve`'s guard has no --once: it exits, idle, once the process that started it is gone
    (a SIGKILL of the server leaves no guard behind), and not before."""
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        g = guard.Guard(str(tmp_path / "g.sock"), str(tmp_path / "holds"), owner_pid=owner.pid)
        assert not g._should_exit()
    finally:
        owner.kill()
        owner.wait()
    assert g._should_exit()
