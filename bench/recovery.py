#!/usr/bin/env python3
"""Recovery after a node dies, step by step: detection, rescheduling, pull, restore (issue 13, item 5).

    flock /run/ks-e2e.lock .venv/bin/python -m bench.recovery [--sizes 64,2048] [--interval 20]

(or without flock: it then takes /run/ks-e2e.lock itself). On the local cluster (brought up if it is
not running), with the agent built from this tree installed for the run, for each size S MiB: a
StatefulSet pod holding S MiB of incompressible memory and counting runs on ks-n1 under a
SnapshotPolicy (--interval); after two periodic saves, in the middle of an interval, ks-n1 is killed
(hack/cluster/kill-node.sh); once the control plane sees it NotReady the script applies the
out-of-service taint (what the operator's automation does, docs/node-loss.md) and follows the
replacement on ks-n2 until it runs, resumed. Then ks-n1 is started again (hack/cluster/start-node.sh).

The steps, polled every 0.25 s: detection (kill -> NotReady: the controller-manager's
node-monitor-grace-period), taint (NotReady -> taint applied), rescheduling (taint -> replacement
bound to ks-n2: taint eviction, pod garbage collection, the StatefulSet controller, the scheduler),
pull (bound -> the agent staged the save: resume choice, pull, verify, extract), restore (staged ->
Running: the gate opens, CRIU restores).

The restore part (bound -> Running) is divided by its pull->running bound, measured in the same run
on the same nodes: the time to download every blob of the save from the registry (8 streams, from the
host) plus the time a fresh pod of the same image takes from bound to Running on ks-n2 (image cached).
Goal: at most 1.5x. Also printed: the progress lost (counts of the in-memory counter, as seconds and
as a share of the interval; at most one interval plus the save's own duration is expected). Absolute
times are shown only next to the bound or total they are divided by.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubectl_snapshot.adapters.registry.client import RegistryClient
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.timestamps import seconds
from tests.support.agent import installed_agent
from tests.support.cluster import HACK, RUN_DIR, STATE_DIR, Cluster, _cluster_lock, _load, _running
from tests.support.node_loss import good_saves, lost_node, protect, recover, statefulset

E2E_LOCK = "/run/ks-e2e.lock"
GOAL = 1.5


@contextlib.contextmanager
def e2e_lock() -> Iterator[None]:
    """Hold /run/ks-e2e.lock, unless the caller (flock(1)) already passed it to us."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == E2E_LOCK:
                yield
                return
    import fcntl

    with open(E2E_LOCK, "w") as f:
        print(f"waiting for {E2E_LOCK} ...", file=sys.stderr)
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def cluster_up() -> Cluster:
    with _cluster_lock() as env:
        found = _running()
        if found is not None:
            return found
        up = subprocess.run([str(HACK / "up.sh")], capture_output=True, text=True, timeout=3600, env=env)
        if up.returncode != 0:
            sys.exit(f"error: hack/cluster/up.sh failed ({up.returncode}):\n{up.stderr[-3000:]}")
        return _load(STATE_DIR / "cluster.env")


class _Sink:
    def write(self, b: bytes) -> int:
        return len(b)

    def seekable(self) -> bool:
        return False


def pull_all(reference: str) -> tuple[float, int]:
    """Seconds to download every blob of the artifact (manifests walked, 8 blobs at a time), and bytes."""
    client = RegistryClient(plain_http=True)
    ref = Reference.parse(reference)
    t0 = time.monotonic()
    blobs: dict[str, int] = {}
    todo = [ref]
    while todo:
        body, _, _ = client.get_manifest(todo.pop())
        doc = json.loads(body)
        for m in doc.get("manifests") or []:
            todo.append(Reference.parse(f"{ref.registry}/{ref.repository}@{m['digest']}"))
        for d in [doc.get("config") or {}, *(doc.get("layers") or []), *(doc.get("blobs") or [])]:
            if d.get("digest"):
                blobs[d["digest"]] = int(d.get("size") or 0)

    def fetch(item: tuple[str, int]) -> int:
        return client.fetch_blob(ref, item[0], _Sink(), expected_size=item[1] or None)  # type: ignore[arg-type]

    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(fetch, blobs.items()))
    return time.monotonic() - t0, total


def fresh_pod(cluster: Cluster, ns: str, name: str, node: str) -> dict[str, Any]:
    """A plain pod of the busybox image, bound to `node` at creation (no scheduler in the bound)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": cluster.busybox_image, "command": ["sleep", "3600"]}],
            "terminationGracePeriodSeconds": 0,
        },
    }


def fresh_start(cluster: Cluster, ns: str, node: str) -> float:
    """Seconds from bound to Running of a plain pod of the busybox image on `node` (second of two:
    the first makes sure the image is cached there)."""
    took = 0.0
    for i in range(2):
        name = f"fresh-{i}"
        t0 = time.monotonic()
        cluster.apply(fresh_pod(cluster, ns, name, node))
        while cluster.get_json("pod", name, "-n", ns)["status"].get("phase") != "Running":
            if time.monotonic() - t0 > 180:
                raise AssertionError(f"{name} did not run on {node}")
            time.sleep(0.1)
        took = time.monotonic() - t0
        cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
    return took


def wait_running(cluster: Cluster, ns: str, pod: str, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        r = cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "json", check=False)
        if r.returncode == 0 and (p := json.loads(r.stdout))["status"].get("phase") == "Running":
            return dict(p)
        assert time.monotonic() - t0 < timeout, f"{ns}/{pod} did not run in {timeout}s"
        time.sleep(0.5)


def saves_since(cluster: Cluster, ns: str, policy: str, t: float) -> list[dict[str, Any]]:
    """The policy's good saves created after epoch second `t` (creationTimestamp has 1 s resolution)."""
    return [
        s for s in good_saves(cluster, ns, policy) if (seconds(s["metadata"]["creationTimestamp"]) or 0) >= math.ceil(t)
    ]


def sample(cluster: Cluster, ns: str, pod: str, *, wait_s: float = 20) -> tuple[str, int]:
    for _ in range(int(wait_s / 0.5)):
        r = cluster.kubectl("exec", "-n", ns, pod, "--", "cat", "/tmp/count", check=False, timeout=30)
        if r.returncode == 0 and len(r.stdout.split()) == 2:
            tok, v = r.stdout.split()
            return tok, int(v)
        time.sleep(0.5)
    raise AssertionError(f"could not read the counter of {ns}/{pod}")


def resident_mib(cluster: Cluster, ns: str, pod: str) -> int | None:
    """The counter's resident memory (its shell is PID 1). Seen once: a pod whose save referenced 3.2 GB
    of chunks, 1.6 GB of them distinct, as if the shell held its text twice; such a run is not
    comparable with the others (report() marks it)."""
    r = cluster.kubectl("exec", "-n", ns, pod, "--", "cat", "/proc/1/status", check=False, timeout=30)
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return None


def kubelet_times(pod: dict[str, Any]) -> dict[str, str]:
    """What the kubelet recorded (1 s resolution): the gate init container's start and exit, the
    restored container's start; to split the staged -> Running step."""
    out: dict[str, str] = {}
    st = pod.get("status") or {}
    for c in st.get("initContainerStatuses") or []:
        t = (c.get("state") or {}).get("terminated") or {}
        out[f"init {c['name']} started"] = str(t.get("startedAt"))
        out[f"init {c['name']} finished"] = str(t.get("finishedAt"))
    for c in st.get("containerStatuses") or []:
        out[f"{c['name']} started"] = str(((c.get("state") or {}).get("running") or {}).get("startedAt"))
    return out


def staged_event(cluster: Cluster, ns: str, pod: str) -> str:
    """The agent's RestoreStaged Event of the replacement: where its staging's time went."""
    events = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={pod},reason=RestoreStaged")
    messages = [str(e.get("message")) for e in events.get("items") or []]
    return messages[-1] if messages else ""


def one(cluster: Cluster, mib: int, interval: int) -> dict[str, Any]:
    n1, n2 = cluster.nodes[:2]
    ns = f"bench-recovery-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        deadline = time.monotonic() + 60
        while cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode != 0:
            assert time.monotonic() < deadline, "no default ServiceAccount"
            time.sleep(0.5)
        name = "mem"
        protect(cluster, ns, name, interval, keep=2)
        cluster.apply(statefulset(name, ns, cluster.busybox_image, mib=mib, prefer=n1))
        pod = f"{name}-0"
        p = wait_running(cluster, ns, pod, 300)
        assert p["spec"]["nodeName"] == n1, f"{pod} runs on {p['spec']['nodeName']}, not {n1}"
        uid = p["metadata"]["uid"]
        tok, v0 = sample(cluster, ns, pod, wait_s=20 + mib / 8)  # it counts once its memory is filled
        t_v0 = time.time()
        deadline = time.monotonic() + interval * 6 + mib / 8
        # two saves begun after the counter ran: a large pod's first saves catch it still filling its
        # memory, and a replacement resumed from one of those draws its token only then (a resume, but
        # not of the counter this bench follows)
        while len(saves_since(cluster, ns, name, t_v0)) < 2:
            assert time.monotonic() < deadline, f"no two periodic saves of {pod} in time"
            time.sleep(0.5)
        time.sleep(interval / 2)
        tok_k, v_kill = sample(cluster, ns, pod)
        t_sample = time.time()
        rss = resident_mib(cluster, ns, pod)
        rate = (v_kill - v0) / (t_sample - t_v0)
        saved = good_saves(cluster, ns, name)[-1]
        pull_s, pulled = pull_all(saved["status"]["reference"])
        start_s = fresh_start(cluster, ns, n2)
        with lost_node(cluster, n1) as killed:
            rec = recover(cluster, ns, pod, uid, n1, killed, timeout=600 + mib / 4)
            tok2, resumed = sample(cluster, ns, pod)
        assert tok2 == tok_k == tok, "the replacement started fresh"
        lost = v_kill - resumed + rate * (killed - t_sample)
        steps = rec.breakdown()
        bound = pull_s + start_s
        restore = steps["pull_s"] + steps["restore_s"]
        return {
            "mib": mib,
            "rss_mib": rss,
            "replacement_kubelet_times": kubelet_times(rec.pod),
            "agent_staging": staged_event(cluster, ns, pod),
            "interval_s": interval,
            "save_bytes": saved["status"].get("size"),
            "pulled_bytes": pulled,
            "steps_s": {k: round(v, 2) for k, v in steps.items()},
            "lost_counts": round(lost),
            "lost_s": round(lost / rate, 1),
            "lost_intervals": round(lost / rate / interval, 2),
            "bound_pull_s": round(pull_s, 2),
            "bound_fresh_start_s": round(start_s, 2),
            "restore_vs_bound": round(restore / bound, 2),
        }
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64", help="MiB of memory per pod, comma-separated (e.g. 64,2048)")
    ap.add_argument("--interval", type=int, default=20, help="the SnapshotPolicy's interval in seconds")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: the local cluster needs root\nhint: sudo .venv/bin/python -m bench.recovery")
    # a timeout's SIGTERM unwinds like an error: the killed node is started again (lost_node's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated; the node is being started again"))
    rows = []
    with e2e_lock():
        cluster = cluster_up()
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp, installed_agent(cluster, Path(tmp)):
            for mib in (int(s) for s in a.sizes.split(",")):
                rows.append(one(cluster, mib, a.interval))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(report(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2) + "\n")


def report(rows: list[dict[str, Any]]) -> str:
    out = [
        "| pod memory | kill -> Running | detection | taint | rescheduling | pull (stage) | restore "
        f"| restore (bound -> Running) vs pull->running bound (goal <= {GOAL}x) | progress lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["steps_s"]
        total = s["kill_to_running_s"]

        def share(k: str, s: dict[str, float] = s, total: float = total) -> str:
            return f"{s[k] / total:.0%}"

        rss = r.get("rss_mib")
        held = f"RSS {rss} MiB, " if rss is not None else ""
        if rss is not None and rss > 1.25 * r["mib"]:
            held = f"**RSS {rss} MiB: not comparable**, "  # the workload doubled itself (resident_mib)
        out.append(
            f"| {r['mib']} MiB ({held}save {r['save_bytes'] / 2**20:.0f} MiB) | {total:.1f} s "
            f"| {share('detection_s')} | {share('taint_s')} | {share('rescheduling_s')} | {share('pull_s')} "
            f"| {share('restore_s')} | {r['restore_vs_bound']:.2f}x ({s['pull_s'] + s['restore_s']:.1f} s / "
            f"{r['bound_pull_s'] + r['bound_fresh_start_s']:.1f} s = pull {r['bound_pull_s']:.1f} s + fresh start "
            f"{r['bound_fresh_start_s']:.1f} s) | {r['lost_intervals']:.2f} interval ({r['lost_s']:.1f} s of "
            f"{r['interval_s']} s) |"
        )
    out.append(
        "\nShares are of kill -> Running. Detection is the controller-manager's node-monitor-grace-period "
        "(the cluster's default); the taint is applied by this script as soon as the node is NotReady. RSS: the "
        "counter's resident memory before the kill; a pod holding more than 1.25x its size is marked not "
        "comparable: the bound downloads each distinct blob once, CRIU writes it all."
    )
    return "\n".join(out)


if __name__ == "__main__":
    main()
