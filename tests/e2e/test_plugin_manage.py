"""`list`, `inspect`, `delete --registry` and `restore --dry-run` against the real API server and the
cluster's registry, with a PodSnapshot whose status is written like the agent does (no agent needed),
and the krew zipapp run by the real kubectl as a plugin."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, PodRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.reference import Reference
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.plugin_cli import REPO, PluginRun, ks_plugin, podsnapshot_crd

pytestmark = pytest.mark.e2e
IMAGE = "127.0.0.1:5005/kubectl-snapshot/busybox@sha256:" + "b" * 64


def push_artifact(registry: str, repo: str) -> Reference:
    """A small but well-formed snapshot artifact of pod `web` (one container, one layer)."""
    layer = b"not a real checkpoint, never extracted by these tests"
    layer_digest = sha256_digest(layer)
    config = SnapshotConfig(
        group="web",
        namespace="team-a",
        created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        containers=(ContainerRecord("app", "cid1", IMAGE, "sha256:" + "b" * 64, layer_digest, {}),),
        host=HostFacts(kernel="6.18", arch="amd64", criu_version="4.2.1"),
        pod=PodRecord(
            name="web",
            namespace="team-a",
            uid="u-1",
            node="ks-n1",
            spec={
                "containers": [{"name": "app", "image": IMAGE}],
                "metadata": {"labels": {"app": "web", "pod-template-hash": "x"}},
            },
        ),
    )
    body = config.to_bytes()
    manifest = build_manifest(
        config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(body), len(body)),
        layers=[Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, layer_digest, len(layer))],
        artifact_type=C.ARTIFACT_TYPE,
        annotations={},
    )
    ref = Reference.parse(f"{registry}/{repo}:v1")
    client = RegistryClient()
    client.push_blob(ref, digest=layer_digest, size=len(layer), data=layer)
    client.push_blob(ref, digest=sha256_digest(body), size=len(body), data=body)
    digest = client.push_manifest(ref, manifest.to_bytes(), C.OCI_MANIFEST)
    return ref.with_digest(digest)


def make_podsnapshot(cluster: Cluster, ns: str, name: str, ref: Reference) -> None:
    cluster.apply(
        {
            "apiVersion": "kubectl-snapshot.io/v1alpha1",
            "kind": "PodSnapshot",
            "metadata": {"name": name, "namespace": ns, "labels": {"kubectl-snapshot.io/pod": "web"}},  # as created
            "spec": {"podName": "web", "destination": f"{ref.registry}/{ref.repository}:v1"},
        }
    )
    status = {"phase": "Succeeded", "node": "ks-n1", "reference": f"{ref.name}@{ref.digest}", "size": 4096}
    cluster.kubectl(
        "patch",
        "podsnapshot",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def test_list_inspect_restore_dry_run_and_delete(
    cluster: Cluster, namespace: str, ks_plugin: PluginRun, podsnapshot_crd: str
) -> None:
    ref = push_artifact(cluster.registry, f"e2e/manage-{uuid.uuid4().hex[:6]}")
    make_podsnapshot(cluster, namespace, "web-1", ref)

    table = ks_plugin("list", "-n", namespace, check=True).stdout.splitlines()
    assert table[0].split() == ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"]
    assert table[1].split()[:6] == ["web-1", "web", "Succeeded", "ks-n1", "4.0", "KiB"]
    assert str(ref.digest) in table[1]
    everywhere = json.loads(ks_plugin("list", "-A", "-o", "json", check=True).stdout)
    assert everywhere["kind"] == "List"  # as `kubectl get -o json` prints it
    mine = next(o for o in everywhere["items"] if o["metadata"]["name"] == "web-1")
    assert mine["metadata"]["namespace"] == namespace and mine["status"]["reference"] == f"{ref.name}@{ref.digest}"
    jp = ks_plugin("list", "-n", namespace, "-o", "jsonpath={.items[*].status.phase}", check=True).stdout
    assert jp == "Succeeded"
    wide = ks_plugin("list", "-n", namespace, "-o", "wide", check=True).stdout.splitlines()
    assert wide[0].split()[-3:] == ["STAGE", "DESTINATION", "MESSAGE"]
    by_label = ks_plugin("list", "-n", namespace, "-l", "kubectl-snapshot.io/pod=web", "-o", "name", check=True)
    assert by_label.stdout.split() == ["podsnapshot.kubectl-snapshot.io/web-1"]
    assert ks_plugin("list", "-n", namespace, "-l", "kubectl-snapshot.io/pod=db", check=True).stdout.strip() == (
        "No PodSnapshots found."
    )
    server_dry = ks_plugin("delete", "web-1", "-n", namespace, "--dry-run=server", check=True).stdout
    assert "deleted (server dry run)" in server_dry
    assert cluster.get_json("podsnapshots", "-n", namespace)["items"]  # still there

    by_name = ks_plugin("inspect", "web-1", "-n", namespace, check=True).stdout
    assert f"Reference:  {ref.name}@{ref.digest}" in by_name and "Pod:        team-a/web on node ks-n1" in by_name
    by_ref = json.loads(ks_plugin("inspect", str(ref), "-o", "json", check=True).stdout)
    assert by_ref["containers"][0]["name"] == "app" and by_ref["host"]["criuVersion"] == "4.2.1"

    pod = json.loads(
        ks_plugin("restore", "web-1", "-n", namespace, "--dry-run", "--agent-image", "agent:e2e", "-o", "json").stdout
    )
    assert pod["metadata"]["name"] == "web-restored" and pod["metadata"]["namespace"] == namespace
    assert pod["metadata"]["annotations"]["kubectl-snapshot.io/restore-from"] == f"{ref.name}@{ref.digest}"
    assert pod["metadata"]["labels"] == {"app": "web", "kubectl-snapshot.io/restored-from": "web"}
    assert pod["spec"]["runtimeClassName"] == "kubectl-snapshot"
    # Where Ready agents say their nodes' containerd passes the restore annotation to the runtime wrapper
    # (doctor's holdsRestorePods: say, `make demo`'s install), the wrapper holds the containers at their
    # create and the pod goes without the gate init container; otherwise the gate runs the agent image
    report = json.loads(ks_plugin("doctor", "-o", "json").stdout)
    held = any(n["agentReady"] for n in report["nodes"]) and all(n["holdsRestorePods"] for n in report["nodes"])
    if held:
        assert "initContainers" not in pod["spec"] and "volumes" not in pod["spec"], pod["spec"]
    else:
        assert pod["spec"]["initContainers"][0]["image"] == "agent:e2e"
    assert cluster.get_json("pods", "-n", namespace)["items"] == []  # dry run: nothing created

    deleted = ks_plugin("delete", "web-1", "--registry", "-n", namespace, check=True).stdout
    assert "podsnapshot/web-1 deleted" in deleted
    assert cluster.get_json("podsnapshots", "-n", namespace)["items"] == []
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(ref)
    again = ks_plugin("delete", "web-1", "-n", namespace)
    assert again.returncode == 1 and "no podsnapshot 'web-1'" in again.stderr


def test_kubectl_runs_the_krew_zipapp_as_a_plugin(
    cluster: Cluster, namespace: str, podsnapshot_crd: str, tmp_path: Path
) -> None:
    out = tmp_path / "krew"
    subprocess.run([sys.executable, str(REPO / "krew" / "package.py"), "--out", str(out)], check=True, timeout=300)
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no /usr/bin/python3 for the zipapp's '#!/usr/bin/env python3'")
    env = {**os.environ, "PATH": f"{out}:/usr/bin:/bin", "HOME": str(tmp_path)}
    plugins = subprocess.run([str(cluster.kubectl_bin), "plugin", "list"], capture_output=True, text=True, env=env)
    assert f"{out}/kubectl-snapshot" in plugins.stdout
    proc = subprocess.run(
        [str(cluster.kubectl_bin), "snapshot", "list", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "No PodSnapshots found."
    bad = subprocess.run(
        [
            str(cluster.kubectl_bin),
            "snapshot",
            "pod/nope",
            "-n",
            namespace,
            "--to",
            f"{cluster.registry}/e2e/x",
            "--kubeconfig",
            str(cluster.kubeconfig),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 1 and f"error: pod 'nope' not found in namespace '{namespace}'" in bad.stderr
