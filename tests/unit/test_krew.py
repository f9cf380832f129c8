"""The krew release: one zipapp with pure-Python dependencies, a reproducible archive, a valid manifest.

Builds it once (krew/package.py, ~15 s) and runs the result with the system's bare python3 (-I -S: no
site-packages, no venv), as a krew user's machine would.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _package_module() -> Any:
    spec = importlib.util.spec_from_file_location("krew_package", REPO / "krew" / "package.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("krew")
    proc = subprocess.run(
        [sys.executable, str(REPO / "krew" / "package.py"), "--out", str(out), "--version", "v0.1.0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_manifest_names_the_archive_by_sha256(release: Path) -> None:
    doc = yaml.safe_load((release / "snapshot.yaml").read_text())
    assert doc["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2" and doc["kind"] == "Plugin"
    assert doc["metadata"]["name"] == "snapshot"  # `kubectl snapshot`
    spec = doc["spec"]
    assert re.match(r"^v\d+\.\d+\.\d+$", spec["version"]) and spec["shortDescription"] and spec["homepage"]
    (platform,) = spec["platforms"]
    archive = release / "kubectl-snapshot-v0.1.0.tar.gz"
    assert platform["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert platform["uri"].endswith("/v0.1.0/kubectl-snapshot-v0.1.0.tar.gz")
    assert platform["bin"] == "kubectl-snapshot"
    assert platform["selector"]["matchExpressions"][0]["values"] == ["linux", "darwin"]
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        for f in platform["files"]:  # every file krew copies is in the archive
            assert f["from"] in members and f["to"] == "."
        assert set(members) == {"kubectl-snapshot", "kubectl_complete-snapshot", "LICENSE"}
        assert members["kubectl_complete-snapshot"].mode & 0o111
        lic = tar.extractfile(members["LICENSE"])
        assert lic is not None and lic.read() == (REPO / "LICENSE").read_bytes()
        binary = members["kubectl-snapshot"]
        assert binary.isfile() and binary.mode & 0o111 and binary.mtime == 0
        extracted = tar.extractfile(binary)
        assert extracted is not None
        assert extracted.read() == (release / "kubectl-snapshot").read_bytes()


def test_archive_is_reproducible(release: Path, tmp_path: Path) -> None:
    pkg = _package_module()
    again = tmp_path / "again.tar.gz"
    pkg.build_archive(release / "kubectl-snapshot", again)
    assert again.read_bytes() == (release / "kubectl-snapshot-v0.1.0.tar.gz").read_bytes()


def test_zipapp_is_pure_python_and_leaves_node_dependencies_out(release: Path) -> None:
    with zipfile.ZipFile(release / "kubectl-snapshot") as z:
        names = z.namelist()
    assert "__main__.py" in names and "kubectl_snapshot/cli/main.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]
    tops = {n.split("/", 1)[0] for n in names}
    assert {"click", "kubernetes", "yaml", "tqdm", "requests", "urllib3"} <= tops
    assert not tops & {"grpc", "google", "zstandard", "aiohttp", "shim"}
    assert not [n for n in names if ".." in n.split("/") or n.startswith("/")]


def test_zipapp_carries_only_what_the_plugin_imports() -> None:
    """The zipapp's own files are the plugin's import closure: no node side, no node-only adapter."""
    files = set(_package_module().project_files())
    assert {
        "kubectl_snapshot/cli/main.py",
        "kubectl_snapshot/core/status.py",
        "kubectl_snapshot/deploy/agent.py",
    } <= files
    assert not [f for f in files if f.startswith("shim/")]
    node_only = {"archive.py", "images.py", "guard.py", "safefs.py", "zstdio.py", "pipes.py"}
    assert not [f for f in files if f.rsplit("/", 1)[-1] in node_only]
    # the agent's access to the namespace keys is library code the plugin never loads
    assert "kubectl_snapshot/adapters/keystore.py" not in files
    assert (REPO / "kubectl_snapshot/adapters/keystore.py").is_file()  # (so the line above can fail)


def _bare_python() -> str:
    py = shutil.which("python3", path="/usr/bin:/bin")
    if py is None:
        pytest.skip("no system python3 in /usr/bin to run the zipapp with")
    version = subprocess.run(
        [py, "-c", "import sys; print(sys.version_info >= (3, 11))"], capture_output=True, text=True
    )
    if version.stdout.strip() != "True":
        pytest.skip(f"{py} is older than 3.11")
    return py


def test_zipapp_runs_on_a_bare_python(release: Path, tmp_path: Path) -> None:
    py = _bare_python()
    app = str(release / "kubectl-snapshot")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [py, "-I", "-S", app, *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
        )

    ok = run("--help")
    assert ok.returncode == 0 and "restore" in ok.stdout
    usage = run("pod/web")
    assert usage.returncode == 2 and "error: no destination repository" in usage.stderr
    # imports the kubernetes client from the zip, then fails on the missing kubeconfig
    runtime = run("list")
    assert runtime.returncode == 1 and "error: cannot load kubeconfig" in runtime.stderr
    assert "Traceback" not in runtime.stderr


def test_license_is_apache_2_as_pyproject_says() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()


def _krew_tools() -> Path:
    """krew and its validate-krew-manifest, built from the Go module proxy (hack/build-go-tool.sh, cached)."""
    proc = subprocess.run(
        [str(REPO / "hack" / "build-go-tool.sh"), "krew"], capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot build krew from the Go module proxy: {proc.stderr[-500:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def test_manifest_passes_krews_own_validator(release: Path, tmp_path: Path) -> None:
    """krew-index's CI runs validate-krew-manifest: structure, name = file name, semantic version,
    platform selectors that match a supported platform and do not overlap. Its install step downloads
    the uri, which this machine cannot reach: tests/e2e/test_krew.py installs the archive with krew."""
    tools = _krew_tools()
    proc = subprocess.run(
        [str(tools / "validate-krew-manifest"), "-manifest", str(release / "snapshot.yaml"), "-skip-install"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "structural validation OK" in proc.stderr and "no overlapping spec.platform[].selector" in proc.stderr
    # the validator does reject what krew-index rejects (a test that can fail)
    bad = yaml.safe_load((release / "snapshot.yaml").read_text())
    bad["spec"]["version"] = "0.1.0"  # no leading v
    (tmp_path / "snapshot.yaml").write_text(yaml.safe_dump(bad))
    refused = subprocess.run(
        [str(tools / "validate-krew-manifest"), "-manifest", str(tmp_path / "snapshot.yaml"), "-skip-install"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "version" in refused.stderr
