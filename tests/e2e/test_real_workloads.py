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
