"""What operators rely on, on the real cluster: PodSnapshot conditions that `kubectl wait` understands,
Events on the PodSnapshot itself, a size people can read, and agents whose cost does not grow with
the PodSnapshots of other nodes (bench/agent_scale.py is the same measurement at larger counts)."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from bench.agent_scale import cleanup, measure
from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.core import kubenames as K
from shim.service.metrics_auth import DEFAULT_AUDIENCES
from tests.e2e.test_snapshot_flows import COUNTER, _final, _psnap, counter_value, pod, running
from tests.support.agent import METRICS_PORT, agent, plugin
from tests.support.cluster import cluster, namespace
from tests.support.registry import free_port

pytestmark = pytest.mark.e2e


def _events(cluster, ns: str, name: str) -> list[str]:  # type: ignore[no-untyped-def]
    sel = f"involvedObject.kind=PodSnapshot,involvedObject.name={name}"
    items = cluster.get_json("events", "-n", ns, "--field-selector", sel)["items"]
    return [e["reason"] for e in items]


def test_conditions_events_and_size_of_a_podsnapshot(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    cluster.apply(pod("ops", namespace, cluster.busybox_image, {"counter": COUNTER}, node=cluster.nodes[0]))
    running(cluster, namespace, "ops")
    cluster.wait_for("the counter", lambda: counter_value(cluster, namespace, "ops", "counter")[1] >= 3)
    out = plugin("snapshot", "pod/ops", "-n", namespace, "--to", f"{cluster.registry}/e2e/ops", "-o", "json")
    name = json.loads(out.stdout)["metadata"]["name"]
    # kubectl's own wait understands the conditions
    cluster.kubectl("wait", "--for=condition=Succeeded", f"podsnapshot/{name}", "-n", namespace, "--timeout=30s")
    obj = cluster.get_json("podsnapshot", name, "-n", namespace)
    conds = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conds["Succeeded"]["status"] == "True" and conds["Failed"]["status"] == "False"
    assert conds["Succeeded"]["observedGeneration"] == obj["metadata"]["generation"]
    assert conds["Succeeded"]["reason"] == "Pushed" and conds["Succeeded"]["lastTransitionTime"]
    # a size people read, in the default columns
    table = cluster.kubectl("get", "podsnapshots", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:4] == ["NAME", "POD", "PHASE", "NODE"] and "SIZE" in header
    assert obj["status"]["sizeHuman"] in row and obj["status"]["sizeHuman"].endswith("iB")
    # Events on the PodSnapshot itself (kubectl describe podsnapshot shows them)
    assert {"SnapshotStarted", "SnapshotSucceeded"} <= set(_events(cluster, namespace, name))

    # a failure: reason, message and hint as separate fields, and the Failed condition for kubectl wait
    cluster.apply(_psnap(namespace, "nowhere", "ops", "127.0.0.1:1/e2e/nowhere:v1"))
    failed = _final(cluster, namespace, "nowhere")
    cluster.kubectl("wait", "--for=condition=Failed", "podsnapshot/nowhere", "-n", namespace, "--timeout=30s")
    st = failed["status"]
    assert st["phase"] == "Failed" and st["reason"] and st["hint"]
    assert not st["message"].startswith("error:") and "hint:" not in st["message"]
    assert "SnapshotFailed" in _events(cluster, namespace, "nowhere")


def test_agent_cost_does_not_grow_with_podsnapshots_of_other_nodes(cluster, agent):  # type: ignore[no-untyped-def]
    kube = KubeClient.from_config(str(cluster.kubeconfig))
    try:
        few = measure(cluster, kube, 10, window_s=70)
        many = measure(cluster, kube, 1000, window_s=70)
    finally:
        cleanup(cluster)
    logs = cluster.kubectl(
        "logs", "-n", K.AGENT_NAMESPACE, "-l", "app.kubernetes.io/name=kubectl-snapshot-agent", "-c", "agent",
        "--tail=40", "--prefix", check=False,
    ).stdout  # fmt: skip
    report = f"10: {few}\n1000: {many}\nagent logs:\n{logs}"
    # Start-up lists only this node's objects: the bytes do not follow the 990 others (~1 KiB each).
    assert many.startup_list_bytes < few.startup_list_bytes + 50_000, report
    # Requests: a per-object look would add ~990; the restart window also holds the old agents' last
    # requests and the new ones' start-up, which vary by a few from run to run.
    assert many.startup_requests <= few.startup_requests + 10, report
    # Steady state: the same few requests a minute (watches re-opened from their resourceVersion, the
    # node facts), whatever the number of objects elsewhere; a re-list of 1000 objects would show.
    assert 0 < many.steady_requests_per_min <= few.steady_requests_per_min + 4, report
    assert many.rss_mib < few.rss_mib + 15, report


def _scrape(port: int, token: str | None) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the agent's certificate is self-signed
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=20) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_metrics_only_for_scrapers_the_api_server_authorises(cluster, namespace, agent):  # type: ignore[no-untyped-def]
    for sa in ("scraper", "nosy"):
        cluster.kubectl("create", "serviceaccount", sa, "-n", namespace)
    binding = f"e2e-metrics-{namespace}"
    cluster.kubectl(
        "create", "clusterrolebinding", binding, "--clusterrole=kubectl-snapshot-metrics-reader",
        f"--serviceaccount={namespace}:scraper",
    )  # fmt: skip
    forward: subprocess.Popen[str] | None = None
    try:
        audience = ("--audience", DEFAULT_AUDIENCES[0])  # what the agent's TokenReviews ask for
        good = cluster.kubectl("create", "token", "scraper", "-n", namespace, *audience).stdout.strip()
        bad = cluster.kubectl("create", "token", "nosy", "-n", namespace, *audience).stdout.strip()
        # the same authorised identity's ordinary API token: refused by the API server for that audience
        api_token = cluster.kubectl("create", "token", "scraper", "-n", namespace).stdout.strip()
        agent_pod = agent.agent_pod(cluster.nodes[0])
        assert agent_pod is not None
        port = free_port()
        forward = subprocess.Popen(
            [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "port-forward", "-n",
             K.AGENT_NAMESPACE, f"pod/{agent_pod['metadata']['name']}", f"{port}:{METRICS_PORT}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert forward.stdout is not None
        assert "Forwarding from" in forward.stdout.readline()
        assert _scrape(port, None)[0] == 401
        assert _scrape(port, bad)[0] == 403
        assert _scrape(port, api_token)[0] == 401
        code, text = _scrape(port, good)
        assert code == 200, code
        for name in (
            "kubectl_snapshot_saves_total",
            "kubectl_snapshot_freeze_seconds",
            "kubectl_snapshot_queue_length",
        ):
            assert name in text, name
    finally:
        if forward is not None:
            forward.terminate()
            forward.wait(10)
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)
