#!/usr/bin/env python3
"""Autosave at density: N protected pods on one node under one SnapshotPolicy, saved every interval (issue 43).

    flock /run/ks-e2e.lock .venv/bin/python -m bench.density [--pods 50] [--minutes 10] [--interval 60]
        [--mib 4] [--big 0 --big-mib 128] [--slack 0.1] [-o json] [--out FILE] [--installed]

(or without flock: it then takes /run/ks-e2e.lock itself). On the local cluster (brought up if it is not
running, and taken down again afterwards), with the agent built from this tree installed for the run
(`--installed`: the agent the cluster has, as it is; a `make demo` install is put back either way):

- one StatefulSet of --pods pods on ks-n1 (a nodeSelector: the run fails if they do not fit), each a
  shell holding --mib MiB of incompressible memory and counting in memory; the first --big of them hold
  --big-mib MiB instead (bigger pods must not starve small ones); one SnapshotPolicy (--interval, at its
  default retention: keep the last 3) protects them all;
- once every pod has a Succeeded save, the span begins; for --minutes the script lists the namespace's
  PodSnapshots every 5 s (retention deletes old ones: each is recorded as it is seen) and samples the
  agent container's cgroup on the host every --sample-s seconds (CPU time; memory usage and stat);
- then it judges each pod's saves (bench/density_report.py says what "on time" means, precisely) and
  reads the agent container's declared requests and limits from the live DaemonSet.

Printed: the share of gaps between a pod's saves that were on time, the worst gap / interval (small and
big pods apart), starved pods, failed saves, a save's queue wait / interval, and the agent's CPU (mean and
p95 cores) and memory (largest working set, the kernel's peak) as ratios to its request and limit. With
`-o json` the whole result as JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import density_report as R
from bench.evacuate import local_cluster
from bench.recovery import e2e_lock
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from tests.support.agent import installed_agent
from tests.support.cluster import RUN_DIR, Cluster
from tests.support.node_loss import protect

APP = "dense"
LIST_S = 5.0  # how often the PodSnapshots are listed
CGROUP = Path("/sys/fs/cgroup")

# Holds FILL bytes (base64 of random: 3/4 of it entropy) and counts in memory, once a second. The first
# BIG ordinals of the StatefulSet hold BIGFILL instead.
WORKLOAD = (
    'n=${{HOSTNAME##*-}}; if [ "$n" -lt {big} ]; then f={bigfill}; else f={fill}; fi; '
    "hold=$(head -c $f /dev/urandom | base64 -w0); tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 1; done'
)


def statefulset(ns: str, image: str, node: str, *, pods: int, mib: float, big: int, big_mib: float) -> dict[str, Any]:
    cmd = WORKLOAD.format(big=big, bigfill=int(big_mib * 2**20) * 3 // 4, fill=int(mib * 2**20) * 3 // 4)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": APP, "namespace": ns},
        "spec": {
            "replicas": pods,
            "serviceName": APP,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": APP}},
            "template": {
                "metadata": {"labels": {"app": APP}},
                "spec": {
                    "containers": [{"name": "counter", "image": image, "command": ["sh", "-c", cmd]}],
                    "terminationGracePeriodSeconds": 1,
                    "nodeSelector": {"kubernetes.io/hostname": node},
                },
            },
        },
    }


def agent_pod(cluster: Cluster, node: str) -> dict[str, Any]:
    pods = cluster.get_json(
        "pods", "-n", K.AGENT_NAMESPACE, "-l", "app.kubernetes.io/name=" + K.AGENT_NAME,
        "--field-selector", f"spec.nodeName={node}",
    )["items"]  # fmt: skip
    if not pods:
        sys.exit(f"error: no agent pod on {node}")
    return dict(pods[0])


def declared_resources(cluster: Cluster) -> dict[str, Any]:
    """The agent container's requests and limits, from the live DaemonSet."""
    ds = cluster.get_json("daemonset", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE)
    containers = ds["spec"]["template"]["spec"]["containers"]
    c = next((c for c in containers if c["name"] == "agent"), containers[0])
    return dict(c.get("resources") or {})


def container_cgroups(pod: dict[str, Any], node: str, container: str = "agent") -> tuple[Path, Path, int]:
    """(CPU accounting dir, memory dir, cgroup version) of a pod's container on this host: cgroup v1
    (cpuacct, memory) or v2 (one dir), the cgroupfs or systemd driver, under the node's kubelet cgroup
    root (the local cluster's nodes share this machine: /sys/fs/cgroup/<controller>/<node>/kubepods/...)."""
    uid = pod["metadata"]["uid"]
    status = next(c for c in pod["status"]["containerStatuses"] if c["name"] == container)
    cid = str(status["containerID"]).split("://", 1)[-1]
    v2 = (CGROUP / "cgroup.controllers").exists()
    roots = [CGROUP] if v2 else [CGROUP / "cpuacct", CGROUP / "cpu,cpuacct"]
    names = (f"pod{uid}", f"*pod{uid.replace('-', '_')}.slice")
    for root in roots:
        for top in (root / node, root):
            for pattern in names:
                for qos in ("kubepods", "kubepods/*", "kubepods.slice", "kubepods.slice/*"):
                    for pdir in top.glob(f"{qos}/{pattern}"):
                        cdir = next((d for d in pdir.iterdir() if d.is_dir() and cid in d.name), None)
                        if cdir is None:
                            continue
                        mem = cdir if v2 else CGROUP / "memory" / cdir.relative_to(root)
                        return cdir, mem, 2 if v2 else 1
    sys.exit(f"error: no cgroup of container {cid[:12]} of pod {uid} under {CGROUP}")


def read_cpu_s(cdir: Path, version: int) -> float:
    if version == 2:
        return R.parse_flat_keyed((cdir / "cpu.stat").read_text())["usage_usec"] / 1e6
    return int((cdir / "cpuacct.usage").read_text()) / 1e9


def read_memory(mdir: Path, version: int) -> int:
    usage = int((mdir / ("memory.current" if version == 2 else "memory.usage_in_bytes")).read_text())
    return R.working_set(usage, R.parse_flat_keyed((mdir / "memory.stat").read_text()))


def kernel_peak(mdir: Path, version: int) -> int | None:
    f = mdir / ("memory.peak" if version == 2 else "memory.max_usage_in_bytes")
    return int(f.read_text()) if f.exists() else None


def watch(cluster: Cluster, ns: str, seen: dict[str, dict[str, Any]]) -> None:
    """Record every PodSnapshot of the namespace as last seen (retention deletes the old ones)."""
    got = cluster.kubectl("get", K.PLURAL, "-n", ns, "-o", "json", check=False, timeout=60)
    if got.returncode != 0:
        return
    for s in json.loads(got.stdout)["items"]:
        seen[s["metadata"]["name"]] = s


@contextlib.contextmanager
def namespace(cluster: Cluster) -> Iterator[str]:
    ns = f"bench-density-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def one(cluster: Cluster, a: argparse.Namespace) -> dict[str, Any]:
    node = cluster.nodes[0]
    with namespace(cluster) as ns:
        cluster.apply(
            statefulset(ns, cluster.busybox_image, node, pods=a.pods, mib=a.mib, big=a.big, big_mib=a.big_mib)
        )
        names = [f"{APP}-{i}" for i in range(a.pods)]

        def all_running() -> bool:
            pods = cluster.get_json("pods", "-n", ns, "-l", f"app={APP}")["items"]
            up = [
                p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
            ]
            return len(up) == int(a.pods)

        cluster.wait_for(f"{a.pods} pods running on {node}", all_running, 300 + 3 * a.pods)
        protect(cluster, ns, APP, a.interval)
        agent = agent_pod(cluster, node)
        cdir, mdir, version = container_cgroups(agent, node)
        seen: dict[str, dict[str, Any]] = {}

        def good_pods() -> set[str]:
            return {
                str((s["metadata"].get("labels") or {}).get(K.LABEL_POD_UID))
                for s in seen.values()
                if (s.get("status") or {}).get("phase") == K.PHASE_SUCCEEDED
            }

        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.get_json("pods", "-n", ns)["items"]}

        def warm() -> bool:
            watch(cluster, ns, seen)
            return set(uids.values()) <= good_pods()

        cluster.wait_for("every pod's first save", warm, a.interval + 60 + 10 * a.pods)
        start = time.time()
        end = start + a.minutes * 60
        cpu: list[tuple[float, float]] = [(time.time(), read_cpu_s(cdir, version))]
        mem: list[int] = [read_memory(mdir, version)]
        next_list = next_sample = start
        while time.time() < end:
            now = time.time()
            if now >= next_sample:
                with contextlib.suppress(OSError):  # the agent restarted: its cgroup is gone
                    cpu.append((time.time(), read_cpu_s(cdir, version)))
                    mem.append(read_memory(mdir, version))
                next_sample += a.sample_s
            if now >= next_list:
                watch(cluster, ns, seen)
                next_list += LIST_S
            time.sleep(max(0.05, min(next_sample, next_list) - time.time()))
        watch(cluster, ns, seen)
        end = time.time()
        peak = kernel_peak(mdir, version)
        agent_after = agent_pod(cluster, node)
        restarts = sum(int(c.get("restartCount") or 0) for c in agent_after["status"].get("containerStatuses") or [])
        resources = declared_resources(cluster)
        pods_now = {p["metadata"]["name"]: p for p in cluster.get_json("pods", "-n", ns)["items"]}

    by_uid: dict[str, list[float]] = {u: [] for u in uids.values()}
    good: list[dict[str, float | None]] = []
    failed, messages = 0, dict[str, int]()
    for s in seen.values():
        st = s.get("status") or {}
        uid = str((s["metadata"].get("labels") or {}).get(K.LABEL_POD_UID))
        if st.get("phase") == K.PHASE_FAILED:
            failed += 1
            msg = str(st.get("message") or "")[:200]
            messages[msg] = messages.get(msg, 0) + 1
        if st.get("phase") != K.PHASE_SUCCEEDED or uid not in by_uid:
            continue
        done = T.seconds(st.get("completionTime"))
        if done is None:
            continue
        by_uid[uid].append(done)
        if start <= done <= end:
            good.append(
                {
                    "created": T.seconds(s["metadata"]["creationTimestamp"]),
                    "started": T.seconds(st.get("startTime")),
                    "completed": done,
                }
            )
    judged = [
        R.pod_saves(
            n,
            by_uid[uids[n]],
            start=start,
            end=end,
            interval=a.interval,
            slack=a.slack,
            big=int(n.rsplit("-", 1)[1]) < a.big,
        )
        for n in names
    ]
    replaced = [n for n in names if n in pods_now and pods_now[n]["metadata"]["uid"] != uids[n]]
    return {
        "node": node,
        "pods": a.pods,
        "mib": a.mib,
        "big": a.big,
        "big_mib": a.big_mib,
        "minutes": round((end - start) / 60, 2),
        "sample_s": a.sample_s,
        "saves": R.saves_summary(judged, interval=a.interval, span=end - start, slack=a.slack),
        "queue": R.queue_summary(good, a.interval),
        "failed_saves": failed,
        "failure_messages": messages,
        "replaced_pods": replaced,
        "agent_restarts": restarts,
        "agent": R.resources_summary(cpu, mem, kernel_peak=peak, resources=resources),
        "agent_resources": resources,
        "per_pod": [
            {
                "pod": p.pod,
                "big": p.big,
                "saves": p.saves,
                "on_time": p.on_time,
                "gaps": len(p.gaps),
                "worst_gap_vs_interval": round(p.worst_gap / a.interval, 3),
                "missed_windows": p.missed_windows,
            }
            for p in judged
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=50)
    ap.add_argument("--minutes", type=float, default=10, help="the measured span, after every pod's first save")
    ap.add_argument("--interval", type=int, default=60, help="the policy's interval, seconds")
    ap.add_argument("--mib", type=float, default=4, help="MiB of memory each pod holds")
    ap.add_argument("--big", type=int, default=0, help="how many of the pods hold --big-mib instead")
    ap.add_argument("--big-mib", type=float, default=128)
    ap.add_argument("--slack", type=float, default=R.DEFAULT_SLACK, help="on time: a gap <= interval x (1 + slack)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="the agent's cgroup is read this often")
    ap.add_argument("-o", "--output", choices=["text", "json"], default="text")
    ap.add_argument("--out", type=Path, help="write the result as JSON here too")
    ap.add_argument("--installed", action="store_true", help="measure the agent the cluster has; build nothing")
    a = ap.parse_args()
    if a.big > a.pods:
        sys.exit(f"error: --big {a.big} is more than --pods {a.pods}")
    if os.geteuid() != 0:
        sys.exit("error: the local cluster needs root\nhint: sudo .venv/bin/python -m bench.density")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated"))
    with e2e_lock(), local_cluster() as cluster:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        if a.installed:
            result = one(cluster, a)
        else:
            with tempfile.TemporaryDirectory() as tmp, installed_agent(cluster, Path(tmp)):
                result = one(cluster, a)
    result["command"] = " ".join(["bench.density", *sys.argv[1:]])
    text = json.dumps(result, indent=2)
    print(text if a.output == "json" else R.report(result))
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
