"""`ks-agent checkpoint|restore` served by a warm agent on the node-local socket (shim/service/localapi.py):
real containerd, runc, CRIU and registry; the client is the `ks-agent` a user runs, the server
`ks-agent serve`, the DaemonSet's `run` minus Kubernetes."""

from __future__ import annotations

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
from typing import Any

import pytest

from shim.service import localapi
from tests.integration.test_agent_roundtrip import (
    AGENT,
    WRAPPER,
    agent,
    cleanup,
    client,
    on,
    read_counter,
    start_counter,
    task_status,
    unique,
    wait_for,
)
from tests.support.containerd import ContainerdDaemon, containerd_a
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer, registry
from tests.support.signing import signing_env

pytestmark = pytest.mark.integration


class Client:
    """A `ks-agent` a user runs: the Python program, or the agent image's (hack/agent_image.py): the
    static launcher in front of it, which sends a served command itself (launcher/agentclient.go).
    Here the launcher's Python program is a shell that notes each start, then runs the Python ks-agent."""

    def __init__(self, program: str, starts: Path | None = None) -> None:
        self.program, self.starts = program, starts

    def __call__(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return agent(*args, program=self.program, **kw)

    def python_starts(self) -> int:
        return len(self.starts.read_text().splitlines()) if self.starts and self.starts.exists() else 0


@pytest.fixture(scope="module")
def launcher_client(tmp_path_factory: pytest.TempPathFactory) -> Client:
    d = tmp_path_factory.mktemp("ks-agent")
    client_path, starts = d / "ks-agent", d / "python-starts"
    repo = Path(__file__).resolve().parents[2]
    go = shutil.which("go") or "/usr/local/go/bin/go"
    build = subprocess.run(
        [go, "build", "-trimpath", "-o", str(client_path), "."], cwd=repo / "launcher",
        env={**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    noted = f'echo "$*" >> {starts}; exec "$0" "$@"'
    Path(f"{client_path}.launch").write_text(localapi.client_launch(["/bin/sh", "-c", noted, AGENT]))
    return Client(str(client_path), starts)


@pytest.fixture(params=["python", "launcher"])
def ks_agent(request: pytest.FixtureRequest) -> Client:
    return Client(AGENT) if request.param == "python" else request.getfixturevalue("launcher_client")


class Served:
    def __init__(self, sock: Path, log: Path) -> None:
        self.sock, self.log = sock, log

    def env(self) -> dict[str, str]:
        return {localapi.SOCKET_ENV: str(self.sock)}

    def lines(self, what: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if what in line]


@pytest.fixture
def served(containerd_a: ContainerdDaemon, tmp_path: Path) -> Iterator[Served]:
    sock, log = tmp_path / "agent.sock", tmp_path / "serve.log"
    env = {**os.environ, **signing_env()}
    with open(log, "w") as out:
        proc = subprocess.Popen([AGENT, "serve", *on(containerd_a), "--socket", str(sock)], stderr=out, env=env)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "ks-agent serve did not listen within 60 s"
            time.sleep(0.05)
        yield Served(sock, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    assert not sock.exists()  # removed on the way out


def test_checkpoint_and_restore_through_the_agent(containerd_a, registry, cleanup, served, ks_agent):  # type: ignore[no-untyped-def]
    c = client(containerd_a)
    agent, starts = ks_agent, ks_agent.python_starts()
    cid, new = unique("served"), unique("served-back")
    cleanup(c, cid)
    cleanup(c, new)
    start_counter(c, containerd_a, cid, busybox_image(containerd_a))
    tok, before = read_counter(c, cid)

    to = registry.ref("served", "v1")
    out = agent("checkpoint", *on(containerd_a), "-o", "json", "--to", to, cid, env=served.env())
    snap = json.loads(out.stdout)
    assert served.lines(f"node-local checkpoint served: {snap['reference']}")  # by the agent, not this process
    assert snap["containers"] == [cid] and snap["signedBy"] and snap["timingsMs"]["freeze_ms"] > 0
    assert task_status(c, cid) == "running"  # as standalone: without --stop the original goes on

    restored = agent(
        "restore", *on(containerd_a), "--runtime-binary", WRAPPER, "--runc-root", containerd_a.runc_root,
        "-o", "json", snap["reference"], new, env=served.env(),
    )  # fmt: skip
    info = json.loads(restored.stdout)
    assert served.lines("node-local restore served")
    assert info["containers"][0]["name"] == new and info["provenance"].startswith("signed by trusted key ")
    tok_after, after = read_counter(c, new)
    assert tok_after == tok and after >= before  # the same process memory, counting on
    wait_for(lambda: read_counter(c, new)[1] > after + 5, what="the restored counter to advance")
    # the agent's freeze guard outlives one checkpoint: the next one is served as well
    again = agent("checkpoint", *on(containerd_a), "-o", "json", "--to", registry.ref("served", "v2"), new,
                  env=served.env())  # fmt: skip
    assert served.lines(f"node-local checkpoint served: {json.loads(again.stdout)['reference']}")
    assert task_status(c, new) == "running"
    # as text, rendered by the agent for its client: the same lines as the standalone command's
    text = agent("checkpoint", *on(containerd_a), "--to", registry.ref("served", "v3"), new, env=served.env())
    ref = served.lines("node-local checkpoint served: ")[-1].rsplit(": ", 1)[1]
    assert text.stdout == f"{ref}\n" and text.stderr == ""
    assert ks_agent.python_starts() == starts  # the launcher's client served all four without Python


def test_errors_read_as_the_standalone_commands(containerd_a, registry, served, ks_agent):  # type: ignore[no-untyped-def]
    args = ["checkpoint", *on(containerd_a), "--to", registry.ref("served", "missing"), unique("no-such")]
    via_agent = ks_agent(*args, check=False, env=served.env())
    alone = agent(*args, check=False, env={localapi.SOCKET_ENV: "none"})
    assert served.lines("node-local checkpoint failed")
    assert via_agent.returncode == alone.returncode != 0
    assert via_agent.stderr == alone.stderr and via_agent.stderr.startswith("error: ")


def test_what_the_agent_cannot_serve_runs_standalone(containerd_a, registry, served, ks_agent):  # type: ignore[no-untyped-def]
    """Another containerd namespace, another value of a variable the command reads, a usage error: the
    agent declines and the client runs the command itself (same answer as without the agent)."""
    agent, starts = ks_agent, ks_agent.python_starts()
    missing = unique("no-such")
    other_ns = agent(
        "checkpoint", "-a", containerd_a.address, "-n", "elsewhere", "--to", registry.ref("s", "x"), missing,
        check=False, env=served.env(),
    )  # fmt: skip
    assert other_ns.returncode != 0 and "elsewhere" not in " ".join(served.lines("served"))
    env = {**served.env(), "KUBECTL_SNAPSHOT_PAGE_DELTAS": "0"}
    agent("checkpoint", *on(containerd_a), "--to", registry.ref("s", "y"), missing, check=False, env=env)
    usage = agent("checkpoint", *on(containerd_a), "--bogus", check=False, env=served.env())
    assert usage.returncode == 2 and "--bogus" in usage.stderr
    declined = served.lines("declined")
    assert len(declined) == 3, declined
    assert "namespace" in declined[0] and "KUBECTL_SNAPSHOT_PAGE_DELTAS" in declined[1] and "usage" in declined[2]
    if ks_agent.starts is not None:  # declined by the agent: the launcher ran the Python program, standalone
        assert ks_agent.python_starts() == starts + 3


def test_only_root_is_served(served: Served) -> None:
    """The socket is root's alone; opened to all here, the kernel's peer credentials still keep another
    uid out."""
    assert served.sock.stat().st_mode & 0o077 == 0  # root's alone
    os.chmod(served.sock, 0o666)
    opened = [d for d in served.sock.parents if d != Path("/") and not d.stat().st_mode & 0o001]
    modes = {d: d.stat().st_mode & 0o7777 for d in opened}
    for d in opened:  # pytest's directories are root's alone: let the other uid reach the socket
        os.chmod(d, modes[d] | 0o001)
    probe = (
        "import os, socket, sys; os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        # the agent may answer and close before the request is all sent: its answer is read all the same
        'try: s.sendall(b\'{"v": 1, "command": "checkpoint", "argv": []}\\n\')\n'
        "except (BrokenPipeError, ConnectionResetError): pass\n"
        "print(s.makefile().readline())\n"
    )
    try:
        cmd = [sys.executable, "-c", probe, str(served.sock)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    finally:
        for d, mode in modes.items():
            os.chmod(d, mode)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["exit"] == 1 and "serves only uid 0, not 65534" in answer["error"], out


def test_a_dead_agents_socket_is_no_agent(tmp_path: Path, containerd_a: ContainerdDaemon, ks_agent: Client) -> None:
    agent = ks_agent
    stale = tmp_path / "agent.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the name stays, nobody listens: ECONNREFUSED
    proc = agent(
        "checkpoint", *on(containerd_a), "--to", "127.0.0.1:1/x:y", unique("no-such"), check=False,
        env={localapi.SOCKET_ENV: str(stale)},
    )  # fmt: skip
    assert proc.returncode != 0 and "node's agent" not in proc.stderr and proc.stderr.startswith("error: ")
