"""Run the plugin (`.venv/bin/kubectl-snapshot`, as kubectl would) against the e2e cluster.

``ks_plugin(*args, kubeconfig=None, check=False)`` runs it with the cluster's admin kubeconfig (or the
one given) and returns the CompletedProcess. ``podsnapshot_crd`` applies the PodSnapshot CRD from
``kubectl_snapshot.deploy`` (idempotent) and waits until it is served. ``user_kubeconfig`` writes a
kubeconfig for the cluster's API server with another user's credentials.

Import: ``from tests.support.plugin_cli import ks_plugin, podsnapshot_crd  # noqa: F401``
(with ``from tests.support.cluster import cluster, namespace  # noqa: F401``).
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(sys.executable).with_name("kubectl-snapshot")

PluginRun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def ks_plugin(cluster: Cluster) -> PluginRun:
    if not PLUGIN.exists():
        pytest.skip(f"{PLUGIN} is not installed (run hack/setup-venv.sh)")

    def run(
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = False,
        timeout: float = 180,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(PLUGIN), *args, "--kubeconfig", str(kubeconfig or cluster.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **(env or {})},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl-snapshot {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    return run


@pytest.fixture
def podsnapshot_crd(cluster: Cluster) -> str:
    from kubectl_snapshot.deploy import LABELS
    from kubectl_snapshot.deploy.crd import CRD_NAME, podsnapshot_crd

    cluster.apply(podsnapshot_crd(dict(LABELS)))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    return CRD_NAME


def user_kubeconfig(cluster: Cluster, ns: str, user: dict[str, Any], path: Path) -> Path:
    """A kubeconfig at `path` for the cluster's API server (its CA inline) with `user`'s credentials (a
    kubeconfig `user` mapping) and `ns` as the context's namespace."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    ca = server.get("certificate-authority-data")
    if ca is None:
        ca = base64.b64encode(Path(server["certificate-authority"]).read_bytes()).decode()
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server["server"], "certificate-authority-data": ca}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "user", "context": {"cluster": "e2e", "user": "user", "namespace": ns}}],
        "current-context": "user",
    }
    path.write_text(yaml.safe_dump(cfg))
    return path
