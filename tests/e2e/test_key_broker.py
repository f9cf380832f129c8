"""The key broker on the real cluster (`kubectl snapshot install --key-broker`; docs/security.md, "One node's
agent credentials are worth that node only"): a node's agent token gets the key operations of the
namespaces with a pod on its node only, the agents may not read the key Secret, and a sealed snapshot
still saves and restores through the broker. The module installs with the broker and puts the install
it found back afterwards (the default one the `agent` fixture made: other tests and `make demo` expect it).
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.keybroker import BrokerKeyProvider
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import PermissionDenied, Unavailable
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import KeyUse, key_id_of, wrap_aad
from tests.e2e.test_provenance import grant
from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, running
from tests.support.agent import AgentInstall, _plugin, agent, plugin
from tests.support.cluster import HACK, Cluster, cluster, namespace
from tests.support.registry import free_port

pytestmark = pytest.mark.e2e

# the local cluster has no kube-proxy: the broker runs host-network like the agents, on the nodes' loopback
BROKER_URL = f"https://127.0.0.1:{K.KEY_BROKER_PORT}"
BROKER = K.KEY_BROKER_NAME
SLEEPER = "sleep 3600"


def _install_with_broker(cluster: Cluster, agent: AgentInstall) -> None:
    _plugin(
        cluster,
        "install",
        "--agent-image", agent.image,
        "--api-server", f"https://{cluster.api_host}:{cluster.api_port}",
        "--node-config", str(agent.node_config),
        "--restart-command", f"{HACK / 'containerd-restart.sh'} {{node}}",
        "--host-network",
        "--key-broker", "--key-broker-url", BROKER_URL,
        "--timeout", "5m",
    )  # fmt: skip
    for node in cluster.nodes:
        agent.wait_ready(node)


def _broker_objects(cluster: Cluster) -> list[str]:
    out = cluster.kubectl(
        "get", "deployment,service,serviceaccount,role,rolebinding,secret,configmap", "-n", K.AGENT_NAMESPACE,
        "-o", "name", check=False,
    ).stdout  # fmt: skip
    return [line for line in out.split() if BROKER in line]


@pytest.fixture(scope="module")
def broker(cluster: Cluster, agent: AgentInstall) -> Iterator[AgentInstall]:
    keys_before = cluster.get_json("secret", K.KEY_SECRET, "-n", K.AGENT_NAMESPACE).get("data") or {}
    try:
        _install_with_broker(cluster, agent)
        yield agent
    finally:
        agent.reinstall()  # the install this module found (the `agent` fixture's default one)
        assert _broker_objects(cluster) == [], "the default install left key broker objects behind"
        cluster.get_json("role", "kubectl-snapshot-agent-keys", "-n", K.AGENT_NAMESPACE)  # the agents' Role is back
        keys_after = cluster.get_json("secret", K.KEY_SECRET, "-n", K.AGENT_NAMESPACE).get("data") or {}
        assert set(keys_before) <= set(keys_after), "a namespace key was lost switching key modes"


@pytest.fixture
def other_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    cluster.wait_for(
        f"serviceaccount default in {name}",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=60,
    )
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def _forwarded_broker(cluster: Cluster) -> Iterator[int]:
    """The broker's port on this machine's loopback (the cluster lives in a network namespace of its own)."""
    pods = cluster.get_json("pods", "-n", K.AGENT_NAMESPACE, "-l", f"app.kubernetes.io/name={BROKER}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    assert live, "no key broker pod"
    port = free_port()
    forward = subprocess.Popen(
        [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "port-forward", "-n", K.AGENT_NAMESPACE,
         f"pod/{live[0]['metadata']['name']}", f"{port}:{K.KEY_BROKER_PORT}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert forward.stdout is not None
        assert "Forwarding from" in forward.stdout.readline()
        yield port
    finally:
        forward.terminate()
        forward.wait(10)


def _agent_token(cluster: Cluster, agent: AgentInstall, node: str, audience: str | None) -> str:
    """A token of the agent's ServiceAccount bound to its pod on `node` (what the kubelet projects)."""
    p = agent.agent_pod(node)
    assert p is not None, f"no agent on {node}"
    return str(
        cluster.kubectl(
            "create", "token", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, "--duration=10m",
            *(("--audience", audience) if audience else ()),
            "--bound-object-kind=Pod", f"--bound-object-name={p['metadata']['name']}",
            f"--bound-object-uid={p['metadata']['uid']}",
        ).stdout.strip()
    )  # fmt: skip


def _provider(cluster: Cluster, port: int, token: str, tmp_path: Path, name: str) -> BrokerKeyProvider:
    (tmp_path / f"{name}.token").write_text(token)
    cm = cluster.get_json("configmap", K.KEY_BROKER_CA_CONFIG_MAP, "-n", K.AGENT_NAMESPACE)
    (tmp_path / "ca.crt").write_text(cm["data"]["ca.crt"])
    return BrokerKeyProvider(
        f"https://127.0.0.1:{port}", token_file=str(tmp_path / f"{name}.token"), ca_file=str(tmp_path / "ca.crt")
    )


def _use(cluster: Cluster, ns: str, name: str) -> KeyUse:
    p = cluster.get_json("pod", name, "-n", ns)
    return KeyUse(ns, name, p["metadata"]["uid"])


def _keys(cluster: Cluster) -> dict[str, Any]:
    return dict(cluster.get_json("secret", K.KEY_SECRET, "-n", K.AGENT_NAMESPACE).get("data") or {})


def test_a_nodes_agent_token_opens_only_the_keys_of_its_own_nodes_pods(
    cluster: Cluster, broker: AgentInstall, namespace: str, other_namespace: str, tmp_path: Path
) -> None:
    n1, n2 = cluster.nodes[:2]
    # the agents themselves may no longer read the key Secret: only the broker may
    who = f"system:serviceaccount:{K.AGENT_NAMESPACE}:"
    for sa, expected in ((K.AGENT_NAME, "no"), (BROKER, "yes")):
        can = cluster.kubectl(
            "auth", "can-i", "get", f"secret/{K.KEY_SECRET}", "-n", K.AGENT_NAMESPACE, f"--as={who}{sa}", check=False
        )
        assert can.stdout.strip() == expected, (sa, can.stdout, can.stderr)
    cluster.apply(pod("x", namespace, cluster.busybox_image, {"main": SLEEPER}, node=n1))
    cluster.apply(pod("y", other_namespace, cluster.busybox_image, {"main": SLEEPER}, node=n2))
    running(cluster, namespace, "x")
    running(cluster, other_namespace, "y")
    x, y = _use(cluster, namespace, "x"), _use(cluster, other_namespace, "y")
    with _forwarded_broker(cluster) as port:
        a = _provider(cluster, port, _agent_token(cluster, broker, n1, K.KEY_BROKER_AUDIENCE), tmp_path, "a")
        # the legitimate case: X has a pod on A, A asks for that pod's save
        key = a.namespace_key(namespace, create=True, use=x)
        assert len(key.wrap(b"k" * 32, b"aad")) == 60
        assert key_id_of(base64.b64decode(_keys(cluster)[namespace])) == key.key_id
        # Y's pods run only on B: A is refused, whichever of Y's pods it names, and Y gets no key made
        with pytest.raises(PermissionDenied, match=f"not on the caller's node {n1}"):
            a.namespace_key(other_namespace, create=True, use=y)
        with pytest.raises(PermissionDenied, match="does not exist"):
            a.namespace_key(other_namespace, create=True, use=KeyUse(other_namespace, "x", x.pod_uid))
        assert other_namespace not in _keys(cluster)
        # B's agent gets Y's (its pod is on B)
        b = _provider(cluster, port, _agent_token(cluster, broker, n2, K.KEY_BROKER_AUDIENCE), tmp_path, "b")
        b.namespace_key(other_namespace, create=True, use=y).wrap(b"k" * 32, b"aad")
        # the same agent's token for the API server's audience is worth nothing to the broker
        api = _provider(cluster, port, _agent_token(cluster, broker, n1, None), tmp_path, "api")
        with pytest.raises(Unavailable, match="401"):
            api.namespace_key(namespace, create=True, use=x)
        # once the pod is gone, so is A's access to X's key
        cluster.kubectl("delete", "pod", "x", "-n", namespace, "--wait=true")
        with pytest.raises(PermissionDenied, match="does not exist"):
            a.namespace_key(namespace, create=False, use=x)


def _podsnapshot(cluster: Cluster, ns: str) -> dict[str, Any]:
    items = cluster.get_json("podsnapshots", "-n", ns)["items"]
    assert len(items) == 1, items
    return dict(items[0])


def test_a_sealed_snapshot_saves_and_restores_through_the_broker(
    cluster: Cluster, broker: AgentInstall, namespace: str, plugin: Any
) -> None:
    """The legitimate case, whole: the agent on n1 seals its pod's snapshot with keys it never holds,
    the agent on n2 opens it for the restore pod, and the program carries on."""
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("sealed", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "sealed")
    cluster.wait_for("the counter to reach 5", lambda: counter_value(cluster, namespace, "sealed")[1] >= 5)
    tok, before = counter_value(cluster, namespace, "sealed")
    out = plugin("snapshot", "pod/sealed", "-n", namespace, "--to", f"{cluster.registry}/e2e/brokered", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    ref = Reference.parse(psnap["status"]["reference"])
    reg = RegistryClient()
    config = parse_config(reg.read_blob(ref, parse_manifest(reg.get_manifest(ref)[0]).config.digest))
    assert config.encryption is not None and config.encryption.namespace == namespace
    assert key_id_of(base64.b64decode(_keys(cluster)[namespace])) == config.encryption.key_id

    cluster.kubectl("delete", "pod", "sealed", "-n", namespace, "--wait=true")
    plugin("restore", psnap["metadata"]["name"], "-n", namespace, "--name", "sealed2", "--node", n2)
    restored = running(cluster, namespace, "sealed2")
    assert restored["spec"]["nodeName"] == n2
    tok2, after = counter_value(cluster, namespace, "sealed2")
    assert tok2 == tok and after >= before
    logs = cluster.kubectl("logs", "-n", K.AGENT_NAMESPACE, f"deployment/{BROKER}", check=False).stdout
    assert "refused" not in logs or namespace not in logs, logs[-4000:]


def test_a_granted_restore_into_another_namespace_opens_through_the_broker(
    cluster: Cluster, broker: AgentInstall, namespace: str, other_namespace: str, plugin: Any
) -> None:
    """A snapshot sealed for `namespace`, restored into `other_namespace` once a SnapshotGrant of
    `namespace` allows it: n2's agent holds no key, the broker opens the sealing namespace's data keys for
    the restore pod of the other namespace (it was refused in this mode before: the broker looked for the
    pod in the sealing namespace). Without the grant, refused, and nothing runs."""
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("granted-src", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "granted-src")
    tok, before = counter_value(cluster, namespace, "granted-src")
    to = f"{cluster.registry}/e2e/granted"
    ref = json.loads(plugin("snapshot", "pod/granted-src", "-n", namespace, "--to", to, "-o", "json").stdout)["status"][
        "reference"
    ]
    proc = plugin(
        "restore", ref, "-n", other_namespace, "--name", "thief", "--node", n2, "--timeout", "120s", check=False
    )
    assert proc.returncode == 1 and f"no SnapshotGrant in '{namespace}' grants '{other_namespace}'" in proc.stderr

    grant(cluster, namespace, other_namespace)
    plugin("restore", ref, "-n", other_namespace, "--name", "granted", "--node", n2)
    restored = running(cluster, other_namespace, "granted")
    assert restored["spec"]["nodeName"] == n2
    tok2, after = counter_value(cluster, other_namespace, "granted")
    assert tok2 == tok and after >= before


def _sealed(ref: Reference) -> tuple[bytes, bytes, Any]:
    """A snapshot's manifest and config as stored, and its encryption record."""
    reg = RegistryClient()
    manifest = reg.get_manifest(ref)[0]
    config = reg.read_blob(ref, parse_manifest(manifest).config.digest)
    encryption = parse_config(config).encryption
    assert encryption is not None
    return manifest, config, encryption


def test_a_restore_pods_unwraps_are_bound_to_its_own_snapshot(
    cluster: Cluster, broker: AgentInstall, namespace: str, plugin: Any, tmp_path: Path
) -> None:
    """D14: with a restore pod of save 1 on n2, n2's agent token opens save 1's data keys (the restore itself
    ran so) and not those of save 2 of the same pod, which it could read from the registry."""
    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("twice", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "twice")
    refs = []
    for _ in range(2):
        out = plugin("snapshot", "pod/twice", "-n", namespace, "--to", f"{cluster.registry}/e2e/bound", "-o", "json")
        psnap = json.loads(out.stdout)
        assert psnap["status"]["phase"] == "Succeeded", psnap
        refs.append((psnap["metadata"]["name"], Reference.parse(psnap["status"]["reference"])))
    (first, ref1), (_, ref2) = refs
    plugin("restore", first, "-n", namespace, "--name", "bound", "--node", n2)  # the legitimate restore
    running(cluster, namespace, "bound")
    man1, cfg1, enc1 = _sealed(ref1)
    _, cfg2, enc2 = _sealed(ref2)
    layer1 = parse_config(cfg1).containers[0].layer_digest
    layer2 = parse_config(cfg2).containers[0].layer_digest
    p = cluster.get_json("pod", "bound", "-n", namespace)
    use = KeyUse(namespace, "bound", p["metadata"]["uid"], snapshot=str(ref1), manifest=man1, config=cfg1)
    with _forwarded_broker(cluster) as port:
        n2_agent = _provider(cluster, port, _agent_token(cluster, broker, n2, K.KEY_BROKER_AUDIENCE), tmp_path, "n2")
        key = n2_agent.namespace_key(namespace, create=False, use=use)
        assert len(key.unwrap(base64.b64decode(enc1.keys[layer1]), wrap_aad(namespace, layer1))) == 32
        with pytest.raises(PermissionDenied, match="not in the snapshot opened for this restore"):
            key.unwrap(base64.b64decode(enc2.keys[layer2]), wrap_aad(namespace, layer2))


def test_without_the_broker_a_save_fails_as_keys_unavailable_and_the_pod_runs_on(
    cluster: Cluster, broker: AgentInstall, namespace: str, plugin: Any
) -> None:
    n1 = cluster.nodes[0]
    cluster.apply(pod("orphan", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "orphan")
    cluster.kubectl("scale", "deployment", BROKER, "-n", K.AGENT_NAMESPACE, "--replicas=0")
    try:
        cluster.wait_for(
            "the key broker's pod to be gone",
            lambda: (
                not cluster.get_json("pods", "-n", K.AGENT_NAMESPACE, "-l", f"app.kubernetes.io/name={BROKER}")["items"]
            ),
            timeout=120,
        )
        before = counter_value(cluster, namespace, "orphan")[1]
        out = plugin(
            "snapshot", "pod/orphan", "-n", namespace, "--to", f"{cluster.registry}/e2e/orphan", check=False
        )  # fmt: skip
        assert out.returncode != 0
        status = _podsnapshot(cluster, namespace)["status"]
        assert status["phase"] == "Failed" and "keys unavailable" in status["message"], status
        assert "key broker" in (status.get("hint") or "") or "key broker" in status["message"], status
        cluster.wait_for(
            "the pod to count on", lambda: counter_value(cluster, namespace, "orphan")[1] > before + 3, timeout=30
        )
    finally:
        cluster.kubectl("scale", "deployment", BROKER, "-n", K.AGENT_NAMESPACE, "--replicas=1")
        cluster.kubectl(
            "rollout", "status", f"deployment/{BROKER}", "-n", K.AGENT_NAMESPACE, "--timeout=120s", check=False
        )
