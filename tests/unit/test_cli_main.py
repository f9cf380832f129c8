"""The plugin's command line: routing, usage errors (exit 2, error:/hint:), durations, tables.

These run the real `main()` in a subprocess-free way through click's runner; what needs an API server is in
tests/e2e/test_plugin_*.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kubectl_snapshot.cli.doctor import doctor_text
from kubectl_snapshot.cli.listing import table
from kubectl_snapshot.cli.main import cli
from kubectl_snapshot.cli.params import Duration

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The entry point as kubectl runs it (main() maps usage errors itself)."""
    return subprocess.run(
        [sys.executable, "-c", "from kubectl_snapshot.cli.main import entry; entry()", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "KUBECONFIG": "/nonexistent/kubeconfig", **(env or {})},
        timeout=60,
    )


def test_help_lists_commands() -> None:
    out = CliRunner().invoke(cli, ["--help"]).output
    for cmd in ("restore", "migrate", "list", "inspect", "delete", "install", "uninstall", "doctor"):
        assert cmd in out


def test_unknown_option_is_a_usage_error() -> None:
    proc = run("restore", "--bogus", "x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: No such option '--bogus'")
    assert "hint: see 'kubectl snapshot restore --help'" in proc.stderr


def test_missing_destination_is_a_usage_error_with_hint() -> None:
    proc = run("pod/web")
    assert proc.returncode == 2
    assert "error: no destination repository" in proc.stderr and "KUBECTL_SNAPSHOT_REPOSITORY" in proc.stderr


def test_only_pods_can_be_snapshotted() -> None:
    proc = run("deploy/web", "--to", "127.0.0.1:5000/s/web")
    assert proc.returncode == 2 and "only pods can be snapshotted" in proc.stderr


def test_bad_destination_is_a_usage_error() -> None:
    proc = run("pod/web", "--to", "127.0.0.1:5000/S/Web")
    assert proc.returncode == 2 and "must be lowercase" in proc.stderr


def test_bad_kubeconfig_is_a_runtime_error_with_hint_and_verbose_traceback() -> None:
    proc = run("pods/web", "-n", "team-a", env={"KUBECTL_SNAPSHOT_REPOSITORY": "127.0.0.1:5000/s/web"})
    assert proc.returncode == 1
    assert "error: cannot load kubeconfig /nonexistent/kubeconfig" in proc.stderr
    assert "hint: pass --kubeconfig" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("pod/web", "-v", "--to", "127.0.0.1:5000/s/web")
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_unknown_context_names_the_ones_there(tmp_path: Path) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: a\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: a, context: {cluster: c, user: u}}]\n"
    )
    proc = run("list", "--kubeconfig", str(cfg), "--context", "nope")
    assert proc.returncode == 2 and "context 'nope' is not in" in proc.stderr and "contexts there: a" in proc.stderr


def test_unreachable_api_server_is_unavailable(tmp_path: Path) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: a\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: a, context: {cluster: c, user: u, namespace: team-a}}]\n"
    )
    proc = run("list", "--kubeconfig", str(cfg))
    assert proc.returncode == 1
    assert "cannot reach the API server at http://127.0.0.1:9" in proc.stderr
    assert "list podsnapshots in team-a" in proc.stderr  # the context's namespace is the default


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("1.5s", 1.5)])
def test_duration(text: str, seconds: float) -> None:
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", "0s", "-5"])
def test_bad_duration(text: str) -> None:
    with pytest.raises(click.BadParameter):
        Duration().convert(text, None, None)


def test_table_aligns_columns() -> None:
    rows = [
        {
            "namespace": "a",
            "name": "web-1",
            "pod": "web",
            "phase": "Succeeded",
            "node": "n1",
            "size": 2048,
            "reference": "r/x@sha256:1",
            "age": "5s",
        },
        {
            "namespace": "a",
            "name": "w2",
            "pod": "w",
            "phase": "Pending",
            "node": "",
            "size": 0,
            "reference": "",
            "age": "1m",
        },
    ]
    lines = table(rows, with_ns=False).splitlines()
    assert lines[0].split() == ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"]
    assert lines[1].index("Succeeded") == lines[2].index("Pending") == lines[0].index("PHASE")
    assert "2.0 KiB" in lines[1] and lines[2].split()[3:] == ["-", "-", "-", "1m"]
    assert table([], with_ns=True) == "No PodSnapshots found."


def test_doctor_text_shows_unknown_facts() -> None:
    text = doctor_text(
        {
            "ok": False,
            "checks": [{"check": "CRD x", "ok": False, "detail": "missing"}],
            "nodes": [
                {
                    "node": "n1",
                    "agentPod": "",
                    "agentReady": False,
                    "criuVersion": "unknown",
                    "containerdVersion": "unknown",
                    "runcVersion": "unknown",
                    "kernel": "unknown",
                    "runtimeHandler": "unknown",
                }
            ],
        }
    )
    assert "BAD CRD x: missing" in text and "n1" in text and "unknown" in text


def test_snapshot_verb_is_an_alias_of_the_pod_command() -> None:
    proc = run("snapshot", "pod/web")
    assert proc.returncode == 2 and "error: no destination repository" in proc.stderr


def test_doctor_text_lists_each_nodes_tools_and_where_they_come_from() -> None:
    node = {
        "node": "n1", "agentPod": "a", "agentReady": True, "criuVersion": "4.2.1", "containerdVersion": "v2.3.7",
        "runcVersion": "1.1.15", "kernel": "6.18", "runtimeHandler": True,
        "criu": {"path": "/opt/kubectl-snapshot/n1/criu", "version": "4.2.1", "from": "debian criu 4.2.1-1"},
        "hook": {"path": "/opt/kubectl-snapshot/n1/kubectl-snapshot-runc", "python": "3.11.2", "from": "debian"},
        "tools": {
            "tar": {"path": "/opt/kubectl-snapshot/n1/bin/tar", "version": "1.34", "from": "debian tar 1.34"},
            "pod network lock": {"path": "in-process", "version": "", "from": "nf_tables over netlink",
                                 "replaces": "sh, iptables-restore", "ok": False, "detail": "no nf_tables"},
        },
        "blockers": ["pods' network cannot be locked"],
    }  # fmt: skip
    text = doctor_text({"ok": False, "checks": [], "nodes": [node]})
    assert "  tar: /opt/kubectl-snapshot/n1/bin/tar 1.34 (debian tar 1.34)" in text, text
    assert (
        "  pod network lock: in-process (nf_tables over netlink; instead of sh, iptables-restore; no nf_tables)" in text
    )
    assert "BLOCKED       pods' network cannot be locked" in text
