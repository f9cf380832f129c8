"""The agent image and render()'s objects on the real two-node cluster (hack/cluster).

- hack/build-agent-image.sh builds the image offline and pushes it to the cluster's registry; a pod
  from it runs on each node: the entry point, the agent's imports (grpc, kubernetes, zstandard, pycriu,
  the generated containerd stubs) and the wrapper zipapp under the image's bare python3;
- the CRD applies, ``kubectl get podsnapshots``/``psnap`` show the printer columns, the schema rejects
  bad objects and keeps the spec immutable, and the status subresource works;
- the RBAC objects do what they claim on the real authorizer: the agent's service account can do
  exactly its list, and users get PodSnapshot rights through the built-in edit/view roles;
- the DaemonSet for this cluster (per-node paths, API server override) passes server-side validation.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot import __version__
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.deploy import keys, render
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
AGENT_SA = f"system:serviceaccount:{K.AGENT_NAMESPACE}:{K.AGENT_NAME}"


@pytest.fixture(scope="module")
def agent_image(cluster: Cluster) -> str:
    """REF@sha256:... of the agent image, built (or found in the cache) and pushed to the cluster's registry."""
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is missing (apt-get install debootstrap)")
    if not Path("/usr/lib/python3/dist-packages/pycriu").is_dir():
        pytest.skip("python3-pycriu is missing (hack/install-node-deps.sh)")
    proc = subprocess.run(
        [str(REPO / "hack" / "build-agent-image.sh"), f"{cluster.registry}/kubectl-snapshot/agent:e2e"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = proc.stdout.strip().splitlines()[-1]
    assert ref.startswith(f"{cluster.registry}/kubectl-snapshot/agent@sha256:"), proc.stdout
    return ref


def wait_done(cluster: Cluster, ns: str, name: str, timeout: float = 180) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def done() -> bool:
        nonlocal last
        last = cluster.get_json("pod", name, "-n", ns)
        return last["status"].get("phase") in ("Succeeded", "Failed")

    try:
        cluster.wait_for(f"pod {ns}/{name} to finish", done, timeout)
    except AssertionError as e:
        if "timed out" not in str(e):
            raise  # kubectl itself failed: say so, not "timed out"
        events = cluster.kubectl("get", "events", "-n", ns, check=False).stdout
        raise AssertionError(f"{json.dumps(last.get('status'))[:2000]}\n{events}") from None
    return last


CHECK_IMAGE = """
set -e
ks-agent --version
# ks-agent is the static launcher (its served checkpoint/restore without Python), the program in libexec
grep -q agentClient /usr/local/lib/kubectl-snapshot/venv/bin/ks-agent.launch && echo launcher-ok
python3 -c 'import grpc, kubernetes, zstandard, yaml, pycriu, shim.containerd.client, shim.agent_cli
print("imports-ok")'
# the wrapper zipapp with no site-packages at all, as on a node's bare python3
/usr/bin/python3 -I -S -c 'import sys; sys.path.insert(0, "/opt/kubectl-snapshot-runc.pyz")
import shim.runtime_wrapper, shim.files.rootfs_diff; print("pyz-ok")'
"""


def test_agent_image_runs_on_each_node(cluster: Cluster, namespace: str, agent_image: str) -> None:
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"agent-{node}", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "agent",
                        "image": agent_image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c", CHECK_IMAGE],
                    }
                ],
            },
        }
        for node in cluster.nodes
    ]
    cluster.apply(pods)
    for node in cluster.nodes:
        pod = wait_done(cluster, namespace, f"agent-{node}")
        logs = cluster.kubectl("logs", f"agent-{node}", "-n", namespace, check=False).stdout
        assert pod["status"]["phase"] == "Succeeded", logs
        assert pod["spec"]["nodeName"] == node
        assert __version__ in logs and "imports-ok" in logs and "pyz-ok" in logs and "launcher-ok" in logs, logs


def test_agent_version_is_the_entrypoint(cluster: Cluster, namespace: str, agent_image: str) -> None:
    """Entrypoint ["ks-agent"]: args alone run it (as the DaemonSet's containers do)."""
    node = cluster.nodes[0]
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "entrypoint", "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "restartPolicy": "Never",
                "containers": [{"name": "agent", "image": agent_image, "args": ["--version"]}],
            },
        }
    )
    pod = wait_done(cluster, namespace, "entrypoint")
    logs = cluster.kubectl("logs", "entrypoint", "-n", namespace).stdout
    assert pod["status"]["phase"] == "Succeeded" and __version__ in logs, logs


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[list[dict[str, Any]]]:
    """render()'s cluster-wide objects applied for real; the DaemonSet only validated (dry run)."""
    objs = render(
        "127.0.0.1:5005/kubectl-snapshot/agent:e2e",
        api_server=f"https://{cluster.api_host}:{cluster.api_port}",
        per_node_paths={
            n: {
                "containerd_socket": str(cluster.containerd_socket(n)),
                "kubelet_root": str(cluster.state_dir / n / "kubelet"),
                "containerd_dropin_dir": str(cluster.containerd_dropin_dir(n)),
            }
            for n in cluster.nodes
        },
        host_network=True,  # the cluster's registry listens on loopback only
    )
    cluster.apply([o for o in objs if o["kind"] not in ("DaemonSet", "ConfigMap")])
    cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/{K.PLURAL}.{K.GROUP}", "--timeout=60s"
    )  # fmt: skip
    try:
        yield objs
    finally:  # admission policies are cluster-wide: leave none behind for the next session
        for o in objs:
            if o["kind"].startswith("ValidatingAdmissionPolicy"):
                cluster.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)


def test_daemonset_passes_server_side_validation(cluster: Cluster, installed: list[dict[str, Any]]) -> None:
    rest = [o for o in installed if o["kind"] in ("DaemonSet", "ConfigMap")]
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest})
    )
    assert "daemonset.apps/kubectl-snapshot-agent" in proc.stdout, proc.stdout


def podsnapshot(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    body = {"podName": "counter", "destination": "127.0.0.1:5005/snapshots/counter:1", **spec}
    return {"apiVersion": K.API_VERSION, "kind": K.KIND, "metadata": {"name": name, "namespace": ns}, "spec": body}


def test_crd_and_kubectl_get(cluster: Cluster, namespace: str, installed: list[dict[str, Any]]) -> None:
    cluster.apply(podsnapshot("snap-1", namespace))
    table = cluster.kubectl("get", "podsnapshots", "-n", namespace).stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "POD", "PHASE", "NODE", "SIZE", "REFERENCE", "AGE"], table
    assert "snap-1" in table and "counter" in table
    assert "snap-1" in cluster.kubectl("get", K.SHORT_NAME, "-n", namespace).stdout
    obj = cluster.get_json(K.PLURAL, "snap-1", "-n", namespace)
    assert obj["spec"]["includeVolumes"] is True and obj["spec"]["stop"] is False  # schema defaults

    # status through the subresource, shown by the printer columns
    status = {
        "status": {
            "phase": K.PHASE_SUCCEEDED,
            "node": "ks-n1",
            "size": 4096,
            "sizeHuman": "4.0 KiB",  # what the agent writes beside size (core/status.py)
            "reference": "r@sha256:x",
        }
    }
    cluster.kubectl(
        "patch", K.PLURAL, "snap-1", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    row = cluster.kubectl("get", K.PLURAL, "snap-1", "-n", namespace, "--no-headers").stdout.split()
    assert row[:7] == ["snap-1", "counter", "Succeeded", "ks-n1", "4.0", "KiB", "r@sha256:x"], row

    # the spec is immutable; bad objects are refused at the door
    changed = cluster.kubectl(
        "patch", K.PLURAL, "snap-1", "-n", namespace, "--type=merge", "-p", '{"spec":{"podName":"other"}}', check=False
    )
    assert changed.returncode != 0 and "immutable" in changed.stderr, changed.stderr
    bad = podsnapshot("snap-bad", namespace)
    del bad["spec"]["destination"]
    refused = cluster.kubectl("create", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "destination" in refused.stderr, refused.stderr
    bad_phase = cluster.kubectl(
        "patch", K.PLURAL, "snap-1", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", '{"status":{"phase":"Exploded"}}', check=False,
    )  # fmt: skip
    assert bad_phase.returncode != 0, bad_phase.stdout


def can_i(cluster: Cluster, user: str, verb: str, resource: str, ns: str | None = None) -> bool:
    resource, _, sub = resource.partition("/")  # kubectl reads TYPE/NAME; subresources go in a flag
    args = ["auth", "can-i", verb, resource, "--as", user] + (["-n", ns] if ns else ["--all-namespaces"])
    args += [f"--subresource={sub}"] if sub else []
    return cluster.kubectl(*args, check=False).stdout.strip() == "yes"


def test_agent_rbac_on_the_real_authorizer(cluster: Cluster, installed: list[dict[str, Any]]) -> None:
    allowed = [
        ("watch", K.PLURAL),
        ("patch", f"{K.PLURAL}/status"),
        ("patch", "pods/status"),  # the restore-status annotation (admission: own node, that annotation)
        ("delete", "pods"),  # spec.stop: the pod goes once its snapshot is pushed (admission: own node)
        ("create", "events"),
        ("patch", "nodes"),  # admission: its own node, the host-facts annotation
        ("create", K.PLURAL),  # autosave: a policy's saves (admission: the namespace's destination lists)
        ("delete", K.PLURAL),  # autosave: retention
        ("watch", K.POLICY_PLURAL),
        ("patch", f"{K.POLICY_PLURAL}/status"),  # its own node's entries, server-side applied
    ]
    denied = [
        ("update", K.PLURAL),
        ("update", K.POLICY_PLURAL),
        ("patch", K.POLICY_PLURAL),  # never a policy's spec
        ("get", "secrets"),  # only through a namespace's RoleBinding (tests/e2e/test_tenant_admission.py)
        ("list", "secrets"),
        ("patch", "pods"),
        ("update", "pods"),
        ("create", "pods"),
        ("create", "pods/exec"),
        ("delete", "nodes"),
        ("patch", "nodes/status"),
    ]
    for verb, resource in allowed:
        assert can_i(cluster, AGENT_SA, verb, resource), (verb, resource)
    for verb, resource in denied:
        assert not can_i(cluster, AGENT_SA, verb, resource), (verb, resource)
    # no Secret anywhere, its own namespace included: a stolen token could mint a token Secret that never expires
    assert not can_i(cluster, AGENT_SA, "create", "secrets", K.AGENT_NAMESPACE)
    key_secret = ("auth", "can-i", "update", f"secrets/{keys.KEY_SECRET}", "-n", K.AGENT_NAMESPACE, "--as", AGENT_SA)
    assert cluster.kubectl(*key_secret, check=False).stdout.strip() == "yes"  # (the line above asks what it should)


def test_users_get_rights_through_builtin_roles(
    cluster: Cluster, namespace: str, installed: list[dict[str, Any]]
) -> None:
    editor, viewer = f"e2e-editor-{uuid.uuid4().hex[:6]}", f"e2e-viewer-{uuid.uuid4().hex[:6]}"
    cluster.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": f"{role}-binding", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            }
            for role, user in (("edit", editor), ("view", viewer))
        ]
    )
    # aggregation is done by the controller-manager: poll until the built-in roles carry our rules
    cluster.wait_for(
        "edit/view to aggregate the PodSnapshot rules",
        lambda: (
            can_i(cluster, editor, "create", K.PLURAL, namespace)
            and can_i(cluster, viewer, "list", K.PLURAL, namespace)
        ),
        timeout=60,
    )
    assert can_i(cluster, editor, "delete", K.PLURAL, namespace)
    assert not can_i(cluster, editor, "patch", f"{K.PLURAL}/status", namespace)  # only agents write status
    assert not can_i(cluster, viewer, "create", K.PLURAL, namespace)
    assert not can_i(cluster, editor, "create", K.PLURAL, "default")  # namespaced grant only


AGENT_ENV_CHECK = """
import json, os, socket
from kubernetes import client, config
from kubernetes.client.rest import ApiException

config.load_incluster_config()  # KUBERNETES_SERVICE_HOST/PORT from render(api_server=...)
node = os.environ["NODE_NAME"]
api = client.CoreV1Api()
api.read_node(node)
try:
    api.list_namespaced_secret("default")
except ApiException as e:
    print("secrets-list", e.status)
paths = json.load(open("/etc/kubectl-snapshot/nodes/nodes.json"))[node]
s = socket.socket(socket.AF_UNIX)
s.connect(paths["containerd_socket"])
s.close()
assert os.path.isdir(os.path.join(paths["kubelet_root"], "pods")), paths
assert os.environ["KUBECTL_SNAPSHOT_STATE_DIR"] == "/var/lib/kubectl-snapshot/" + node
print("agent-env-ok", node)
"""


@pytest.mark.parametrize("host_network", [True, False], ids=["host-network", "pod-network"])
def test_agent_pod_spec_reaches_api_server_and_containerd(
    cluster: Cluster, agent_image: str, installed: list[dict[str, Any]], host_network: bool
) -> None:
    """The DaemonSet's pod spec (API server override, mounts, node config, service account) on each
    node, with a probe script instead of `run`: in-cluster config, the agent's RBAC, its node's
    containerd socket and kubelet root through the per-node ConfigMap. Also without hostNetwork (the
    default) and without the override: the kubernetes Service; only this cluster's loopback registry
    needs the host network."""
    [cm] = [o for o in installed if o["kind"] == "ConfigMap"]
    [ds] = [o for o in installed if o["kind"] == "DaemonSet"]
    if not host_network:
        per_node = json.loads(cm["data"]["nodes.json"])
        [ds] = [o for o in render("unused", per_node_paths=per_node) if o["kind"] == "DaemonSet"]
        assert not ds["spec"]["template"]["spec"]["hostNetwork"]
    cluster.apply(cm)
    suffix = uuid.uuid4().hex[:6] + ("" if host_network else "-podnet")
    pods = []
    for node in cluster.nodes:
        spec = json.loads(json.dumps(ds["spec"]["template"]["spec"]))
        spec.pop("initContainers")
        [container] = [c for c in spec["containers"] if c["name"] == "agent"]  # not the freeze guard beside it
        spec["containers"] = [container]
        container.pop("readinessProbe")
        container.pop("args")
        # the probe listens on nothing; on the host network a declared port is a host port, which an
        # installed agent (`make demo`'s, left running) holds on every node: the probe would not schedule
        assert container.pop("ports")
        container.update(image=agent_image, imagePullPolicy="IfNotPresent", command=["python3", "-c", AGENT_ENV_CHECK])
        spec.update(
            restartPolicy="Never", nodeSelector={"kubernetes.io/hostname": node}, terminationGracePeriodSeconds=1
        )
        meta = {"name": f"agent-env-{node}-{suffix}", "namespace": K.AGENT_NAMESPACE}
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    cluster.apply(pods)
    try:
        for p in pods:
            name, node = p["metadata"]["name"], p["spec"]["nodeSelector"]["kubernetes.io/hostname"]
            pod = wait_done(cluster, K.AGENT_NAMESPACE, name)
            logs = cluster.kubectl("logs", name, "-n", K.AGENT_NAMESPACE, check=False).stdout
            assert pod["status"]["phase"] == "Succeeded", logs
            assert f"agent-env-ok {node}" in logs and "secrets-list 403" in logs, logs
    finally:
        for p in pods:
            cluster.kubectl(
                "delete", "pod", p["metadata"]["name"], "-n", K.AGENT_NAMESPACE, "--wait=false", check=False
            )
