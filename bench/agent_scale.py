#!/usr/bin/env python3
"""What the node agents cost the API server as PodSnapshots of other nodes pile up.

    sudo .venv/bin/python bench/agent_scale.py [--counts 10,2000] [--window 75]

On the local cluster (hack/cluster-up) with the agent installed (kubectl snapshot install, or an e2e
session's install), for each count N: makes exactly N finished PodSnapshots of pods on other nodes
(status.node is a node that is not in the cluster) across 10 namespaces, restarts the agents, and
measures from the API server's own metrics (apiserver_request_total, apiserver_response_sizes):

- start-up: the requests the agents made to become ready, and the bytes their PodSnapshot lists
  returned;
- steady state: the agents' requests per minute over --window seconds (longer than the agent's watch
  timeout, so that every watch is re-opened at least once). The agents' requests are told apart from
  everyone else's (kube-controller-manager lists PodSnapshots too) by a FlowSchema of their own that
  this script adds for the measurement: API Priority and Fairness counts each flow's requests;
- memory: the resident size of the agents' `run` processes (read from /proc) once they are ready.

An agent whose cost does not grow with the cluster shows the same figures for every N. The objects and
namespaces it made are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import NotFound
from shim.controller.restores import POD_FILE
from tests.support.cluster import STATE_DIR, Cluster, _load

SCALE_LABEL = "kubectl-snapshot.io/scale-test"
NAMESPACES = [f"ks-scale-{i}" for i in range(10)]
ELSEWHERE = "ks-elsewhere"  # a node name no agent has
_METRIC = re.compile(
    r"^(apiserver_flowcontrol_dispatched_requests_total|apiserver_response_sizes_sum)\{([^}]*)\} ([0-9.e+]+)$"
)


FLOW = "kubectl-snapshot-agent-measured"


@dataclass(frozen=True)
class Cost:
    count: int
    startup_requests: float
    startup_list_bytes: float
    steady_requests_per_min: float
    rss_mib: float


def flow_schema() -> dict[str, Any]:
    """Every request of the agents' service account, in a flow of its own (same priority level)."""
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW, "labels": {SCALE_LABEL: "1"}},
        "spec": {
            "matchingPrecedence": 500,
            "priorityLevelConfiguration": {"name": "workload-low"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "serviceAccount": {"name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE},
                        }
                    ],
                    "resourceRules": [
                        {
                            "verbs": ["*"],
                            "apiGroups": ["*"],
                            "resources": ["*"],
                            "clusterScope": True,
                            "namespaces": ["*"],
                        }
                    ],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }


def agent_metrics(cluster: Cluster) -> dict[str, float]:
    """The agents' requests (their FlowSchema's dispatched requests) and the bytes of cluster-scope
    PodSnapshot lists (what an agent reads at start-up) from the API server's /metrics."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    out = {"requests": 0.0, "list_bytes": 0.0}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        value = float(m.group(3))
        if m.group(1) == "apiserver_flowcontrol_dispatched_requests_total":
            if labels.get("flow_schema") == FLOW:
                out["requests"] += value
        elif (
            labels.get("resource") == K.PLURAL
            and labels.get("scope") == "cluster"
            and not labels.get("subresource")
            and labels.get("verb") == "LIST"
        ):
            out["list_bytes"] += value
    return out


def agent_rss_mib() -> float:
    """Resident memory of every `kubectl-snapshot-agent run` process on this machine (all nodes)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(b"-agent") or a.endswith(b"agent_cli.py") for a in argv) or b"run" not in argv:
                continue
            status = (proc / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(m.group(1)) if m else 0
    return total / 1024


def populate(kube: KubeClient, cluster: Cluster, count: int) -> None:
    """Exactly `count` finished PodSnapshots of pods on a node that is not this cluster's."""
    for ns in NAMESPACES:
        if cluster.kubectl("get", "namespace", ns, check=False).returncode != 0:
            cluster.kubectl("create", "namespace", ns)
            cluster.kubectl("label", "namespace", ns, f"{SCALE_LABEL}=1")
    have = sum(len(kube.list_snapshots(ns)) for ns in NAMESPACES)

    def make(i: int) -> None:
        ns, name = NAMESPACES[i % len(NAMESPACES)], f"elsewhere-{i}"
        body = {
            "apiVersion": K.API_VERSION,
            "kind": K.KIND,
            "metadata": {"name": name, "namespace": ns, "labels": {SCALE_LABEL: "1"}},
            "spec": {"podName": f"pod-{i}", "destination": f"127.0.0.1:1/scale/{i}"},
        }
        kube.create_snapshot(ns, body)
        finished(kube, ns, name)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(make, range(have, count)))
    # An agent may have claimed one between its creation and our status write: write it again.
    for ns in NAMESPACES:
        for obj in kube.list_snapshots(ns):
            if (obj.get("status") or {}).get("node") != ELSEWHERE:
                finished(kube, ns, obj["metadata"]["name"])


def finished(kube: KubeClient, ns: str, name: str) -> None:
    status = {"phase": K.PHASE_SUCCEEDED, "node": ELSEWHERE, "stage": "done", "size": 1 << 20}
    kube.patch_snapshot_status(ns, name, status)


def restart_agents(cluster: Cluster, timeout: float = 180) -> None:
    selector = ",".join(f"{k}={v}" for k, v in K.AGENT_LABEL.items())
    before = {p["metadata"]["uid"] for p in agent_pods(cluster, selector)}
    cluster.kubectl("delete", "pod", "-n", K.AGENT_NAMESPACE, "-l", selector, "--wait=true", timeout=timeout)

    def ready() -> bool:
        pods = [p for p in agent_pods(cluster, selector) if p["metadata"]["uid"] not in before]
        return len(pods) >= len(cluster.nodes) and all(
            all(c.get("ready") for c in (p.get("status") or {}).get("containerStatuses") or [{}]) for p in pods
        )

    cluster.wait_for("the agents to be ready again", ready, timeout)


def agent_pods(cluster: Cluster, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", K.AGENT_NAMESPACE, "-l", selector, "-o", "json").stdout
    return list(json.loads(out)["items"])


def settled(cluster: Cluster, quiet_s: float = 5.0, timeout_s: float = 300.0) -> dict[str, float]:
    """The metrics once the agents are done with the objects just made (each one they saw before it was
    marked finished costs them a look at its pod): no agent request for `quiet_s`."""
    last = agent_metrics(cluster)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = agent_metrics(cluster)
        if now["requests"] == last["requests"]:
            return now
        last = now
    return last


def remove_leftovers(cluster: Cluster, kube: KubeClient) -> list[str]:
    """Staged data of restored pods that are gone, left by earlier restores on the nodes: what the agents'
    garbage collection removes once it is 10 minutes old, one GET each (shim/controller/restores.py).
    Removed here, with the GETs made by this process, so that no measured window pays for a collection
    that depends on how long ago earlier tests ran."""
    removed = []
    for node in cluster.nodes:
        for kind in ("by-pod", "pod-gates"):
            parent = Path(C.DEFAULT_STATE_DIR) / node / C.STAGING_SUBDIR / kind  # the agents' hostPath
            for d in sorted(parent.glob("*")) if parent.is_dir() else []:
                try:
                    owner = json.loads((d / POD_FILE).read_text())
                    pod = kube.get_pod(str(owner["namespace"]), str(owner["name"]))
                except NotFound:
                    pod = None
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # not the agents' staging: left alone
                if pod is None or (pod.get("metadata") or {}).get("uid") != d.name:
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(str(d))
    return removed


def measure(cluster: Cluster, kube: KubeClient, count: int, window_s: float) -> Cost:
    remove_leftovers(cluster, kube)
    populate(kube, cluster, count)
    cluster.apply(flow_schema())
    m0 = settled(cluster)
    restart_agents(cluster)
    time.sleep(3)
    m1 = agent_metrics(cluster)
    rss = agent_rss_mib()
    time.sleep(window_s)
    m2 = agent_metrics(cluster)
    per_min = 60.0 / window_s
    return Cost(
        count=count,
        startup_requests=m1["requests"] - m0["requests"],
        startup_list_bytes=m1["list_bytes"] - m0["list_bytes"],
        steady_requests_per_min=(m2["requests"] - m1["requests"]) * per_min,
        rss_mib=rss,
    )


def cleanup(cluster: Cluster) -> None:
    cluster.kubectl("delete", "flowschema", FLOW, "--ignore-not-found", check=False)
    for ns in NAMESPACES:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def table(costs: list[Cost]) -> str:
    rows = [
        "| PodSnapshots elsewhere | agents' start-up requests | start-up list bytes | agents' requests/min "
        "| agents' RSS |",
        "|---|---|---|---|---|",
    ]
    for c in costs:
        rows.append(
            f"| {c.count} | {c.startup_requests:.0f} | {c.startup_list_bytes:.0f} | {c.steady_requests_per_min:.1f} "
            f"| {c.rss_mib:.1f} MiB |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="10,2000", help="comma-separated numbers of PodSnapshots elsewhere")
    ap.add_argument("--window", type=float, default=75.0, help="steady-state window in seconds")
    a = ap.parse_args()
    cluster = _load(STATE_DIR / "cluster.env")
    kube = KubeClient.from_config(str(cluster.kubeconfig))
    try:
        costs = [measure(cluster, kube, int(n), a.window) for n in a.counts.split(",")]
    finally:
        cleanup(cluster)
    print(table(costs))


if __name__ == "__main__":
    if subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() != "0":
        sys.exit("error: needs root (reads the agents' /proc entries)\nhint: sudo " + " ".join(sys.argv))
    main()
