"""kubectl's conventions in the plugin: -o wide|name|json|yaml|jsonpath, -l, -A, -w, --dry-run=client|server,
--server/--token/--as, shell completion (kubectl_complete-snapshot), the node tools' names.

The plugin runs as a subprocess (as kubectl runs it) against a small API server on loopback that answers
the few REST calls these commands make and records every request, so what is checked is what goes over
the wire: paths, query parameters (labelSelector, dryRun, resourceVersion) and headers (Authorization,
Impersonate-*). The same commands against the real API server are in tests/e2e/test_plugin_manage.py.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from kubectl_snapshot.cli.main import kubectl_args
from kubectl_snapshot.core import jsonpath
from kubectl_snapshot.core.errors import InvalidArgument
from shim.agent_cli import find_wrapper

REPO = Path(__file__).resolve().parents[2]
BASE = "/apis/kubectl-snapshot.io/v1alpha1"


def snap(name: str, ns: str = "team-a", phase: str = "Succeeded", rv: str = "10", pod: str = "web") -> dict[str, Any]:
    return {
        "apiVersion": "kubectl-snapshot.io/v1alpha1",
        "kind": "PodSnapshot",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "resourceVersion": rv,
            "creationTimestamp": "2026-11-30T10:00:00Z",
            "labels": {"kubectl-snapshot.io/pod": pod},
        },
        "spec": {"podName": pod, "destination": f"127.0.0.1:5000/s/{pod}:v1"},
        "status": {
            "phase": phase,
            "node": "ks-n1",
            "size": 4096,
            "stage": "done",
            "reference": f"127.0.0.1:5000/s/{pod}@sha256:" + "a" * 64,
            "message": "",
        },
    }


class FakeAPI:
    """GET/DELETE on podsnapshots (list, watch, get), recording (method, path, query, headers)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.items = [snap("web-1"), snap("db-1", pod="db")]
        self.watches = 0
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _send(self, code: int, payload: Any) -> None:
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _record(self) -> tuple[str, dict[str, list[str]]]:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                api.requests.append(
                    {
                        "method": self.command,
                        "path": parts.path,
                        "query": query,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                    }
                )
                return parts.path, query

            def do_GET(self) -> None:
                path, query = self._record()
                if path.endswith("/podsnapshots") and query.get("watch") == ["true"]:
                    api.watches += 1
                    if api.watches > 1:  # ends `list -w` (a watch that may not continue)
                        self._send(403, {"kind": "Status", "message": "watch forbidden now", "code": 403})
                        return
                    events = [
                        {"type": "ADDED", "object": snap("web-1")},  # already listed: not printed again
                        {"type": "MODIFIED", "object": snap("web-2", phase="Running", rv="11")},
                        {"type": "DELETED", "object": snap("db-1", pod="db", rv="12")},
                    ]
                    body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if path.endswith("/podsnapshots"):
                    selector = (query.get("labelSelector") or [""])[0]
                    items = [i for i in api.items if not selector or selector == "kubectl-snapshot.io/pod=web"]
                    if selector == "kubectl-snapshot.io/pod=web":
                        items = [i for i in items if i["metadata"]["labels"]["kubectl-snapshot.io/pod"] == "web"]
                    self._send(200, {"kind": "PodSnapshotList", "metadata": {"resourceVersion": "10"}, "items": items})
                    return
                name = path.rsplit("/", 1)[-1]
                found = [i for i in api.items if i["metadata"]["name"] == name]
                if found:
                    self._send(200, found[0])
                else:
                    self._send(404, {"kind": "Status", "message": f'"{name}" not found', "code": 404})

            def do_DELETE(self) -> None:
                self._record()
                self._send(200, {"kind": "Status", "status": "Success"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api() -> Iterator[FakeAPI]:
    fake = FakeAPI()
    yield fake
    fake.server.shutdown()


@pytest.fixture
def kubeconfig(tmp_path: Path, api: FakeAPI) -> Path:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: a\n"
        f"clusters: [{{name: c, cluster: {{server: '{api.url}'}}}}]\n"
        "users: [{name: u, user: {token: from-kubeconfig}}]\n"
        "contexts: [{name: a, context: {cluster: c, user: u, namespace: team-a}}]\n"
    )
    return cfg


def plugin(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    env["KUBECONFIG"] = str(kubeconfig) if kubeconfig else "/nonexistent/kubeconfig"
    return subprocess.run(
        [sys.executable, "-c", "from kubectl_snapshot.cli.main import entry; entry()", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


# --- -o -----------------------------------------------------------------------------------------------


def test_list_output_formats(api: FakeAPI, kubeconfig: Path) -> None:
    table = plugin("list", kubeconfig=kubeconfig)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"]
    wide = plugin("list", "-o", "wide", kubeconfig=kubeconfig).stdout.splitlines()
    assert wide[0].split()[-3:] == ["STAGE", "DESTINATION", "MESSAGE"]
    assert "127.0.0.1:5000/s/web:v1" in wide[1] or "127.0.0.1:5000/s/web:v1" in wide[2]
    names = plugin("list", "-o", "name", kubeconfig=kubeconfig).stdout.split()
    assert sorted(names) == ["podsnapshot.kubectl-snapshot.io/db-1", "podsnapshot.kubectl-snapshot.io/web-1"]
    doc = json.loads(plugin("list", "-o", "json", kubeconfig=kubeconfig).stdout)
    assert doc["kind"] == "List" and {i["metadata"]["name"] for i in doc["items"]} == {"web-1", "db-1"}
    jp = plugin(
        "list", "-o", "jsonpath={range .items[*]}{.metadata.name}={.status.phase}{'\\n'}{end}", kubeconfig=kubeconfig
    )
    assert jp.returncode == 0, jp.stderr
    assert sorted(jp.stdout.split()) == ["db-1=Succeeded", "web-1=Succeeded"]
    bad = plugin("list", "-o", "jsonpath={.items[", kubeconfig=kubeconfig)
    assert bad.returncode == 2 and "jsonpath" in bad.stderr
    assert plugin("list", "-o", "xml", kubeconfig=kubeconfig).returncode == 2
    assert all(r["path"] == f"{BASE}/namespaces/team-a/podsnapshots" for r in api.requests)  # no call for usage errors


def test_selector_and_all_namespaces_go_to_the_api_server(api: FakeAPI, kubeconfig: Path) -> None:
    out = plugin("list", "-A", "-l", "kubectl-snapshot.io/pod=web", "-o", "name", kubeconfig=kubeconfig)
    assert out.stdout.split() == ["podsnapshot.kubectl-snapshot.io/web-1"], out.stderr
    req = api.requests[-1]
    assert req["path"] == f"{BASE}/podsnapshots" and req["query"]["labelSelector"] == ["kubectl-snapshot.io/pod=web"]


def test_watch_prints_changes_once_and_resumes_from_the_last_version(api: FakeAPI, kubeconfig: Path) -> None:
    proc = plugin("list", "-w", kubeconfig=kubeconfig)
    lines = proc.stdout.splitlines()
    assert lines[0].split()[0] == "NAME" and len(lines) == 5, proc.stdout  # header, 2 listed, 2 changes
    assert lines[3].split()[:3] == ["web-2", "web", "Running"]
    assert lines[4].split()[:3] == ["db-1", "db", "Deleted"]
    watches = [r for r in api.requests if r["query"].get("watch") == ["true"]]
    assert "resourceVersion" not in watches[0]["query"]
    assert watches[1]["query"]["resourceVersion"] == ["12"]  # resumed where the first watch ended
    assert proc.returncode == 1 and "watch forbidden now" in proc.stderr


# --- --dry-run -----------------------------------------------------------------------------------------


def test_bare_dry_run_means_client_as_in_kubectl() -> None:
    assert kubectl_args(["restore", "--dry-run", "snap"]) == ["restore", "--dry-run=client", "snap"]
    assert kubectl_args(["--dry-run=server", "x", "--", "--dry-run"]) == ["--dry-run=server", "x", "--", "--dry-run"]


def test_delete_dry_run(api: FakeAPI, kubeconfig: Path) -> None:
    client = plugin("delete", "web-1", "--dry-run", kubeconfig=kubeconfig)
    assert client.returncode == 0 and "podsnapshot/web-1 deleted (client dry run)" in client.stdout, client.stderr
    assert [r["method"] for r in api.requests] == ["GET"]
    server = plugin("delete", "-l", "kubectl-snapshot.io/pod=web", "--dry-run=server", kubeconfig=kubeconfig)
    assert server.returncode == 0 and "podsnapshot/web-1 deleted (server dry run)" in server.stdout, server.stderr
    deletes = [r for r in api.requests if r["method"] == "DELETE"]
    assert len(deletes) == 1 and deletes[0]["query"]["dryRun"] == ["All"]
    assert plugin("delete", "--dry-run=maybe", "x", kubeconfig=kubeconfig).returncode == 2
    assert plugin("delete", kubeconfig=kubeconfig).returncode == 2  # neither names nor -l


def test_install_client_dry_run_prints_names() -> None:
    proc = plugin("install", "--dry-run", "-o", "name")
    assert proc.returncode == 0, proc.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/podsnapshots.kubectl-snapshot.io" in proc.stdout
    assert "daemonset.apps/kubectl-snapshot-agent" in proc.stdout


# --- connection flags ----------------------------------------------------------------------------------


def test_server_token_and_impersonation_flags(api: FakeAPI, kubeconfig: Path, tmp_path: Path) -> None:
    proc = plugin("list", "--token", "tok-1", "--as", "jane", "--as-group", "devs", kubeconfig=kubeconfig)
    assert proc.returncode == 0, proc.stderr
    headers = api.requests[-1]["headers"]
    assert headers["authorization"] == "Bearer tok-1"
    assert headers["impersonate-user"] == "jane" and headers["impersonate-group"] == "devs"
    plugin("list", kubeconfig=kubeconfig)
    assert api.requests[-1]["headers"]["authorization"] == "Bearer from-kubeconfig"
    assert "impersonate-user" not in api.requests[-1]["headers"]
    # --server without any kubeconfig, as `kubectl --server URL --token T` works
    bare = plugin("list", "-n", "team-b", "--server", api.url, "--token", "tok-2")
    assert bare.returncode == 0, bare.stderr
    assert api.requests[-1]["path"] == f"{BASE}/namespaces/team-b/podsnapshots"
    assert api.requests[-1]["headers"]["authorization"] == "Bearer tok-2"
    # --server overrides the kubeconfig's
    moved = plugin("list", "--server", "http://127.0.0.1:9", kubeconfig=kubeconfig)
    assert moved.returncode == 1 and "http://127.0.0.1:9" in moved.stderr
    assert plugin("list", "--as-group", "devs", kubeconfig=kubeconfig).returncode == 2  # --as-group needs --as


# --- completion ----------------------------------------------------------------------------------------


def complete(*args: str, kubeconfig: Path | None = None) -> list[str]:
    exe = Path(sys.executable).with_name("kubectl_complete-snapshot")
    cmd = (
        [str(exe)]
        if exe.exists()
        else [sys.executable, "-c", "from kubectl_snapshot.cli.main import complete; complete()"]
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": str(kubeconfig or "/nonexistent")}
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_kubectl_plugin_completion_protocol(api: FakeAPI, kubeconfig: Path) -> None:
    top = complete("")
    assert top[-1] == ":4" and {"restore", "list", "delete", "install", "completion"} <= {
        line.split("\t")[0] for line in top
    }
    assert not any(line.startswith("__") for line in top)
    assert complete("list", "-o", "")[:-1] == ["text", "wide", "name", "json", "yaml", "jsonpath="]
    assert complete("list", "-o", "")[-1] == ":6"  # jsonpath= continues without a space
    assert complete("delete", "", kubeconfig=kubeconfig) == ["db-1", "web-1", ":4"]
    assert complete("inspect", "w", kubeconfig=kubeconfig) == ["web-1", ":4"]
    assert complete("install", "--node-config", "")[-1] == ":0"  # a file: the shell completes paths
    assert complete("list", "--context", "", kubeconfig=kubeconfig) == ["a", ":4"]
    # the same through the plugin itself (what the krew archive's kubectl_complete-snapshot runs)
    via_plugin = plugin("__complete", "delete", "w", kubeconfig=kubeconfig)
    assert via_plugin.stdout.splitlines() == ["web-1", ":4"]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(shell: str) -> None:
    proc = plugin("completion", shell)
    assert proc.returncode == 0 and "_KUBECTL_SNAPSHOT_COMPLETE" in proc.stdout and "kubectl-snapshot" in proc.stdout


def test_completion_script_drives_the_command(tmp_path: Path) -> None:
    """bash's protocol, as the script generated above calls it: COMP_WORDS/COMP_CWORD in the environment."""
    exe = Path(sys.executable).with_name("kubectl-snapshot")
    if not exe.exists():
        pytest.skip("kubectl-snapshot is not installed in this venv (hack/setup-venv.sh)")
    env = {
        "PATH": "/usr/bin:/bin",
        "_KUBECTL_SNAPSHOT_COMPLETE": "bash_complete",
        "COMP_WORDS": "kubectl-snapshot uninst",
        "COMP_CWORD": "1",
    }
    proc = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.splitlines() == ["plain,uninstall"], proc.stderr


# --- jsonpath ------------------------------------------------------------------------------------------

DOC = {
    "kind": "List",
    "items": [
        {"metadata": {"name": "a", "labels": {"x.io/y": "1"}}, "status": {"phase": "Succeeded", "size": 3}},
        {"metadata": {"name": "b"}, "status": {"phase": "Failed", "ok": False}},
    ],
}


@pytest.mark.parametrize(
    ("template", "out"),
    [
        ("{.items[*].metadata.name}", "a b"),
        ('{range .items[*]}{.metadata.name}{"\\t"}{.status.phase}{"\\n"}{end}', "a\tSucceeded\nb\tFailed\n"),
        ('{.items[?(@.status.phase=="Failed")].metadata.name}', "b"),
        ("{.items[?(@.status.size>2)].metadata.name}", "a"),
        ("{.items[0].metadata.labels['x\\.io/y']}", ""),
        ("{.items[0].metadata.labels['x.io/y']} last={.items[-1].metadata.name}", "1 last=b"),
        ("{..name}", "a b"),
        ("{.items[0].status}", '{"phase":"Succeeded","size":3}'),
        ("{.items[1].status.ok}", "false"),
        ("{$.kind} {.missing.key}", "List "),
        ("{.items[0:1].metadata.name}", "a"),
        ("kind={.kind}", "kind=List"),
    ],
)
def test_jsonpath(template: str, out: str) -> None:
    assert jsonpath.render(template, DOC) == out


@pytest.mark.parametrize("template", ["{.items[", "{range .items[*]}{.x}", "{end}", "{.items[?(@.a==)]}x"])
def test_jsonpath_errors(template: str) -> None:
    with pytest.raises(InvalidArgument):
        jsonpath.render(template, DOC)


# --- the node tools ------------------------------------------------------------------------------------


def test_only_the_plugin_and_its_completion_look_like_kubectl_plugins() -> None:
    """kubectl runs every `kubectl-*` on PATH as a plugin: the node tools must not be named so."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(n for n in scripts if n.startswith("kubectl")) == ["kubectl-snapshot", "kubectl_complete-snapshot"]
    assert {"ks-agent", "ks-runc"} <= set(scripts)


def test_agent_finds_its_wrapper_beside_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin, other = tmp_path / "venv" / "bin", tmp_path / "elsewhere"
    venv_bin.mkdir(parents=True)
    other.mkdir()
    wrapper = venv_bin / "ks-runc"
    wrapper.write_text("#!/bin/sh\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    # called by its full path from a venv that is not on PATH
    assert find_wrapper(str(venv_bin / "ks-agent"), "/usr/bin/python3") == str(wrapper)
    # run as `python -m ...` by the venv's interpreter
    assert find_wrapper("-c", str(venv_bin / "python")) == str(wrapper)
    # neither beside it: PATH
    assert find_wrapper(str(other / "ks-agent"), "/usr/bin/python3") is None
    (other / "ks-runc").write_text("#!/bin/sh\n")
    (other / "ks-runc").chmod(0o755)
    assert find_wrapper("ks-agent", "/usr/bin/python3") == str(other / "ks-runc")
    wrapper.chmod(0o644)  # not executable: not it
    assert find_wrapper(str(venv_bin / "ks-agent"), "/nowhere/python3") == str(other / "ks-runc")


def test_installed_agent_restore_finds_the_wrapper_without_path() -> None:
    """`.venv/bin/ks-agent restore` with an empty PATH gets past the wrapper lookup (it then needs a
    containerd, which the bogus socket does not have)."""
    agent = Path(sys.executable).with_name("ks-agent")
    if not agent.exists():
        pytest.skip("ks-agent is not installed in this venv (hack/setup-venv.sh)")
    proc = subprocess.run(
        [str(agent), "restore", "-a", "/nonexistent.sock", "127.0.0.1:1/x/y:v1", "n1"],
        capture_output=True,
        text=True,
        env={"PATH": "", "HOME": "/nonexistent", **({"LANG": os.environ["LANG"]} if "LANG" in os.environ else {})},
        timeout=60,
    )
    assert "was not found" not in proc.stderr and "ks-runc" not in proc.stderr, proc.stderr
    assert proc.returncode != 0


# --- progress ------------------------------------------------------------------------------------------

PROGRESS = (
    "from kubectl_snapshot.cli.watch_progress import RemoteProgress\n"
    "from kubectl_snapshot.core.status import SnapshotStatus\n"
    "with RemoteProgress('snapshot web') as bar:\n"
    "    bar.snapshot(SnapshotStatus('Running', 'ks-n1', 'upload', 512, 1024, '', ''))\n"
)


def test_progress_bars_only_on_a_terminal() -> None:
    import fcntl
    import pty
    import struct
    import termios

    piped = subprocess.run([sys.executable, "-c", PROGRESS], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert piped.returncode == 0 and piped.stderr == ""  # a pipe (CI, scripts): nothing
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal 160 columns wide
    proc = subprocess.Popen([sys.executable, "-c", PROGRESS], stdout=subprocess.DEVNULL, stderr=slave, cwd=REPO)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                piece = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not piece:
                break
            out += piece
    finally:
        os.close(master)
        proc.wait(timeout=60)
    assert proc.returncode == 0 and b"snapshot web on ks-n1: upload" in out
