"""The local two-node cluster (hack/cluster) does what the project's e2e tests rely on.

Real API server, scheduler, controller-manager, two kubelets with their own containerd, runc and
CRIU; images from the local registry. Every check here has a failing counterpart that is a real
misconfiguration we hit or guard against (wrong node addresses, missing RBAC, CRIU not found by
containerd, drop-ins not imported, pods with a route off the machine).
"""

from __future__ import annotations

import ipaddress
import json
import stat
import subprocess
import tarfile
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e

NODE_IPS = {"ks-n1": "10.213.0.11", "ks-n2": "10.213.0.12"}  # in the cluster's network namespace


def pod(
    name: str, ns: str, image: str, command: str, *, node: str | None = None, pull: str = "IfNotPresent", **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "containers": [{"name": "main", "image": image, "command": ["sh", "-c", command], "imagePullPolicy": pull}],
        "terminationGracePeriodSeconds": 1,
        **spec,
    }
    if node:
        body["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": body}


def wait_phase(cluster: Cluster, ns: str, name: str, phase: str = "Running", timeout: float = 120) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def done() -> bool:
        nonlocal last
        last = cluster.get_json("pod", name, "-n", ns)
        if last["status"].get("phase") == "Failed" and phase != "Failed":
            raise AssertionError(f"pod {name} failed: {json.dumps(last['status'])[:2000]}")
        return bool(last["status"].get("phase") == phase)

    try:
        cluster.wait_for(f"pod {ns}/{name} {phase}", done, timeout)
    except AssertionError:
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        raise AssertionError(f"pod {name} not {phase}: {json.dumps(last.get('status'))[:1500]}\n{events}") from None
    return last


def registry_digest(cluster: Cluster, image: str) -> str:
    repo, _, tag = image.removeprefix(cluster.registry + "/").rpartition(":")
    req = urllib.request.Request(
        f"http://{cluster.registry}/v2/{repo}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.headers["Docker-Content-Digest"])


def node_images(cluster: Cluster, node: str) -> list[str]:
    out = subprocess.run(
        ["/usr/local/bin/ctr", "--address", str(cluster.containerd_socket(node)), "-n", "k8s.io", "images", "ls", "-q"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.split()


def logs_contain(cluster: Cluster, ns: str, name: str, text: str) -> bool:
    return text in cluster.kubectl("logs", name, "-n", ns, check=False).stdout


def test_two_nodes_ready(cluster: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in cluster.get_json("nodes")["items"]}
    assert sorted(nodes) == sorted(cluster.nodes) == ["ks-n1", "ks-n2"]
    for name, node in nodes.items():
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (name, ready)
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.36.3"
        assert info["containerRuntimeVersion"].startswith("containerd://2.3."), info
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == NODE_IPS[name]
        assert not node["spec"].get("taints"), node["spec"]["taints"]
    text = cluster.kubectl("get", "nodes").stdout
    assert text.count(" Ready ") == 2, text


def test_pod_on_each_node_pulls_from_local_registry(cluster: Cluster, namespace: str) -> None:
    # Pull by a fresh tag so each node's kubelet really pulls (nothing cached under that name).
    tag = f"{cluster.registry}/kubectl-snapshot/busybox:e2e-{uuid.uuid4().hex[:6]}"
    digest = registry_digest(cluster, cluster.busybox_image)
    manifest = urllib.request.urlopen(
        urllib.request.Request(
            f"http://{cluster.busybox_image.split('/', 1)[0]}/v2/kubectl-snapshot/busybox/manifests/{digest}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        ),
        timeout=10,
    ).read()
    urllib.request.urlopen(
        urllib.request.Request(
            f"http://{cluster.registry}/v2/kubectl-snapshot/busybox/manifests/{tag.rpartition(':')[2]}",
            data=manifest,
            method="PUT",
            headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        ),
        timeout=10,
    )
    for node in cluster.nodes:
        assert tag not in node_images(cluster, node)
    cluster.apply(
        [
            pod(f"on-{node}", namespace, tag, f"echo hello-from-{node}; sleep 3600", node=node, pull="Always")
            for node in cluster.nodes
        ]
    )
    for node in cluster.nodes:
        status = wait_phase(cluster, namespace, f"on-{node}")
        spec_node = cluster.get_json("pod", f"on-{node}", "-n", namespace)["spec"]["nodeName"]
        assert spec_node == node
        assert status["status"]["hostIP"] == NODE_IPS[node]
        assert ipaddress.ip_address(status["status"]["podIP"]) in ipaddress.ip_network("10.244.0.0/16")
        assert status["status"]["containerStatuses"][0]["imageID"].endswith(digest)
        assert tag in node_images(cluster, node), f"{node}'s containerd did not pull {tag}"
        # logs go API server -> kubelet (kubelet-api-admin RBAC for the apiserver's client identity)
        wanted = partial(logs_contain, cluster, namespace, f"on-{node}", f"hello-from-{node}")
        cluster.wait_for("logs", wanted, timeout=30)


def test_daemonset_one_pod_per_node(cluster: Cluster, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "ds", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "ds"}},
                "template": {
                    "metadata": {"labels": {"app": "ds"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "main", "image": cluster.busybox_image, "command": ["sleep", "3600"]}],
                    },
                },
            },
        }
    )
    cluster.wait_for(
        "daemonset ready on both nodes",
        lambda: cluster.get_json("daemonset", "ds", "-n", namespace)["status"].get("numberReady") == 2,
        timeout=120,
    )
    pods = cluster.get_json("pods", "-n", namespace, "-l", "app=ds")["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(cluster.nodes)


def _checkpoint(cluster: Cluster, user: str, node: str, ns: str, name: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(
        "create",
        "--raw",
        f"/api/v1/nodes/{node}/proxy/checkpoint/{ns}/{name}/main",
        "-f",
        "-",
        "--as",
        user,
        input="",
        check=False,
        timeout=120,
    )


def test_checkpoint_api_through_apiserver(cluster: Cluster, namespace: str) -> None:
    node = cluster.nodes[-1]
    cluster.apply(
        pod(
            "counter",
            namespace,
            cluster.busybox_image,
            "i=0; while true; do i=$((i+1)); echo $i; sleep 0.2; done",
            node=node,
        )
    )
    wait_phase(cluster, namespace, "counter")
    user = f"e2e-checkpointer-{namespace}"
    denied = _checkpoint(cluster, user, node, namespace, "counter")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

    role = f"e2e:{namespace}:node-proxy"
    cluster.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": role},
                "rules": [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["create"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            },
        ]
    )
    archive: Path | None = None
    try:
        result = _checkpoint(cluster, user, node, namespace, "counter")
        for _ in range(10):  # RBAC is cached for a moment after the binding is created
            if result.returncode == 0 or "forbidden" not in result.stderr.lower():
                break
            time.sleep(1)
            result = _checkpoint(cluster, user, node, namespace, "counter")
        assert result.returncode == 0, result.stderr
        items = json.loads(result.stdout)["items"]
        archive = Path(items[0])
        assert archive.parent == cluster.checkpoint_dir(node), archive
        assert archive.name.startswith(f"checkpoint-counter_{namespace}-main-")
        assert stat.S_IMODE(archive.stat().st_mode) & 0o077 == 0  # it holds the container's memory
        with tarfile.open(archive) as tar:
            names = tar.getnames()
        assert {"config.dump", "spec.dump"} <= set(names), names
        assert any(n.startswith("checkpoint/pages-") for n in names), names  # CRIU memory images
        # The workload keeps running after the checkpoint (default: leave running).
        before = int(cluster.kubectl("logs", "counter", "-n", namespace, "--tail=1").stdout.strip())
        cluster.wait_for(
            "counter to keep counting",
            lambda: int(cluster.kubectl("logs", "counter", "-n", namespace, "--tail=1").stdout.strip()) > before,
            timeout=20,
        )
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", role, check=False)
        if archive is not None:
            archive.unlink(missing_ok=True)


def test_runtime_handler_dropin_selected_by_runtimeclass(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """The mechanism the project's runc wrapper relies on: a containerd drop-in + RuntimeClass."""
    node = cluster.nodes[0]
    handler = f"ks-e2e-{uuid.uuid4().hex[:6]}"
    calls = tmp_path / "calls.log"
    wrapper = tmp_path / "runc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec /usr/sbin/runc "$@"\n')
    wrapper.chmod(0o755)
    dropin = cluster.containerd_dropin_dir(node) / f"{handler}.toml"
    cluster.apply(pod("survivor", namespace, cluster.busybox_image, "sleep 3600", node=node))
    wait_phase(cluster, namespace, "survivor")
    dropin.write_text(
        "version = 3\n"
        f"[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}]\n"
        "  runtime_type = 'io.containerd.runc.v2'\n"
        f"[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}.options]\n"
        f"  BinaryName = '{wrapper}'\n  SystemdCgroup = false\n"
    )
    try:
        cluster.restart_containerd(node)
        cluster.apply(
            {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": handler}, "handler": handler}
        )
        cluster.apply(
            pod("hooked", namespace, cluster.busybox_image, "sleep 3600", node=node, runtimeClassName=handler)
        )
        wait_phase(cluster, namespace, "hooked")
        log = calls.read_text()
        assert " create " in f" {log} " and "--bundle" in log, log
        survivor = cluster.get_json("pod", "survivor", "-n", namespace)["status"]
        assert survivor["phase"] == "Running" and survivor["containerStatuses"][0]["restartCount"] == 0
    finally:
        cluster.kubectl("delete", "pod", "hooked", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        cluster.kubectl("delete", "runtimeclass", handler, check=False)
        dropin.unlink(missing_ok=True)
        cluster.restart_containerd(node)


def test_pod_network_stays_on_the_machine(cluster: Cluster, namespace: str) -> None:
    """Pods and host-network pods live in the cluster's own network namespace, which has no uplink.

    Pods reach the API server (directly and as the kubernetes Service, 10.96.0.1:443, DNATed in the
    namespace because there is no kube-proxy); host-network pods see only the namespace's
    interfaces and reach the API server and the registry on its loopback.
    """
    api = f"{cluster.api_host} {cluster.api_port}"
    cluster.apply(
        pod(
            "routes",
            namespace,
            cluster.busybox_image,
            "ip route; cat /etc/resolv.conf; nc -w 3 10.96.0.1 443 </dev/null && echo service-ok",
            node=cluster.nodes[0],
            restartPolicy="Never",
        )
    )
    cluster.apply(
        [
            pod(
                f"host-{n}",
                namespace,
                cluster.busybox_image,
                f"ip -o addr; ip route; nc -w 3 {api} </dev/null && nc -w 3 {cluster.registry.replace(':', ' ')} "
                "</dev/null && nc -w 3 10.96.0.1 443 </dev/null && echo host-ok",
                node=n,
                hostNetwork=True,
                restartPolicy="Never",
            )
            for n in cluster.nodes
        ]
    )
    wait_phase(cluster, namespace, "routes", "Succeeded")
    out = cluster.kubectl("logs", "routes", "-n", namespace).stdout
    assert "10.96.0.0/16 via 10.244.0.1" in out and "default" not in out and "service-ok" in out, out
    nameservers = [line.split()[1] for line in out.splitlines() if line.startswith("nameserver")]
    assert all(ipaddress.ip_address(ns).is_loopback for ns in nameservers), out
    for n in cluster.nodes:
        wait_phase(cluster, namespace, f"host-{n}", "Succeeded")
        out = cluster.kubectl("logs", f"host-{n}", "-n", namespace).stdout
        assert "host-ok" in out and NODE_IPS[n] in out, out
        assert "default" not in out and " eth0 " not in out, out  # no uplink, no host interfaces
