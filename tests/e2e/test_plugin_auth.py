"""The plugin's own connection (adapters/kubeconn.py) against the real API server, with the kinds of
credentials kubeconfigs carry: a client certificate (the admin kubeconfig every e2e test uses), a bearer
token, a tokenFile, an exec credential plugin; a token the server refuses; and the same answers from the
official client it hands unusual kubeconfigs to (KUBECTL_SNAPSHOT_KUBE_CLIENT=official)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, cluster, namespace
from tests.support.plugin_cli import PluginRun, ks_plugin, podsnapshot_crd, user_kubeconfig

pytestmark = pytest.mark.e2e


def test_each_kind_of_kubeconfig_credential_reaches_the_api_server(
    cluster: Cluster, namespace: str, ks_plugin: PluginRun, podsnapshot_crd: str, tmp_path: Path
) -> None:
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader", "namespace": namespace}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "reader", "namespace": namespace},
                "rules": [{"apiGroups": ["kubectl-snapshot.io"], "resources": ["podsnapshots"], "verbs": ["list"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "reader", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            },
        ]
    )
    token = cluster.kubectl("create", "token", "reader", "-n", namespace, "--duration=10m").stdout.strip()
    # no newline at its end: the official client sends a tokenFile's bytes as they are, and a newline
    # makes its request fail (the light one strips it, as client-go does)
    (tmp_path / "token").write_text(token)
    plugin = tmp_path / "login"
    plugin.write_text(
        f"#!{sys.executable}\n"
        "import json, os\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential',\n"
        f"                  'status': {{'token': open({str(tmp_path / 'token')!r}).read().strip()}}}}))\n"
    )
    plugin.chmod(0o755)
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "./login",
                          "interactiveMode": "Never"}}  # fmt: skip
    users: dict[str, dict[str, Any]] = {
        "token": {"token": token},
        "tokenFile": {"tokenFile": "token"},
        "exec": exec_user,
    }
    for kind, user in users.items():
        kc = user_kubeconfig(cluster, namespace, user, tmp_path / f"{kind}.kubeconfig")
        for env in ({}, {"KUBECTL_SNAPSHOT_KUBE_CLIENT": "official"}):
            listed = ks_plugin("list", "-o", "json", kubeconfig=kc, env=env)
            assert listed.returncode == 0, (kind, env, listed.stderr)
            assert json.loads(listed.stdout)["items"] == [], (kind, env)
            # the context's namespace is the default, and RBAC is the token's own: none elsewhere
            other = ks_plugin("list", "-n", "default", kubeconfig=kc, env=env)
            assert other.returncode == 1, (kind, env, other.stderr)
            who = f"system:serviceaccount:{namespace}:reader"
            assert f'User "{who}" cannot list resource "podsnapshots"' in other.stderr, (kind, env, other.stderr)
    refused = user_kubeconfig(cluster, namespace, {"token": token[:-4] + "AAAA"}, tmp_path / "bad.kubeconfig")
    for env in ({}, {"KUBECTL_SNAPSHOT_KUBE_CLIENT": "official"}):
        proc = ks_plugin("list", kubeconfig=refused, env=env)
        assert proc.returncode == 1, proc.stderr
        assert "rejected the credentials" in proc.stderr and "hint: check --kubeconfig" in proc.stderr, proc.stderr
