"""shim/service/localapi.py: the node-local socket's protocol, on real Unix sockets in this process (the commands
it serves are tested end to end in tests/integration/test_agent_serve.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from shim.agent_entry import forwarded
from shim.service import localapi


def test_env_differences_name_only_what_the_commands_read() -> None:
    server = {"KUBECTL_SNAPSHOT_STATE_DIR": "/s", "TERM": "xterm", "HOME": "/root"}
    client = {
        "KUBECTL_SNAPSHOT_STATE_DIR": "/s",
        "TERM": "dumb",  # not read by the commands
        "HOME": "/root",
        "CONTAINERD_NAMESPACE": "k8s.io",
        localapi.SOCKET_ENV: "/x.sock",  # how the client found the agent: never compared
    }
    assert localapi.env_differences(client, server) == ["CONTAINERD_NAMESPACE"]
    assert localapi.env_differences({**client, "CONTAINERD_NAMESPACE": ""}, server) == ["CONTAINERD_NAMESPACE"]
    client.pop("CONTAINERD_NAMESPACE")
    assert localapi.env_differences(client, server) == []
    # where a credential helper is found, TLS trust, proxies: requests and the docker config read them
    for name in ("PATH", "REQUESTS_CA_BUNDLE", "HTTPS_PROXY", "no_proxy"):
        assert localapi.env_differences({**client, name: "x"}, server) == [name]


def test_socket_path() -> None:
    assert localapi.socket_path({}, "/var/lib/ks") == "/var/lib/ks/agent.sock"
    assert localapi.socket_path({localapi.SOCKET_ENV: "/run/a.sock"}, "/s") == "/run/a.sock"
    for off in ("none", "", "OFF"):
        assert localapi.socket_path({localapi.SOCKET_ENV: off}, "/s") is None


def _serve(tmp_path: Path, handler: localapi.Handler) -> localapi.LocalServer:
    return localapi.LocalServer(str(tmp_path / "s" / "agent.sock"), handler).start()


def test_progress_then_the_answer(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: dict[str, Any], send: localapi.Send) -> None:
        assert request["command"] == "checkpoint" and request["argv"] == ["--to", "r/x:y", "c1"]
        assert request["cwd"] == os.getcwd()
        workers = [threading.Thread(target=send, args=({"bytes": [i, 10]},)) for i in range(10)]
        for w in workers:  # progress arrives from the packaging's threads: lines never interleave
            w.start()
        for w in workers:
            w.join()
        send({"phase": "upload"})
        send({"result": {"reference": "r/x@sha256:" + "0" * 64}, "output": "json"})

    server = _serve(tmp_path, handler)
    try:
        answer = localapi.forward(server.path, "checkpoint", ["--to", "r/x:y", "c1"], seen.append)
    finally:
        server.stop()
    assert answer == {"result": {"reference": "r/x@sha256:" + "0" * 64}, "output": "json"}
    assert sorted(m["bytes"][0] for m in seen if "bytes" in m) == list(range(10)) and seen[-1] == {"phase": "upload"}
    assert not os.path.exists(server.path)


def test_no_agent_is_none_but_a_broken_answer_is_an_error(tmp_path: Path) -> None:
    """Before the request is sent the client may run the command itself; after, it must not: the agent
    may have acted on it (a checkpoint with --stop, say)."""
    assert localapi.forward(str(tmp_path / "nobody.sock"), "checkpoint", [], print) is None

    def hang_up(request: dict[str, Any], send: localapi.Send) -> None:
        send({"phase": "freeze"})  # then the agent dies

    server = _serve(tmp_path, hang_up)
    try:
        answer = localapi.forward(server.path, "checkpoint", [], lambda m: None)
    finally:
        server.stop()
    assert answer is not None and answer["exit"] == 1
    assert "did not finish the checkpoint" in answer["error"] and "hint:" in answer["error"]


def test_unknown_versions_and_commands_are_declined(tmp_path: Path) -> None:
    server = _serve(tmp_path, lambda request, send: send({"result": {}}))
    try:
        for line in (b'{"v": 2, "command": "checkpoint"}\n', b'{"v": 1, "command": "install-node"}\n'):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(server.path)
                s.sendall(line)
                assert b'"declined"' in s.makefile("rb").readline()
    finally:
        server.stop()


def test_the_client_falls_back_when_declined_and_prints_errors(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    declined: dict[str, Any] = {"declined": "another working directory"}
    failed: dict[str, Any] = {"error": "error: no such container\nhint: x", "exit": 1}
    answers = iter([declined, failed])
    server = _serve(tmp_path, lambda request, send: send(next(answers)))
    monkeypatch.setenv(localapi.SOCKET_ENV, server.path)
    try:
        assert forwarded(["checkpoint", "--to", "r/x:y", "c1"]) is None  # declined: run standalone
        assert forwarded(["checkpoint", "--to", "r/x:y", "c1"]) == 1
        assert capsys.readouterr().err == "error: no such container\nhint: x\n"
        assert forwarded(["inspect", "r/x:y"]) is None  # not a served command
        assert forwarded(["checkpoint", "--help"]) is None
    finally:
        server.stop()
    assert forwarded(["checkpoint", "c1"]) is None  # no agent listening


def test_the_client_prints_what_the_agent_rendered(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """The agent renders its answer in the client's -o format (what the launcher's client prints as it is,
    launcher/agentclient.go); an answer without that text is formatted here, as before."""
    result = {"reference": "r/x@sha256:1"}
    answers = iter([
        {"result": result, "output": "json", "rendered": "as the agent rendered it\n"},
        {"result": result, "output": "json"},
    ])  # fmt: skip
    server = _serve(tmp_path, lambda request, send: send(next(answers)))
    monkeypatch.setenv(localapi.SOCKET_ENV, server.path)
    try:
        assert forwarded(["checkpoint", "-o", "json", "--to", "r/x:y", "c1"]) == 0
        assert capsys.readouterr().out == "as the agent rendered it\n"
        assert forwarded(["checkpoint", "-o", "json", "--to", "r/x:y", "c1"]) == 0
        assert json.loads(capsys.readouterr().out) == result
    finally:
        server.stop()


def test_the_launchers_client_reads_the_same_names() -> None:
    """launcher/agentclient.go takes the socket variable, the state dir and the variables a request
    carries from its launch configuration: client_launch() gives this module's own."""
    from kubectl_snapshot.core import constants as C

    launch = json.loads(localapi.client_launch(["/venv/bin/python3", "/venv/libexec/ks-agent"]))
    assert launch["argv"] == ["/venv/bin/python3", "/venv/libexec/ks-agent"]
    conf = launch["agentClient"]
    assert conf["version"] == localapi.VERSION and conf["commands"] == list(localapi.COMMANDS)
    assert (conf["socketEnv"], conf["socketName"]) == (localapi.SOCKET_ENV, localapi.SOCKET_NAME)
    assert (conf["stateDirEnv"], conf["defaultStateDir"]) == (C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR)
    env = {"HOME": "/root", "KUBECTL_SNAPSHOT_X": "1", "CONTAINERD_NAMESPACE": "n", "OTHER": "o",
           localapi.SOCKET_ENV: "/s", "TMPDIR": "/t"}  # fmt: skip
    kept = {
        k for k in env if k != conf["socketEnv"] and (k in conf["envNames"] or k.startswith(tuple(conf["envPrefixes"])))
    }
    assert kept == set(localapi.relevant_env(env))


def test_the_daemonsets_agent_serves_on_its_state_dir_and_goes_on_without(tmp_path: Path, monkeypatch: Any) -> None:
    """`ks-agent run` listens on agent.sock in its node's state dir (here it declines a request for a
    namespace other than k8s.io); where it cannot listen, the agent runs on without the socket."""
    from types import SimpleNamespace

    from shim.agent_cli import _node_local_api

    monkeypatch.delenv(localapi.SOCKET_ENV, raising=False)
    containerd = str(tmp_path / "containerd.sock")
    settings = SimpleNamespace(
        state_dir=str(tmp_path / "state"), containerd_socket=containerd, guard_socket=str(tmp_path / "guard.sock")
    )
    path = tmp_path / "state" / localapi.SOCKET_NAME
    with _node_local_api(settings):
        argv = ["-a", containerd, "-n", "default", "--to", "127.0.0.1:5000/x:y", "c1"]
        answer = localapi.forward(str(path), "checkpoint", argv, lambda m: None)
        assert answer is not None and "k8s.io" in answer["declined"]
    assert not path.exists()
    settings.state_dir = str(tmp_path / ("x" * 120))  # longer than a Unix socket's name may be
    with _node_local_api(settings):
        assert not (Path(settings.state_dir) / localapi.SOCKET_NAME).exists()


def test_a_client_that_does_not_read_never_holds_up_the_work(tmp_path: Path) -> None:
    """Progress goes through a queue and a writer thread: 20000 lines to a client that reads nothing
    (its socket buffer fills after a few thousand) cost the work no wait; the surplus is dropped."""
    done = threading.Event()

    def chatty(request: dict[str, Any], send: localapi.Send) -> None:
        for i in range(20000):
            send({"bytes": [i, 20000]})
        done.set()
        send({"result": {}})

    server = _serve(tmp_path, chatty)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            s.sendall(b'{"v": 1, "command": "checkpoint", "argv": []}\n')
            assert done.wait(10)  # the client has not read a byte
            lines = s.makefile("rb").read().splitlines()
    finally:
        server.stop()
    assert 0 < len(lines) < 20000 and lines[-1] == b'{"result":{}}'


def test_the_client_imports_only_what_forwarding_needs() -> None:
    """`ks-agent checkpoint|restore` served by the warm agent: its start-up is part of every served save and
    restore. The client side loads the standard library's basics, the local API and the console's
    output, nothing of the server's (logging, grpc, the engine) and not even typing (annotations only)."""
    code = "import sys, shim.agent_entry, kubectl_snapshot.console.progress; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = {"typing", "logging", "dataclasses", "grpc", "requests", "urllib3", "click", "tqdm", "shim.engine"}
    assert not heavy & set(out), sorted(heavy & set(out))
    assert not [m for m in out if m.startswith(("shim.engine.", "kubectl_snapshot.adapters", "shim.controller"))]
