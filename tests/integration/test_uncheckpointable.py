"""Pods CRIU cannot checkpoint, one class each (threat A5): its refusal comes back with the lines of its
log, and the container runs on. A class CRIU does checkpoint is restored instead, and shown to work.

Each workload is Python in the python image: it sets up its class, then counts into /tmp/count (a token
of its memory and the count, as tests.integration.test_agent_roundtrip's counter), so that "runs on"
and "restored with its memory" are read the same way for every class.
"""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    read_counter,
    restore_on,
    unique,
    wait_for,
)
from tests.support.containerd import ContainerdDaemon, containerd_a, containerd_b
from tests.support.images import python_image
from tests.support.registry import registry

pytestmark = pytest.mark.integration

__all__ = ["cleanup", "containerd_a", "containerd_b", "registry"]  # fixtures

# python3-minimal (the python image) has no uuid, ctypes, tty or fcntl: only what posix and socket give.
COUNT = (
    "import os, time\n"
    "tok = os.urandom(16).hex()\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    step()\n"
    "    open('/tmp/count.t', 'w').write('%s %d' % (tok, i)); os.replace('/tmp/count.t', '/tmp/count')\n"
    "    time.sleep(0.05)\n"
)

# No set-up: traced from outside, by a debugger on the node (the tracer below).
PLAIN = "def step(): pass\n"

# Connected to a Unix socket whose listener is outside the container (on the host, through /sock).
EXTERNAL_PEER = "import socket\ns = socket.socket(socket.AF_UNIX); s.connect('/sock/s')\ndef step(): pass\n"

# A pseudo-terminal pair (/dev/ptmx, a /dev/pts slave): each step writes a line through it and reads it
# back (canonical mode; the echo read off the master so that it never fills up).
PTY_DEVICE = (
    "import os\n"
    "master, slave = os.openpty()\n"
    "def step():\n"
    "    os.write(master, b'x\\n'); assert os.read(slave, 16) == b'x\\n'; os.read(master, 64)\n"
)

# A POSIX (fcntl) write lock held on a file of a host directory bind-mounted at /data.
LOCK_OUTSIDE = (
    "import os\nheld = os.open('/data/lock', os.O_RDWR | os.O_CREAT); os.lockf(held, os.F_TLOCK, 0)\ndef step(): pass\n"
)

# A debugger attached to a task (PTRACE_SEIZE: it runs on, traced) until this process is killed.
TRACER = (
    "import ctypes, sys, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "assert libc.ptrace(0x4206, int(sys.argv[1]), None, None) == 0, ctypes.get_errno()\n"
    "print('attached', flush=True)\n"
    "time.sleep(3600)\n"
)


def start(c: ContainerdClient, d: ContainerdDaemon, cid: str, setup: str, mounts: list[dict[str, object]]) -> None:
    c.run_container(
        cid,
        image=python_image(d),
        args=["python3", "-c", setup + COUNT],
        mounts=mounts,
        runc_options=d.runc_options,
    )
    wait_for(lambda: read_counter(c, cid)[1] > 5, what="the workload to count")


def counting(c: ContainerdClient, cid: str) -> str:
    """The token of the workload's memory, once its count has gone on."""
    task = c.get_task(cid)
    assert task is not None and task.status == "running"
    tok, v = read_counter(c, cid)
    wait_for(lambda: read_counter(c, cid)[1] > v + 2, what="the count to go on")
    return tok


def bind(source: Path, destination: str) -> dict[str, object]:
    return {"destination": destination, "type": "bind", "source": str(source), "options": ["rbind", "rw"]}


def assert_refused_with_the_log(proc, c: ContainerdClient, cid: str, ref: str, *lines: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.startswith("error:") and "hint:" in proc.stderr, proc.stderr
    assert "Error (" in proc.stderr, proc.stderr  # CRIU's own error lines, from its dump.log
    for line in lines:
        assert line in proc.stderr, proc.stderr
    counting(c, cid)
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(Reference.parse(ref))


def test_a_ptraced_process_is_refused_and_runs_on(containerd_a, registry, cleanup):  # type: ignore[no-untyped-def]
    """A process a debugger is attached to (strace, gdb: here PTRACE_SEIZE from the node) cannot be seized
    by CRIU: refused with CRIU's lines; it runs on. The legitimate case: once the debugger is gone, the
    same container is snapshotted."""
    a = client(containerd_a)
    cid = unique("ptraced")
    cleanup(a, cid)
    start(a, containerd_a, cid, PLAIN, [])
    task = a.get_task(cid)
    assert task is not None
    tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(task.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert tracer.stdout is not None and tracer.stdout.readline().strip() == "attached"
        ref = registry.ref("a5-ptrace", "v1")
        proc = agent("checkpoint", *on(containerd_a), "--to", ref, cid, check=False)
        assert_refused_with_the_log(proc, a, cid, ref)
    finally:
        tracer.kill()
        tracer.wait(30)
    ok = agent("checkpoint", *on(containerd_a), "--to", registry.ref("a5-ptrace", "v2"), cid, check=False)
    assert ok.returncode == 0, ok.stderr
    counting(a, cid)


def test_an_external_unix_socket_peer_is_refused_and_runs_on(containerd_a, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    sockdir = tmp_path / "sock"
    sockdir.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sockdir / "s"))
    server.listen(1)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    cid = unique("extpeer")
    cleanup(a, cid)
    try:
        start(a, containerd_a, cid, EXTERNAL_PEER, [bind(sockdir, "/sock")])
        ref = registry.ref("a5-extpeer", "v1")
        proc = agent("checkpoint", *on(containerd_a), "--to", ref, cid, check=False)
        assert_refused_with_the_log(proc, a, cid, ref)
        assert "unix" in proc.stderr.lower(), proc.stderr
    finally:
        server.close()


def test_a_pty_device_is_checkpointed_and_restored_working(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    """The device class: the devices a container may open are the pty pair and the memory devices (null,
    zero, random, ...; shim/containerd/spec.py), and CRIU dumps them all. So this class is not refused:
    the pty pair is checkpointed and restored, and the restored process still writes and reads through it
    (each count is one round trip through the pty)."""
    a, b = client(containerd_a), client(containerd_b)
    cid, new = unique("pty"), unique("pty-r")
    cleanup(a, cid)
    cleanup(b, new)
    start(a, containerd_a, cid, PTY_DEVICE, [])
    tok = counting(a, cid)
    ref = registry.ref("a5-pty", "v1")
    out = json.loads(agent("checkpoint", *on(containerd_a), "--stop", "-o", "json", "--to", ref, cid).stdout)
    python_image(containerd_b)
    agent(*restore_on(containerd_b), out["reference"], new)
    assert counting(b, new) == tok


def test_a_lock_on_a_host_file_is_checkpointed_and_restored_held(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry, cleanup, tmp_path
):
    """The lock class: CRIU dumps file locks (the agent asks for them, ``--file-locks``), a POSIX lock on a host
    file of a bind mount too. So this class is not refused: the snapshot (with ``--stop``, which releases the lock)
    restores, and the restored process holds the lock again: the host cannot take it."""
    a, b = client(containerd_a), client(containerd_b)
    data = tmp_path / "data"
    data.mkdir()
    cid, new = unique("flock"), unique("flock-r")
    cleanup(a, cid)
    cleanup(b, new)
    start(a, containerd_a, cid, LOCK_OUTSIDE, [bind(data, "/data")])
    tok = counting(a, cid)

    def held() -> bool:
        with open(data / "lock", "r+") as f:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.lockf(f, fcntl.LOCK_UN)
            return False

    assert held()
    ref = registry.ref("a5-flock", "v1")
    out = json.loads(agent("checkpoint", *on(containerd_a), "--stop", "-o", "json", "--to", ref, cid).stdout)
    wait_for(lambda: not held(), what="the stopped container to release its lock")
    python_image(containerd_b)
    agent(*restore_on(containerd_b), out["reference"], new)
    assert counting(b, new) == tok
    assert held()
