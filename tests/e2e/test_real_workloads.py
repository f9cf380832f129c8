"""The pods users run, restored on the other node (issue 41): the security settings clusters default to
and a Debian-built image, each the legitimate case the image check must let through. The edited
counterparts, refused for their reason, live beside the rules' unit and integration tests
(tests/unit/test_criu_guard.py, tests/integration/test_criu_guard_seccomp.py) and in
tests/e2e/test_tenant_node.py (a RuntimeDefault pod's images given every capability)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.test_snapshot_flows import COUNTER, counter_value, pod, read, running
from tests.e2e.test_whole_pod import _push_python_image
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]

RUNTIME_DEFAULT = {"seccompProfile": {"type": "RuntimeDefault"}}
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"

# A Python service as users write one: state in memory, a counter in an emptyDir scratch volume (the root
# filesystem is read-only), its pid and a token that only its own memory holds.
PY_SERVICE = """
import os, time
tok = os.urandom(8).hex()
n = 0
while True:
    n += 1
    with open('/scratch/count.t', 'w') as f:
        f.write(f'{tok} {n} {os.getpid()}')
    os.rename('/scratch/count.t', '/scratch/count')
    time.sleep(0.2)
"""


def _snapshot_delete_restore(cluster: Cluster, plugin: Any, ns: str, name: str, to: str) -> dict[str, Any]:
    """Snapshot `name`, delete it, restore it on the second node as NAME-2; the restored pod, Running."""
    out = plugin("snapshot", f"pod/{name}", "-n", ns, "--to", f"{cluster.registry}/e2e/{to}", "-o", "json")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=true")
    proc = plugin(
        "restore", psnap["metadata"]["name"], "-n", ns, "--name", f"{name}-2", "--node", cluster.nodes[1], check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a refusal names its reason here
    restored = running(cluster, ns, f"{name}-2")
    assert restored["spec"]["nodeName"] == cluster.nodes[1]
    return restored


@pytest.mark.parametrize("level", ["pod", "container"])
def test_a_runtime_default_seccomp_pod_restores_on_the_other_node(cluster, namespace, agent, plugin, level):  # type: ignore[no-untyped-def]
    """Issue 41, pod 1: the process has one seccomp filter, which CRIU writes at index 0."""
    manifest = pod(f"sec-{level}", namespace, cluster.busybox_image, {"counter": COUNTER}, node=cluster.nodes[0])
    if level == "pod":
        manifest["spec"]["securityContext"] = RUNTIME_DEFAULT
    else:
        manifest["spec"]["containers"][0]["securityContext"] = dict(RUNTIME_DEFAULT)
    cluster.apply(manifest)
    running(cluster, namespace, f"sec-{level}")
    cluster.wait_for("the counter", lambda: counter_value(cluster, namespace, f"sec-{level}")[1] >= 5)
    status = read(cluster, namespace, f"sec-{level}", "counter", "/proc/1/status")
    assert "Seccomp:\t2" in status and "Seccomp_filters:\t1" in status, status
    tok, before = counter_value(cluster, namespace, f"sec-{level}")

    _snapshot_delete_restore(cluster, plugin, namespace, f"sec-{level}", f"sec-{level}")
    tok2, after = counter_value(cluster, namespace, f"sec-{level}-2")
    assert tok2 == tok and after >= before  # the same process, not a fresh start
    status = read(cluster, namespace, f"sec-{level}-2", "counter", "/proc/1/status")
    assert "Seccomp:\t2" in status, status  # and still confined


def test_a_debian_pod_with_the_token_and_restricted_settings_restores(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    """Issue 41, pod 2, with what Pod Security "restricted" asks for (runAsNonRoot aside: these machines
    cannot dump a non-root process, ../shared/docs/PLATFORM.md): a Debian bookworm image (/var/run is a
    link to /run, so the token is mounted at /run/secrets/... in the kernel's table), the default
    service-account token, RuntimeDefault seccomp, every capability dropped but NET_BIND_SERVICE, no
    privilege escalation, a read-only root filesystem with an emptyDir for scratch."""
    image = _push_python_image(cluster)
    manifest = pod("deb", namespace, image, {"app": PY_SERVICE}, node=cluster.nodes[0])
    c = manifest["spec"]["containers"][0]
    c["command"] = ["python3", "-c", PY_SERVICE]
    c["securityContext"] = {
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
    }
    c["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
    manifest["spec"]["securityContext"] = RUNTIME_DEFAULT
    manifest["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    cluster.apply(manifest)
    running(cluster, namespace, "deb", timeout=300)

    def count(name: str) -> tuple[str, int, int]:
        tok, n, pid = read(cluster, namespace, name, "app", "/scratch/count").split()
        return tok, int(n), int(pid)

    cluster.wait_for("the service's counter", lambda: count("deb")[1] >= 5)
    assert read(cluster, namespace, "deb", "app", TOKEN)  # the token is there, through /var/run -> /run
    mounts = read(cluster, namespace, "deb", "app", "/proc/self/mountinfo")
    assert " /run/secrets/kubernetes.io/serviceaccount " in mounts, mounts
    tok, before, pid = count("deb")

    _snapshot_delete_restore(cluster, plugin, namespace, "deb", "deb")
    tok2, after, pid2 = count("deb-2")
    assert (tok2, pid2) == (tok, pid) and after >= before  # its own memory and pid, carried on
    cluster.wait_for("the service to go on", lambda: count("deb-2")[1] > after)
    assert read(cluster, namespace, "deb-2", "app", TOKEN)  # the new pod's token, where the spec mounts it


def _drop_all_policy(name: str, namespace: str) -> list[dict[str, Any]]:
    """A MutatingAdmissionPolicy as a cluster admin tightens a namespace with: the (first, here the only)
    app container drops every capability (the restore pod's gate init container is left as it is)."""
    sc = "Object.spec.containers.securityContext"
    expression = (
        f'[JSONPatch{{op: "add", path: "/spec/containers/0/securityContext", '
        f'value: {sc}{{capabilities: {sc}.capabilities{{drop: ["ALL"]}}}}}}]'
    )
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
                ]
            },
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": expression}}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}},
        },
    }
    return [policy, binding]


def test_a_restore_the_pod_cannot_take_is_refused_at_staging_and_by_dry_run(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    """Issue 41, item 7. A namespace tightened after the save (admission drops every capability of its
    pods): `kubectl snapshot restore --dry-run=server` names what the pod would lack, and a restore is
    refused by the agent while staging, with the reason in the pod's restore-status and a RestoreRefused
    Event, before any container is created (no create error from the runtime). The legitimate twin: the
    same snapshot, the namespace as it was, passes the dry run and restores on the other node."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.runtimegrant import DEFAULT_CAPABILITIES
    from shim.criu.guard import CAPABILITIES

    n1, n2 = cluster.nodes[:2]
    cluster.apply(pod("wide", namespace, cluster.busybox_image, {"counter": COUNTER}, node=n1))
    running(cluster, namespace, "wide")
    tok, before = counter_value(cluster, namespace, "wide")  # read before the save: the save holds at least this
    out = plugin("snapshot", "pod/wide", "-n", namespace, "--to", f"{cluster.registry}/e2e/wide", "-o", "json")
    snap = json.loads(out.stdout)["metadata"]["name"]
    # the bound's default capabilities are what this node's containerd really gives a default pod
    status = cluster.kubectl("exec", "-n", namespace, "wide", "--", "cat", "/proc/1/status").stdout
    bnd = int(next(x for x in status.splitlines() if x.startswith("CapBnd:")).split()[1], 16)
    assert {c for i, c in enumerate(CAPABILITIES) if bnd >> i & 1} == DEFAULT_CAPABILITIES, status
    cluster.kubectl("delete", "pod", "wide", "-n", namespace, "--wait=true")

    legit = plugin(
        "restore", snap, "-n", namespace, "--name", "wide-dry", "--node", n2, "--dry-run=server", check=False
    )
    assert legit.returncode == 0, legit.stdout + legit.stderr
    assert "kind: Pod" in legit.stdout and "name: wide-dry" in legit.stdout, legit.stdout

    policy_name = f"ks-e2e-drop-all-{namespace}"[:63]
    objects = _drop_all_policy(policy_name, namespace)
    try:
        for obj in objects:
            cluster.apply(obj)

        def tightened() -> bool:  # the policy is in force once a dry-run pod comes back mutated
            proc = plugin(
                "restore", snap, "-n", namespace, "--name", "wide-dry", "--node", n2, "--dry-run=server", check=False
            )
            return bool(proc.returncode != 0)

        cluster.wait_for("the admission policy to take effect", tightened, 60)
        proc = plugin(
            "restore", snap, "-n", namespace, "--name", "wide-dry", "--node", n2, "--dry-run=server", check=False
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "the restore would be refused" in proc.stderr, proc.stderr
        assert "capabilities" in proc.stderr and "CAP_CHOWN" in proc.stderr, proc.stderr
        assert "kind: Pod" not in proc.stdout
        # a dry run stores nothing
        assert cluster.kubectl("get", "pod", "wide-dry", "-n", namespace, check=False).returncode != 0

        proc = plugin("restore", snap, "-n", namespace, "--name", "wide-tight", "--node", n2, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "grant more than the container's spec" in proc.stderr and "capabilities" in proc.stderr, proc.stderr
        obj = cluster.get_json("pod", "wide-tight", "-n", namespace)
        status = obj["metadata"]["annotations"][K.ANN_RESTORE_STATUS]
        assert status.startswith(K.RESTORE_FAILED_PREFIX) and "refusing to restore" in status, status
        events = cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=wide-tight", "-o", "json"
        ).stdout
        reasons = {e["reason"]: e["message"] for e in json.loads(events)["items"]}
        assert K.EVENT_RESTORE_REFUSED in reasons, reasons
        assert "grant more than the container's spec" in reasons[K.EVENT_RESTORE_REFUSED], reasons
        # refused while staging: the app container was never created, so the runtime never refused it
        assert not any("CreateContainer" in m or "failed to create" in m for m in reasons.values()), reasons
        statuses = obj["status"].get("containerStatuses") or []
        assert not any("running" in (s.get("state") or {}) for s in statuses), statuses
    finally:
        for obj in reversed(objects):
            cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found", check=False)

    cluster.wait_for(
        "the admission policy to be gone",
        lambda: (
            plugin(
                "restore", snap, "-n", namespace, "--name", "wide-dry", "--node", n2, "--dry-run=server", check=False
            ).returncode
            == 0
        ),
        60,
    )
    proc = plugin("restore", snap, "-n", namespace, "--name", "wide-2", "--node", n2, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert running(cluster, namespace, "wide-2")["spec"]["nodeName"] == n2
    tok2, after = counter_value(cluster, namespace, "wide-2")
    assert tok2 == tok and after >= before  # the same process, carried on
