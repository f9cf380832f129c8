"""The krew release installed by a real `krew` (v0.4.3, built from the Go module proxy by
hack/build-go-tool.sh) into a fresh KREW_ROOT, then run by the real kubectl as `kubectl snapshot` against the
local cluster; kubectl's own completion goes through the archive's kubectl_complete-snapshot; and the
pip-installed node tools do not show up as kubectl plugins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import Cluster, cluster, namespace
from tests.support.plugin_cli import REPO, podsnapshot_crd

pytestmark = pytest.mark.e2e
VERSION = "v0.1.0"


def _krew(tmp_path: Path) -> Path:
    proc = subprocess.run(
        [str(REPO / "hack" / "build-go-tool.sh"), "krew"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"building krew from the Go module proxy failed: {proc.stderr[-2000:]}"
    return Path(proc.stdout.strip().splitlines()[-1]) / "krew"


def test_krew_installs_the_archive_and_kubectl_runs_it(
    cluster: Cluster, namespace: str, podsnapshot_crd: str, tmp_path: Path
) -> None:
    if shutil.which("python3", path="/usr/bin:/bin") is None:
        pytest.skip("no /usr/bin/python3 for the zipapp's '#!/usr/bin/env python3'")
    release = tmp_path / "release"
    subprocess.run(
        [sys.executable, str(REPO / "krew" / "package.py"), "--out", str(release), "--version", VERSION],
        check=True,
        timeout=300,
    )
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "kubectl-krew").symlink_to(_krew(tmp_path))
    (tools / "kubectl").symlink_to(cluster.kubectl_bin)
    root = tmp_path / "krew-root"
    env = {
        "PATH": f"{tools}:{root / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KREW_ROOT": str(root),
        "KUBECONFIG": str(cluster.kubeconfig),
    }

    def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["kubectl", *args], capture_output=True, text=True, env=env, timeout=180)
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}\n{proc.stderr}"
        return proc

    archive = release / f"kubectl-snapshot-{VERSION}.tar.gz"
    installed = kubectl("krew", "install", f"--manifest={release / 'snapshot.yaml'}", f"--archive={archive}")
    assert "Installed plugin: snapshot" in installed.stderr + installed.stdout
    store = root / "store" / "snapshot" / VERSION
    assert (store / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes()
    assert os.readlink(root / "bin" / "kubectl-snapshot").endswith(f"store/snapshot/{VERSION}/kubectl-snapshot")
    caveats = yaml.safe_load((release / "snapshot.yaml").read_text())["spec"]["caveats"]
    assert "kubectl_complete-snapshot" in caveats

    assert (root / "receipts" / "snapshot.yaml").exists()  # `krew list` would need the index (network)
    plugins = kubectl("plugin", "list", check=False).stdout
    assert f"{root}/bin/kubectl-snapshot" in plugins

    out = kubectl("snapshot", "list", "-n", namespace)
    assert out.stdout.strip() == "No PodSnapshots found."
    names = kubectl("snapshot", "install", "--dry-run=client", "-o", "name").stdout
    assert "daemonset.apps/kubectl-snapshot-agent" in names
    server = kubectl("snapshot", "uninstall", "--dry-run=server", "-o", "name")  # through the API server
    assert "customresourcedefinition.apiextensions.k8s.io/podsnapshots.kubectl-snapshot.io" not in server.stdout
    assert "CustomResourceDefinition/podsnapshots.kubectl-snapshot.io" in server.stdout
    assert cluster.kubectl("get", "crd", podsnapshot_crd).returncode == 0  # a dry run deleted nothing

    # kubectl's completion of `kubectl snapshot ...` through the archive's helper, once linked (the caveat)
    (root / "bin" / "kubectl_complete-snapshot").symlink_to(store / "kubectl_complete-snapshot")
    comp = kubectl("__complete", "snapshot", "uninst").stdout.splitlines()
    assert comp[0].split("\t")[0] == "uninstall" and comp[-1] == ":4", comp
    ns_comp = kubectl("__complete", "snapshot", "list", "-n", namespace[:-1]).stdout.splitlines()
    assert namespace in ns_comp, ns_comp


def test_pip_installed_node_tools_are_not_kubectl_plugins(cluster: Cluster) -> None:
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "ks-agent").exists():
        pytest.skip("the project is not pip-installed in this venv (hack/setup-venv.sh)")
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": "/nonexistent"}
    proc = subprocess.run(
        [str(cluster.kubectl_bin), "plugin", "list", "--name-only"], capture_output=True, text=True, env=env
    )
    found = [line for line in proc.stdout.splitlines() if line.startswith(("kubectl-", "kubectl_"))]
    assert found == ["kubectl-snapshot"], proc.stdout + proc.stderr  # not ks-agent, ks-runc nor the completion
    agent = subprocess.run(
        [str(cluster.kubectl_bin), "snapshot", "agent", "--help"], capture_output=True, text=True, env=env
    )
    assert "ks-agent" not in agent.stdout  # `kubectl snapshot agent` is not the node agent
