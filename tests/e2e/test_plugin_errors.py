"""Plugin errors against the real API server: unknown pod, pod not Running, unknown reference or
snapshot, and RBAC (a ServiceAccount allowed only in its own namespace)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, cluster, namespace
from tests.support.plugin_cli import PluginRun, ks_plugin, podsnapshot_crd, user_kubeconfig

pytestmark = pytest.mark.e2e


def test_unknown_pod(cluster: Cluster, namespace: str, ks_plugin: PluginRun) -> None:
    proc = ks_plugin("pod/nope", "-n", namespace, "--to", f"{cluster.registry}/e2e/nope")
    assert proc.returncode == 1, proc.stderr
    assert f"error: pod 'nope' not found in namespace '{namespace}'" in proc.stderr
    assert f"hint: list the pods with: kubectl get pods -n {namespace}" in proc.stderr


def test_pending_pod_is_refused_with_the_schedulers_reason(
    cluster: Cluster, namespace: str, ks_plugin: PluginRun
) -> None:
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "stuck", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
                "containers": [{"name": "c", "image": cluster.busybox_image, "command": ["sleep", "3600"]}],
            },
        }
    )
    cluster.wait_for(
        "the scheduler to give up on pod stuck",
        lambda: "PodScheduled" in cluster.kubectl("get", "pod", "stuck", "-n", namespace, "-o", "json").stdout,
        timeout=60,
    )
    proc = ks_plugin("pod/stuck", "-n", namespace, "--to", f"{cluster.registry}/e2e/stuck")
    assert proc.returncode == 1, proc.stderr
    assert f"error: pod {namespace}/stuck is not Running (phase Pending" in proc.stderr
    assert "node affinity/selector" in proc.stderr or "didn't match" in proc.stderr
    assert "hint: only Running pods can be snapshotted" in proc.stderr
    # nothing was created
    assert "stuck" not in cluster.kubectl("get", "podsnapshots", "-n", namespace, check=False).stdout


def test_unknown_reference_and_snapshot(
    cluster: Cluster, namespace: str, ks_plugin: PluginRun, podsnapshot_crd: str
) -> None:
    ref = f"{cluster.registry}/e2e/does-not-exist-{uuid.uuid4().hex[:6]}:v1"
    for args in (("restore", ref, "-n", namespace, "--agent-image", "x"), ("inspect", ref)):
        proc = ks_plugin(*args)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and "does-not-exist" in proc.stderr
        assert "Traceback" not in proc.stderr
    proc = ks_plugin("restore", "nosuch", "-n", namespace)
    assert proc.returncode == 1
    assert f"error: no podsnapshot 'nosuch' in namespace '{namespace}'" in proc.stderr
    assert "kubectl snapshot list" in proc.stderr
    # no pod was created by the failed restores
    assert cluster.get_json("pods", "-n", namespace)["items"] == []


def _sa_kubeconfig(cluster: Cluster, ns: str, sa: str, path: Path) -> Path:
    """A kubeconfig for ServiceAccount `sa` with a TokenRequest token (kubectl create token)."""
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=10m").stdout.strip()
    return user_kubeconfig(cluster, ns, {"token": token}, path)


def test_serviceaccount_limited_to_its_namespace_is_forbidden_elsewhere(
    cluster: Cluster, namespace: str, ks_plugin: PluginRun, podsnapshot_crd: str, tmp_path: Path
) -> None:
    other = f"e2e-other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", other)
    try:
        rules = [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create"]},
            {"apiGroups": ["kubectl-snapshot.io"], "resources": ["podsnapshots"], "verbs": ["*"]},
        ]
        cluster.apply(
            [
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "snapper", "namespace": namespace}},
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "Role",
                    "metadata": {"name": "snapper", "namespace": namespace},
                    "rules": rules,
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "snapper", "namespace": namespace},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "snapper"},
                    "subjects": [{"kind": "ServiceAccount", "name": "snapper", "namespace": namespace}],
                },
            ]
        )
        kubeconfig = _sa_kubeconfig(cluster, namespace, "snapper", tmp_path / "sa.kubeconfig")
        to = f"{cluster.registry}/e2e/rbac"
        # control: in its own namespace (the context's default) the SA gets past RBAC to "not found"
        own = ks_plugin("pod/ghost", "--to", to, kubeconfig=kubeconfig)
        assert own.returncode == 1 and "not found in namespace" in own.stderr, own.stderr
        user = f"system:serviceaccount:{namespace}:snapper"
        snap = ks_plugin("pod/ghost", "-n", other, "--to", to, kubeconfig=kubeconfig)
        assert snap.returncode == 1, snap.stderr
        assert f'User "{user}" cannot get resource "pods"' in snap.stderr
        assert f'in the namespace "{other}"' in snap.stderr and "hint: " in snap.stderr
        restore = ks_plugin("restore", "some-snapshot", "-n", other, kubeconfig=kubeconfig)
        assert restore.returncode == 1, restore.stderr
        assert f'User "{user}" cannot get resource "podsnapshots"' in restore.stderr
        listing = ks_plugin("list", "-n", other, kubeconfig=kubeconfig)
        assert listing.returncode == 1 and 'cannot list resource "podsnapshots"' in listing.stderr
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
