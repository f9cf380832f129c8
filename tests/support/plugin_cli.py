"""Run the plugin (`.venv/bin/kubectl-snapshot`, as kubectl would) against the e2e cluster.

``ks_plugin(*args, kubeconfig=None, check=False)`` runs it with the cluster's admin kubeconfig (or the
one given) and returns the CompletedProcess. ``podsnapshot_crd`` applies the PodSnapshot CRD from
``kubectl_snapshot.deploy`` (idempotent) and waits until it is served.

Import: ``from tests.support.plugin_cli import ks_plugin, podsnapshot_crd  # noqa: F401``
(with ``from tests.support.cluster import cluster, namespace  # noqa: F401``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

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
