"""Encryption at rest on the real cluster: the agent DaemonSet seals every snapshot with its
namespace's key, kept in the one Secret of the agent's namespace (created on first use), and a
restore in that namespace on the other node opens it."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from kubectl_snapshot.adapters.keystore import KEY_SECRET
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import MAGIC as SEALED_MAGIC
from kubectl_snapshot.core.sealing import key_id_of
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import REPO, Cluster, cluster, namespace

Plugin = Callable[..., subprocess.CompletedProcess[str]]

pytestmark = pytest.mark.e2e


def test_agent_seals_snapshots_with_the_namespace_key(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("sealed", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "sealed")
    cluster.wait_for("the counter to reach 10", lambda: counter_value(cluster, namespace, "sealed")[1] >= 10)
    tok, before = counter_value(cluster, namespace, "sealed")

    out = plugin("snapshot", "pod/sealed", "-n", namespace, "--to", f"{cluster.registry}/e2e/sealed", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    ref = Reference.parse(psnap["status"]["reference"])

    reg = RegistryClient()
    manifest = parse_manifest(reg.get_manifest(ref)[0])
    config = parse_config(reg.read_blob(ref, manifest.config.digest))
    assert config.encryption is not None and config.encryption.namespace == namespace
    assert manifest.layers and all(d.media_type.endswith(C.ENCRYPTED_SUFFIX) for d in manifest.layers)
    assert manifest.annotations[C.ANN_ENCRYPTION] == config.encryption.scheme
    for d in manifest.layers:
        buf = io.BytesIO()
        reg.fetch_blob(ref, d.digest, buf)
        assert buf.getvalue().startswith(SEALED_MAGIC)  # sealed, not a zstd frame in clear

    # the key: one entry for this namespace in the agent's Secret, the one the config names
    secret = cluster.get_json("secret", KEY_SECRET, "-n", K.AGENT_NAMESPACE)
    key = base64.b64decode(secret["data"][namespace])
    assert key_id_of(key) == config.encryption.key_id

    cluster.kubectl("delete", "pod", "sealed", "-n", namespace, "--wait=true")
    plugin("restore", psnap["metadata"]["name"], "-n", namespace, "--name", "sealed2", "--node", n2)
    restored = running(cluster, namespace, "sealed2")
    assert restored["spec"]["nodeName"] == n2
    tok2, after = counter_value(cluster, namespace, "sealed2")
    assert tok2 == tok and after >= before


# (the Secret kubectl-snapshot-signing-key exists only where an earlier release made it: not on the e2e cluster)
KEY_OBJECTS = (("secret", KEY_SECRET), ("configmap", K.TRUST_CONFIG_MAP))
KEYS_SECTION = "### The keys: kept by uninstall, backed up by you"


def _sealed_snapshot(cluster: Cluster, namespace: str, plugin: Plugin, name: str) -> tuple[str, str]:
    """A snapshot of a counting pod, sealed with the namespace's key; the pod deleted. Its reference."""
    cluster.apply(pod(name, namespace, cluster.busybox_image, {"counter": COUNTER}, node=cluster.nodes[0]))
    running(cluster, namespace, name)
    cluster.wait_for("the counter to reach 3", lambda: counter_value(cluster, namespace, name)[1] >= 3)
    out = plugin("snapshot", f"pod/{name}", "-n", namespace, "--to", f"{cluster.registry}/e2e/{name}", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    ref = Reference.parse(psnap["status"]["reference"])
    reg = RegistryClient()
    config = parse_config(reg.read_blob(ref, parse_manifest(reg.get_manifest(ref)[0]).config.digest))
    assert config.encryption is not None and config.encryption.namespace == namespace
    tok = counter_value(cluster, namespace, name)[0]
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true")
    return str(ref), tok


def _key_data(cluster: Cluster) -> dict[str, Any]:
    found = {}
    for kind, name in KEY_OBJECTS:
        got = cluster.kubectl("get", kind, name, "-n", K.AGENT_NAMESPACE, "-o", "json", check=False)
        found[name] = json.loads(got.stdout).get("data") if got.returncode == 0 else None
    return found


def _restores(cluster: Cluster, namespace: str, plugin: Plugin, ref: str, tok: str, name: str) -> None:
    """The sealed snapshot restores (the PodSnapshot went with the CRD: by reference) and carries on."""
    plugin("restore", ref, "-n", namespace, "--name", name, "--node", cluster.nodes[1])
    running(cluster, namespace, name)
    assert counter_value(cluster, namespace, name)[0] == tok
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=true")  # uninstall waits for none of ours


def _others_under_the_runtime_class(cluster: Cluster, namespace: str) -> list[str]:
    """`ns/name` of the running pods of the runtime class this test did not make (`make demo`'s restored
    counter, on the demo's cluster): uninstall refuses while they run, so the tests pass --force for
    them, and check that they run on through the uninstall and the reinstall."""
    return sorted(
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in cluster.get_json("pods", "-A")["items"]
        if p["spec"].get("runtimeClassName") == K.RUNTIME_CLASS
        and p["metadata"]["namespace"] != namespace
        and not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") == "Running"
    )


def _uninstall(
    cluster: Cluster, namespace: str, plugin: Plugin, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`kubectl snapshot uninstall ARGS`, with --force only for pods this session did not start."""
    others = _others_under_the_runtime_class(cluster, namespace)
    out = plugin("uninstall", *args, *(["--force"] if others else []))
    for name in others:
        assert name in out.stderr, out.stderr  # named as left running
    return out, others


def _still_running(cluster: Cluster, others: list[str]) -> None:
    for name in others:
        ns, pod_name = name.split("/")
        assert cluster.get_json("pod", pod_name, "-n", ns)["status"]["phase"] == "Running", name


def test_uninstall_keeps_the_keys_so_a_reinstall_restores_a_sealed_snapshot(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ref, tok = _sealed_snapshot(cluster, namespace, plugin, "kept")
    before = _key_data(cluster)
    assert before[KEY_SECRET] and namespace in before[KEY_SECRET] and all(before.values())

    out, others = _uninstall(cluster, namespace, plugin)
    kept = {line.split()[0] for line in out.stdout.splitlines() if line.endswith(" kept")}
    assert kept == {f"Namespace/{K.AGENT_NAMESPACE}", f"Secret/{KEY_SECRET}", f"ConfigMap/{K.TRUST_CONFIG_MAP}"}, (
        out.stdout
    )
    assert "--purge-keys" in out.stderr
    assert cluster.kubectl("get", "daemonset", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, check=False).returncode != 0
    ns = cluster.get_json("namespace", K.AGENT_NAMESPACE)
    assert not ns["metadata"].get("deletionTimestamp")
    assert _key_data(cluster) == before

    agent.reinstall()
    assert _key_data(cluster)[KEY_SECRET] == before[KEY_SECRET]
    # every node's key stays trusted, bound to its node (the agents find theirs registered already)
    assert before[K.TRUST_CONFIG_MAP].items() <= _key_data(cluster)[K.TRUST_CONFIG_MAP].items()
    _restores(cluster, namespace, plugin, ref, tok, "kept2")
    _still_running(cluster, others)


def _doc_blocks() -> list[str]:
    """The sh blocks of docs/deploy.md's section on the keys: the backup, then the restore."""
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text.split(KEYS_SECTION, 1)[1].split("\n#", 1)[0]
    blocks = [b.split("\n", 1)[1] for b in section.split("```sh")[1:]]
    return [b.split("```", 1)[0] for b in blocks]


def test_uninstall_purge_keys_deletes_them_and_the_documented_backup_brings_them_back(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, tmp_path
):
    ref, tok = _sealed_snapshot(cluster, namespace, plugin, "purged")
    before = _key_data(cluster)
    backup, restore = _doc_blocks()
    # the documented commands, as written, with the cluster's kubectl (the install is the test's own)
    shell = f'kubectl() {{ "{cluster.kubectl_bin}" --kubeconfig "{cluster.kubeconfig}" "$@"; }}\nset -eu\n'
    restore = "\n".join(line for line in restore.splitlines() if not line.startswith("kubectl snapshot install"))

    def run(script: str) -> None:
        done = subprocess.run(["bash", "-c", shell + script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    run(backup)
    others: list[str] = []
    try:
        out, others = _uninstall(cluster, namespace, plugin, "--purge-keys", "-o", "json")
        assert json.loads(out.stdout)["kept"] == []
        assert _key_data(cluster) == dict.fromkeys(before)  # gone at once, by name
        cluster.wait_for(
            f"namespace {K.AGENT_NAMESPACE} to be gone",
            lambda: cluster.kubectl("get", "namespace", K.AGENT_NAMESPACE, check=False).returncode != 0,
            timeout=180,
        )
    finally:  # whatever happened above, the session's cluster gets its keys and its agent back
        if cluster.kubectl("get", "daemonset", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, check=False).returncode != 0:
            run(restore)
            agent.reinstall()
    assert _key_data(cluster) == before
    _restores(cluster, namespace, plugin, ref, tok, "purged2")
    _still_running(cluster, others)
