"""Encryption at rest on the real cluster: the agent DaemonSet seals every snapshot with its
namespace's key, kept in the one Secret of the agent's namespace (created on first use), and a
restore in that namespace on the other node opens it."""

from __future__ import annotations

import base64
import io
import json

import pytest

from kubectl_snapshot.adapters.keystore import KEY_SECRET
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import MAGIC as SEALED_MAGIC
from kubectl_snapshot.core.sealing import key_id_of
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import agent, plugin
from tests.support.cluster import cluster, namespace

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
