"""The Helm chart (charts/kubectl-snapshot, written by hack/gen-chart.py from deploy.render()) checked with a
real helm (v3.22.0 built from the Go module proxy by hack/build-go-tool.sh, cached): `helm lint` passes and
`helm template` gives the same objects `kubectl snapshot install` applies for the same settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubectl_snapshot.deploy import DEFAULT_IMAGE, render

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubectl-snapshot"


@pytest.fixture(scope="module")
def helm() -> str:
    proc = subprocess.run(
        [str(REPO / "hack" / "build-go-tool.sh"), "helm"], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot build helm from the Go module proxy: {proc.stderr[-500:]}")
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "helm")


def _unordered(obj: Any) -> Any:
    """volumes and volumeMounts are sets keyed by name for the API server: compare them sorted."""
    if isinstance(obj, dict):
        return {
            k: sorted((_unordered(i) for i in v), key=lambda i: str(i.get("name")))
            if k in ("volumes", "volumeMounts") and isinstance(v, list)
            else _unordered(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_unordered(i) for i in obj]
    return obj


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): _unordered(o) for o in objects if o}


def helm_template(helm: str, *sets: str) -> dict[tuple[str, str], dict[str, Any]]:
    """`--set-string` for each NAME=VALUE, `--set` for the booleans."""
    args = [a for s in sets for a in ("--set" if s.endswith(("=true", "=false")) else "--set-string", s)]
    proc = subprocess.run(
        [helm, "template", "ks", str(CHART), *args], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    return by_key(list(yaml.safe_load_all(proc.stdout)))


def test_chart_is_generated_from_render() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen-chart.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_helm_lint(helm: str) -> None:
    proc = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_helm_template_equals_install_defaults(helm: str) -> None:
    assert helm_template(helm) == by_key(render(DEFAULT_IMAGE))


def test_helm_template_equals_install_with_settings(helm: str) -> None:
    got = helm_template(
        helm,
        "image=registry.example/ks/agent@sha256:" + "c" * 64,
        "stateRoot=/data/ks",
        "kubeletRoot=/var/lib/k0s/kubelet",
        "containerdSocket=/run/k0s/containerd.sock",
        "containerdDropinDir=/etc/k0s/containerd.d",
        "restartCommand=systemctl restart containerd # {node}",
        "apiServer=https://10.1.2.3:6443",
        "hostNetwork=true",
    )
    want = render(
        "registry.example/ks/agent@sha256:" + "c" * 64,
        state_root="/data/ks",
        kubelet_root="/var/lib/k0s/kubelet",
        containerd_socket="/run/k0s/containerd.sock",
        containerd_dropin_dir="/etc/k0s/containerd.d",
        restart_command="systemctl restart containerd # {node}",
        api_server="https://10.1.2.3:6443",
        host_network=True,
    )
    assert got == by_key(want)
    # and it differs from the defaults where it should (the comparison can fail)
    assert got != by_key(render(DEFAULT_IMAGE))
    no_port = helm_template(helm, "apiServer=https://api.example")
    assert no_port == by_key(render(DEFAULT_IMAGE, api_server="https://api.example"))


def test_literal_template_delimiters_survive(helm: str, tmp_path: Path) -> None:
    """Whatever render() gains later (e.g. a policy with a `{{ }}` in a message) comes out of helm unchanged."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_chart", REPO / "hack" / "gen-chart.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"t": "a {{ .b }} c}} {d}"}}
    chart = tmp_path / "c"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\nversion: 0.1.0\n")
    (chart / "templates" / "x.yaml").write_text(gen.template(obj))
    proc = subprocess.run([helm, "template", "r", str(chart)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == obj
