"""What install-node put on each node, and `kubectl snapshot doctor`'s per-node report of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.agent import OPT_ROOT, AgentInstall, agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e


def test_nodes_run_only_what_install_node_put_in_their_directory(cluster: Cluster, agent: AgentInstall) -> None:
    for node in cluster.nodes:
        d = OPT_ROOT / node
        hook = json.loads((d / "kubectl-snapshot-runc.launch").read_text())
        criu = json.loads((d / "criu.launch").read_text())
        tar = json.loads((d / "bin" / "tar.launch").read_text())
        assert criu["pathPrepend"] == [str(d / "bin")] and tar["gzipFilter"] is True  # CRIU's tar: the bundle's
        for argv in (hook["argv"], criu["argv"], tar["argv"]):
            assert all(not a.startswith("/") or a.startswith(f"{d}/bundle-") for a in argv), argv
        assert hook["env"]["KUBECTL_SNAPSHOT_CRIU"] == str(d / "criu")
        assert (d / "kubectl-snapshot-runc").read_bytes()[:4] == b"\x7fELF"  # static launcher, no #! interpreter
        facts = json.loads((d / "install.json").read_text())
        assert facts["criu"]["version"] == "4.2.1" and facts["criu"]["from"].startswith("debian criu 4.2.1")
        assert Path(facts["bundle"], "bundle.json").exists()


def test_doctor_reports_criu_hook_and_blockers_per_node(cluster: Cluster, agent: AgentInstall, plugin) -> None:  # type: ignore[no-untyped-def]
    proc = plugin("doctor", "-o", "json", check=False)
    report = json.loads(proc.stdout)
    for n in report["nodes"]:
        node = n["node"]
        assert n["criu"]["path"] == str(OPT_ROOT / node / "criu"), n
        assert n["criu"]["version"] == "4.2.1" and "debian criu 4.2.1" in n["criu"]["from"], n
        assert n["hook"]["path"] == str(OPT_ROOT / node / "kubectl-snapshot-runc"), n
        assert n["hook"]["python"].startswith("3."), n
        assert n["criuCheck"] == "ok", n  # `criu check` with the installed CRIU on this kernel
        assert n["importsDropin"] is True and n["restartPending"] is False, n
        assert n["cgroup"] in ("v1", "v1-hybrid", "v2") and n["blockers"] == [], n
        tools = n["tools"]
        assert tools["tar"]["path"] == str(OPT_ROOT / node / "bin" / "tar") and "debian tar" in tools["tar"]["from"], n
        # the network work in pods' namespaces runs in-process, on a kernel that has what it needs
        assert {t["path"] for name, t in tools.items() if name != "tar"} == {"in-process"}, n
        assert tools["pod network lock"]["ok"] and tools["abort connections from the old address"]["ok"], n
    assert proc.returncode == 0 and report["ok"], report
    text = plugin("doctor", check=False).stdout
    assert "runtime wrapper" in text and "criu check    ok" in text, text
    assert "pod network lock: in-process" in text and "instead of ss -K" in text and "/bin/tar 1.34" in text, text
