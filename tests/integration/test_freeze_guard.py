"""The freeze guard (shim/freeze_guard.py) against real containers and the kernel's cgroup freezer.

A holder process freezes a running counter container through the guard, as the agent does; the holder
is then killed (SIGKILL), stopped (SIGSTOP) or the guard itself is killed: each time the container runs
again within 2 s of the kill or of the deadline, its counter goes on from where it was (same token:
the same process, nothing lost). Then the standalone `kubectl-snapshot-agent checkpoint` is killed while
the container is frozen: its private guard thaws it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.engine.staging import StatePaths
from shim.host import freezer, memwork
from tests.integration.test_agent_roundtrip import AGENT, agent, cleanup, client, on, start_counter, unique
from tests.support.containerd import containerd_a
from tests.support.images import busybox_image
from tests.support.registry import registry

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from shim.freeze_guard import GuardClient
fz = GuardClient(sys.argv[1]).freezer_for(int(sys.argv[2]))
assert fz is not None
fz.freeze(deadline_s=float(sys.argv[3]))
print("frozen", flush=True)
time.sleep(3600)
"""


def count(pid: int) -> tuple[str, int]:
    """The counter, read through the task's root from the host (an exec would hang in a frozen container);
    the counter rewrites the file in place, so a read may catch it empty: read again."""
    for _ in range(100):
        parts = Path(f"/proc/{pid}/root/tmp/count").read_text().split()
        if len(parts) == 2:
            return parts[0], int(parts[1])
        time.sleep(0.01)
    raise AssertionError("the counter file stays empty")


@pytest.fixture
def counter(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("guarded")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    task = a.get_task(cid)
    assert task is not None
    pid = task.pid
    fz = freezer.lookup(pid)
    assert fz is not None, "the task's freezer should be placeable on this machine"
    yield a, containerd_a, cid, pid, fz
    fz.thaw()


@contextlib.contextmanager
def guard_process(tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    sock = str(tmp / "guard.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shim.freeze_guard", "--socket", sock, "--state-dir", str(tmp / "holds")], cwd=REPO
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock):
            assert proc.poll() is None and time.monotonic() < deadline, "the guard did not start"
            time.sleep(0.02)
        yield proc, sock
    finally:
        proc.kill()
        proc.wait()


def hold(sock: str, pid: int, deadline_s: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, sock, str(pid), str(deadline_s)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "frozen"
    return holder


def assert_frozen(fz: freezer.CgroupFreezer, pid: int) -> tuple[str, int]:
    assert fz.frozen()
    before = count(pid)
    time.sleep(0.5)  # the counter ticks every 50 ms when it runs
    assert count(pid) == before, "the counter went on while frozen"
    return before


def seconds_until_thawed(fz: freezer.CgroupFreezer, since: float, limit: float = 10.0) -> float:
    while fz.frozen():
        assert time.monotonic() - since < limit, "still frozen"
        time.sleep(0.01)
    return time.monotonic() - since


def assert_goes_on(pid: int, before: tuple[str, int]) -> None:
    deadline = time.monotonic() + 5
    while count(pid)[1] <= before[1] + 2:
        assert time.monotonic() < deadline, "the counter did not go on"
        time.sleep(0.05)
    assert count(pid)[0] == before[0]  # the same process: nothing was restarted


def test_killing_the_holder_thaws_within_two_seconds_every_time(counter, tmp_path):  # type: ignore[no-untyped-def]
    a, _, cid, pid, fz = counter
    with guard_process(tmp_path) as (_guard, sock):
        for _ in range(3):
            holder = hold(sock, pid, deadline_s=300)
            before = assert_frozen(fz, pid)
            t0 = time.monotonic()
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            assert seconds_until_thawed(fz, t0) < 2.0
            assert_goes_on(pid, before)
    assert a.get_task(cid).pid == pid and a.get_task(cid).status == "running"


def test_a_stopped_holder_is_thawed_at_the_deadline(counter, tmp_path):  # type: ignore[no-untyped-def]
    _, _, _, pid, fz = counter
    with guard_process(tmp_path) as (_guard, sock):
        t_freeze = time.monotonic()
        holder = hold(sock, pid, deadline_s=3)
        holder.send_signal(signal.SIGSTOP)
        try:
            before = assert_frozen(fz, pid)
            waited = seconds_until_thawed(fz, t_freeze)
            assert 2.5 < waited < 3.0 + 2.0, waited
            assert_goes_on(pid, before)
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()


def test_a_killed_guard_thaws_what_it_held_when_it_starts_again(counter, tmp_path):  # type: ignore[no-untyped-def]
    _, _, _, pid, fz = counter
    with guard_process(tmp_path) as (guard, sock):
        holder = hold(sock, pid, deadline_s=300)
        before = assert_frozen(fz, pid)
        guard.send_signal(signal.SIGKILL)
        guard.wait()
        assert fz.frozen()  # nobody thaws... until the guard is back
        with guard_process(tmp_path):
            assert not fz.frozen()
        assert_goes_on(pid, before)
        holder.kill()
        holder.wait()


def test_a_guard_told_to_stop_thaws_first(counter, tmp_path):  # type: ignore[no-untyped-def]
    """SIGTERM (the kubelet stopping the agent's pod): the guard thaws what it holds, then exits."""
    _, _, _, pid, fz = counter
    with guard_process(tmp_path) as (guard, sock):
        holder = hold(sock, pid, deadline_s=300)
        try:
            before = assert_frozen(fz, pid)
            t0 = time.monotonic()
            guard.send_signal(signal.SIGTERM)
            assert guard.wait(10) == 0
            assert seconds_until_thawed(fz, t0) < 2.0
            assert_goes_on(pid, before)
        finally:
            holder.kill()
            holder.wait()


def test_the_guard_refuses_to_freeze_itself_or_the_host(tmp_path):  # type: ignore[no-untyped-def]
    def ask(sock: str, pid: int) -> dict:  # type: ignore[type-arg]
        with socket.socket(socket.AF_UNIX) as c:
            c.settimeout(15)
            c.connect(sock)
            c.sendall(json.dumps({"op": "freeze", "pid": pid, "deadline_s": 5}).encode() + b"\n")
            return json.loads(c.makefile().readline())  # type: ignore[no-any-return]

    with guard_process(tmp_path) as (guard, sock):
        sibling = subprocess.Popen(["sleep", "60"])  # in the test's own cgroup, which holds the peer
        try:
            for pid in (guard.pid, 1, os.getpid(), sibling.pid):
                reply = ask(sock, pid)
                assert not reply["ok"], (pid, reply)
            assert guard.poll() is None
            assert sibling.poll() is None
        finally:
            sibling.kill()
            sibling.wait()


def test_a_killed_standalone_checkpoint_is_thawed_by_its_private_guard(counter, registry):  # type: ignore[no-untyped-def]
    """`kubectl-snapshot-agent checkpoint` killed while the container is frozen (the test hook holds the
    freeze): the CLI's private guard, a child in its own session, thaws it and then exits."""
    _, daemon, cid, pid, fz = counter
    for _ in range(2):
        before = count(pid)
        env = dict(os.environ, KUBECTL_SNAPSHOT_TEST_FROZEN_HOLD_S="60")
        cli = subprocess.Popen(
            [AGENT, "checkpoint", *on(daemon), "--to", registry.ref("killed", "v1"), cid],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not fz.frozen():
            assert cli.poll() is None and time.monotonic() < deadline, "the checkpoint did not freeze"
            time.sleep(0.01)
        assert_frozen(fz, pid)
        guard_pid, guard_dir = private_guard_of(cli.pid)
        t0 = time.monotonic()
        cli.send_signal(signal.SIGKILL)
        cli.wait()
        assert seconds_until_thawed(fz, t0) < 2.0
        assert_goes_on(pid, before)
        # The guard exits once its last hold is gone; its directory (socket gone, the log) stays as the
        # record of what it did for a caller that died, which this test reads and then removes.
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{guard_pid}") and _state(guard_pid) != "Z":
            assert time.monotonic() < deadline, "the private guard did not exit after its last hold"
            time.sleep(0.05)
        log = (guard_dir / "guard.log").read_text()
        assert "the agent went away while the pod was frozen" in log and "the freeze guard thawed it" in log, log
        assert not (guard_dir / "guard.sock").exists()
        shutil.rmtree(guard_dir)
        # the killed command's dump stays where it was written (the node's memory work area, a small
        # container's) until `recover`, which the agent runs at its start, removes it
        left = memwork.leftovers(StatePaths.from_env().root)
        assert left, "the killed checkpoint's work dir should be in the memory work area"
        assert "nothing to recover" in agent("recover", *on(daemon)).stdout  # the guard thawed it already
        assert not set(left) & set(memwork.leftovers(StatePaths.from_env().root))
    area = memwork.area_dir(StatePaths.from_env().root)
    assert not os.path.exists(area) or os.listdir(area) == []  # nothing left in memory (the tmpfs may stay)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "gone"


def private_guard_of(parent: int) -> tuple[int, Path]:
    """The private guard a standalone checkpoint started (a child of `parent`) and its directory."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"shim.freeze_guard" in argv:
            sock = Path(argv[argv.index(b"--socket") + 1].decode())
            assert sock.parent.name.startswith("kubectl-snapshot-guard-"), sock
            return int(entry.name), sock.parent
    raise AssertionError(f"no private guard among the children of {parent}")


def test_a_private_guard_starts_beside_the_caller_and_one_never_asked_to_freeze_is_stopped() -> None:
    from shim.freeze_guard import private_guard

    t = time.monotonic()
    with private_guard() as g:
        handed = time.monotonic() - t
        tmp = os.path.dirname(g.socket_path)
    assert handed < 0.05, f"private_guard waited {handed:.3f}s for the guard before handing it over"
    assert time.monotonic() - t < 3 and not os.path.exists(tmp)
    with private_guard() as g:
        g.wait_ready()  # what the first freeze does
        assert os.path.exists(g.socket_path)
        tmp = os.path.dirname(g.socket_path)
    assert not os.path.exists(tmp)
